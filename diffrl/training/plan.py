"""Derived batch arithmetic printed at start-up (and by ``--dry-run``)."""

from __future__ import annotations

import math

from diffrl.config import ConfigError
from diffrl.sampling.windows import step_kinds
from diffrl.training.passes import trained_step_count


def _family(cfg):
    """The family's adapter class, whose class attributes hold its facts (latent layout,
    CFG rule, video): read without building a model."""
    from diffrl.models import adapter_class

    return adapter_class(cfg.model.family)


def _uses_cfg(cfg) -> bool:
    return _family(cfg).cfg_as_batch and cfg.model.guidance_scale > 1.0


def latent_numel(cfg) -> int:
    return _family(cfg).latent_numel(cfg.model)


def _tree_numbers(cfg, trees_per_process: int) -> dict[str, float]:
    """Per-process rollout and training numbers of BranchGRPO trees at iteration 0."""
    from diffrl.algorithms.tree_credit import trained_edge_counts
    from diffrl.sampling.tree import TreeSpec

    spec = TreeSpec.from_config(cfg)
    kinds = step_kinds(cfg.sampling, spec.num_steps, 0, always_sde=spec.split_steps)
    counts = [trees_per_process * c for c in trained_edge_counts(spec, kinds, cfg.tree, 0)]
    # as diffrl.training.passes.edge_major: timestep_fraction keeps that share of each step's edges
    trained = sum(max(1, math.ceil(cfg.objective.timestep_fraction * c)) for c in counts if c)
    if not trained:
        raise ConfigError(
            "the tree trains no edge at iteration 0: tree.depth_pruning, the SDE window and the "
            "single-node trunk before the first split leave nothing; prune fewer steps"
        )
    return {
        "nodes": trees_per_process * sum(spec.nodes_at(d) for d in range(spec.num_steps + 1)),
        "nfe": trees_per_process * spec.nfe_per_tree(),
        "trained": trained,
        "sde_steps": sum(k != "ode" for k in kinds),
    }


def _solrl_numbers(cfg) -> dict[str, float]:
    """Sol-RL's pool and regeneration cost per iteration. A tree sub-tree's size depends
    on which leaves are selected, so its regeneration NFE is an upper bound (every
    selected leaf on its own branch wherever the tree allows)."""
    from diffrl.sampling.tree import TreeSpec

    sol, prompts, k = cfg.solrl, cfg.rollout.prompts_per_step, cfg.rollout.group_size
    steps = cfg.sampling.num_steps
    out = {"solrl_pool_size": sol.pool_size}
    if cfg.rollout.strategy == "tree":
        from diffrl.algorithms.tree_credit import depth_pruned_steps

        spec = TreeSpec.from_config(cfg)
        kinds = step_kinds(cfg.sampling, steps, 0, always_sde=spec.split_steps)
        pruned = depth_pruned_steps(cfg.tree, 0)
        explore = prompts * spec.nfe_per_tree()
        regenerate = prompts * sum(min(spec.nodes_at(t), k) for t in range(steps))
        if cfg.objective.name != "nft":  # NFT trains the leaves, as independent samples
            out["trained_transitions_per_iteration_max"] = prompts * sum(
                min(spec.nodes_at(t + 1), k)
                for t in range(steps)
                if kinds[t] != "ode" and t not in pruned and spec.nodes_at(t + 1) > 1
            )
    else:
        explore_steps = (sol.explore_num_steps or steps) if sol.explore == "ode" else steps
        explore, regenerate = prompts * sol.pool_size * explore_steps, prompts * k * steps
    return {
        **out,
        "solrl_explore_nfe_per_iteration": explore,
        "solrl_regenerate_nfe_per_iteration": regenerate,
    }


def derive(cfg, num_processes: int = 1) -> dict[str, float]:
    """Every number a user should sanity-check before launching a run."""
    samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    per_process = samples / num_processes
    steps = cfg.sampling.num_steps
    kinds = step_kinds(cfg.sampling, steps, 0)
    sde_steps = sum(k != "ode" for k in kinds)
    # NFT noises x0 afresh (forward process), so every step's sigma can be trained
    usable = steps if cfg.objective.name == "nft" else sde_steps
    trained_steps = trained_step_count(cfg.objective.timestep_fraction, usable) if usable else 0
    cfg_mult = 2 if _uses_cfg(cfg) else 1
    micro_batches = math.ceil(per_process / cfg.train.micro_batch_size)
    opt_steps = cfg.train.num_inner_epochs * math.ceil(micro_batches / cfg.train.gradient_accumulation)
    # trajectory buffers: latents (T+1) + means (T) + step noise (T), fp32
    traj_bytes = per_process * (3 * steps + 1) * latent_numel(cfg) * 4
    ref_mult = 2 if cfg.objective.kl_coef > 0 else 1
    rollout_nfe, trained_rows = samples * steps, samples * trained_steps
    whole = (
        "Sol-RL selects within each prompt's pool"
        if cfg.solrl.enabled
        else "rollout.strategy tree keeps each prompt's tree"
    )
    if (cfg.solrl.enabled or cfg.rollout.strategy == "tree") and cfg.rollout.prompts_per_step % num_processes:
        raise ConfigError(
            f"{whole} on one process: make rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) "
            f"divisible by the {num_processes} processes"
        )
    solrl = {}
    if cfg.solrl.enabled:
        solrl = _solrl_numbers(cfg)
        rollout_nfe = solrl["solrl_explore_nfe_per_iteration"] + solrl["solrl_regenerate_nfe_per_iteration"]
        # a sub-tree's edges depend on the selection: report the bound, not a count
        trained_rows = solrl.pop("trained_transitions_per_iteration_max", trained_rows)
    elif cfg.rollout.strategy == "tree" and cfg.objective.name != "nft":
        tree = _tree_numbers(cfg, cfg.rollout.prompts_per_step // num_processes)
        rollout_nfe, trained_rows = tree["nfe"] * num_processes, tree["trained"] * num_processes
        sde_steps, trained_steps = tree["sde_steps"], trained_rows / samples
        traj_bytes = 3 * tree["nodes"] * latent_numel(cfg) * 4  # latents, means, noise per node
    return {
        "processes": num_processes,
        "prompts_per_step": cfg.rollout.prompts_per_step,
        "group_size": cfg.rollout.group_size,
        "samples_per_iteration": samples,
        "samples_per_process": per_process,
        "denoising_steps": steps,
        "sde_steps": sde_steps,
        "trained_steps_per_sample": float(trained_steps),
        "rollout_nfe_per_iteration": rollout_nfe,
        "rollout_nfe_per_leaf": rollout_nfe / samples,
        "rollout_nfe_vs_independent": rollout_nfe / (samples * steps),
        "rollout_transformer_rows_per_iteration": rollout_nfe * cfg_mult,
        (
            "trained_transitions_per_iteration_max"
            if cfg.solrl.enabled and cfg.rollout.strategy == "tree" and cfg.objective.name != "nft"
            else "trained_transitions_per_iteration"
        ): trained_rows,
        "training_transformer_rows_per_iteration": trained_rows
        * cfg.train.num_inner_epochs
        * cfg_mult
        * ref_mult,
        "optimizer_steps_per_iteration": opt_steps,
        "optimizer_steps_total": opt_steps * cfg.train.max_steps,
        "trajectory_buffer_mib_per_process": traj_bytes / 2**20,
        **solrl,
    }


def format_plan(numbers: dict[str, float]) -> str:
    width = max(len(k) for k in numbers)
    lines = ["run plan:"]
    for k, v in numbers.items():
        if isinstance(v, float) and not v.is_integer():
            text = f"{v:.1f}" if abs(v) >= 100 else f"{v:.3g}"
        else:
            text = f"{int(v)}"
        lines.append(f"  {k:<{width}}  {text}")
    return "\n".join(lines)

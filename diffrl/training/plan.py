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


def image_numel(cfg) -> int:
    """Elements of one decoded sample (RGB, times the frames of a video), as decoded."""
    frames = cfg.model.num_frames if _family(cfg).is_video_family() else 1
    return 3 * frames * cfg.model.height * cfg.model.width


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


def _solrl_numbers(cfg, num_processes: int) -> dict[str, float]:
    """Sol-RL's pool and regeneration cost per iteration. A tree sub-tree's size depends
    on which leaves are selected, so its regeneration NFE and its nodes are upper bounds
    (every selected leaf on its own branch wherever the tree allows).

    The pool keeps its decoded images until they are scored, and a tree pool its node
    layout (four int64 per node); no per-step latent or mean (:mod:`diffrl.precision.solrl`).
    Those images are freed before the regeneration: a rollout-time buffer, never alive
    with the update's activations."""
    from diffrl.sampling.tree import TreeSpec

    sol, prompts, k = cfg.solrl, cfg.rollout.prompts_per_step, cfg.rollout.group_size
    steps = cfg.sampling.num_steps
    pool_bytes = prompts * sol.pool_size * image_numel(cfg) * 4
    out = {"solrl_pool_size": sol.pool_size}
    if cfg.rollout.strategy == "tree":
        from diffrl.algorithms.tree_credit import depth_pruned_steps

        spec = TreeSpec.from_config(cfg)
        kinds = step_kinds(cfg.sampling, steps, 0, always_sde=spec.split_steps)
        pruned = depth_pruned_steps(cfg.tree, 0)
        explore = prompts * spec.nfe_per_tree()
        regenerate = prompts * sum(min(spec.nodes_at(t), k) for t in range(steps))
        pool_bytes += prompts * sum(spec.nodes_at(d) for d in range(steps + 1)) * 4 * 8
        # the regenerated sub-tree stores latents, means and noise per kept node
        out["subtree_nodes_max"] = prompts * sum(min(spec.nodes_at(d), k) for d in range(steps + 1))
        if not _trains_clean_samples(cfg):  # NFT trains the leaves, as independent samples
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
        "solrl_pool_mib_per_process": pool_bytes / num_processes / 2**20,
    }


def _trains_clean_samples(cfg) -> bool:
    """A forward-process objective (DiffusionNFT) noises x0 afresh: every step's sigma
    is usable, and a tree's leaves train as independent samples."""
    from diffrl.algorithms import get_objective

    return get_objective(cfg.objective.name).forward_process


def _check_whole_groups(cfg, num_processes: int) -> None:
    from diffrl.algorithms import get_objective

    grouped = get_objective(cfg.objective.name).whole_groups
    if not (cfg.solrl.enabled or cfg.rollout.strategy == "tree" or grouped):
        return
    if cfg.rollout.prompts_per_step % num_processes:
        if cfg.solrl.enabled:
            whole = "Sol-RL selects within each prompt's pool"
        elif cfg.rollout.strategy == "tree":
            whole = "rollout.strategy tree keeps each prompt's tree"
        else:
            whole = f"objective {cfg.objective.name} compares each prompt's whole group"
        raise ConfigError(
            f"{whole} on one process: make rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) "
            f"divisible by the {num_processes} processes"
        )


def _rollout_and_training(cfg, num_processes: int) -> dict[str, float]:
    """Rollout NFE, trained transitions and trajectory bytes, per strategy."""
    samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    steps = cfg.sampling.num_steps
    sde_steps = sum(k != "ode" for k in step_kinds(cfg.sampling, steps, 0))
    usable = steps if _trains_clean_samples(cfg) else sde_steps
    trained_steps = trained_step_count(cfg.objective.timestep_fraction, usable) if usable else 0
    out = {
        "sde_steps": sde_steps,
        "trained_steps": trained_steps,
        "rollout_nfe": samples * steps,
        "trained_rows": samples * trained_steps,
        # trajectory buffers: latents (T+1) + means (T), fp32 (no step noise: not kept)
        "traj_bytes": samples / num_processes * (2 * steps + 1) * latent_numel(cfg) * 4,
        "solrl": {},
    }
    if cfg.solrl.enabled:
        solrl = _solrl_numbers(cfg, num_processes)
        out["rollout_nfe"] = (
            solrl["solrl_explore_nfe_per_iteration"] + solrl["solrl_regenerate_nfe_per_iteration"]
        )
        # a sub-tree's edges and nodes depend on the selection: report the bounds, not counts
        out["trained_rows"] = solrl.pop("trained_transitions_per_iteration_max", out["trained_rows"])
        if "subtree_nodes_max" in solrl:  # latents, means, noise per node, as for a whole tree
            out["traj_bytes"] = 3 * solrl.pop("subtree_nodes_max") / num_processes * latent_numel(cfg) * 4
        out["solrl"] = solrl
    elif cfg.rollout.strategy == "tree" and not _trains_clean_samples(cfg):
        tree = _tree_numbers(cfg, cfg.rollout.prompts_per_step // num_processes)
        out["rollout_nfe"], out["trained_rows"] = tree["nfe"] * num_processes, tree["trained"] * num_processes
        out["sde_steps"], out["trained_steps"] = tree["sde_steps"], out["trained_rows"] / samples
        out["traj_bytes"] = 3 * tree["nodes"] * latent_numel(cfg) * 4  # latents, means, noise per node
    return out


def derive(cfg, num_processes: int = 1) -> dict[str, float]:
    """Every number a user should sanity-check before launching a run."""
    _check_whole_groups(cfg, num_processes)
    samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    steps, epochs = cfg.sampling.num_steps, cfg.train.num_inner_epochs
    micro_batches = math.ceil(samples / num_processes / cfg.train.micro_batch_size)
    opt_steps = epochs * math.ceil(micro_batches / cfg.train.gradient_accumulation)
    cfg_mult = 2 if _uses_cfg(cfg) else 1
    ref_mult = 2 if cfg.objective.kl_coef > 0 else 1  # the KL term runs the reference too
    n = _rollout_and_training(cfg, num_processes)
    if cfg.rollout.strategy == "tree" and cfg.tree.edges_per_step > 0:  # BranchGRPO: a step per N edges
        opt_steps = epochs * max(1, math.ceil(n["trained_rows"] / num_processes / cfg.tree.edges_per_step))
    subtree = cfg.solrl.enabled and cfg.rollout.strategy == "tree" and not _trains_clean_samples(cfg)
    return {
        "processes": num_processes,
        "prompts_per_step": cfg.rollout.prompts_per_step,
        "group_size": cfg.rollout.group_size,
        "samples_per_iteration": samples,
        "samples_per_process": samples / num_processes,
        "denoising_steps": steps,
        "sde_steps": n["sde_steps"],
        "trained_steps_per_sample": float(n["trained_steps"]),
        "rollout_nfe_per_iteration": n["rollout_nfe"],
        "rollout_nfe_per_leaf": n["rollout_nfe"] / samples,
        "rollout_nfe_vs_independent": n["rollout_nfe"] / (samples * steps),
        "rollout_transformer_rows_per_iteration": n["rollout_nfe"] * cfg_mult,
        ("trained_transitions_per_iteration_max" if subtree else "trained_transitions_per_iteration"): n[
            "trained_rows"
        ],
        "training_transformer_rows_per_iteration": n["trained_rows"] * epochs * cfg_mult * ref_mult,
        "optimizer_steps_per_iteration": opt_steps,
        "optimizer_steps_total": opt_steps * cfg.train.max_steps,
        "trajectory_buffer_mib_per_process": n["traj_bytes"] / 2**20,
        **n["solrl"],
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

"""Derived batch arithmetic printed at start-up (and by ``--dry-run``)."""

from __future__ import annotations

import math

# latent elements per pixel-area unit: (channels, spatial downsampling, packs frames?)
_LATENT_LAYOUT = {"flux": (16, 8), "sd3": (16, 8), "sana": (32, 32), "wan": (16, 8)}


def _uses_cfg(cfg) -> bool:
    return cfg.model.family != "flux" and cfg.model.guidance_scale > 1.0


def latent_numel(cfg) -> int:
    channels, factor = _LATENT_LAYOUT.get(cfg.model.family, (16, 8))
    frames = (cfg.model.num_frames - 1) // 4 + 1 if cfg.model.family == "wan" else 1
    return channels * frames * (cfg.model.height // factor) * (cfg.model.width // factor)


def derive(cfg, num_processes: int = 1) -> dict[str, float]:
    """Every number a user should sanity-check before launching a run."""
    samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    per_process = samples / num_processes
    steps = cfg.sampling.num_steps
    window = cfg.sampling.sde_window or [0, steps]
    sde_steps = 0 if cfg.sampling.sde_type == "ode" else window[1] - window[0]
    trained_steps = max(1, math.ceil(cfg.objective.timestep_fraction * sde_steps)) if sde_steps else 0
    cfg_mult = 2 if _uses_cfg(cfg) else 1
    micro_batches = math.ceil(per_process / cfg.train.micro_batch_size)
    opt_steps = cfg.train.num_inner_epochs * math.ceil(micro_batches / cfg.train.gradient_accumulation)
    # trajectory buffers: latents (T+1) + means (T) + step noise (T), fp32
    traj_bytes = per_process * (3 * steps + 1) * latent_numel(cfg) * 4
    ref_mult = 2 if cfg.objective.kl_coef > 0 else 1
    return {
        "processes": num_processes,
        "prompts_per_step": cfg.rollout.prompts_per_step,
        "group_size": cfg.rollout.group_size,
        "samples_per_iteration": samples,
        "samples_per_process": per_process,
        "denoising_steps": steps,
        "sde_steps": sde_steps,
        "trained_steps_per_sample": trained_steps,
        "rollout_nfe_per_iteration": samples * steps,
        "rollout_transformer_rows_per_iteration": samples * steps * cfg_mult,
        "training_transformer_rows_per_iteration": samples * trained_steps * cfg.train.num_inner_epochs
        * cfg_mult * ref_mult,
        "optimizer_steps_per_iteration": opt_steps,
        "optimizer_steps_total": opt_steps * cfg.train.max_steps,
        "trajectory_buffer_mib_per_process": traj_bytes / 2**20,
    }


def format_plan(numbers: dict[str, float]) -> str:
    width = max(len(k) for k in numbers)
    lines = ["run plan:"]
    for k, v in numbers.items():
        text = f"{v:.1f}" if isinstance(v, float) and not v.is_integer() else f"{int(v)}"
        lines.append(f"  {k:<{width}}  {text}")
    return "\n".join(lines)

"""Independent group rollouts that return trajectories as data.

"Trajectories are data" (docs/ARCHITECTURE.md): the loss reads a :class:`Trajectory` and nothing
else about how it was produced, so a tree sampler or a low-precision pool can produce
the same structure.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from diffrl.sampling import rng
from diffrl.sampling.dpm import DPM2
from diffrl.sampling.schedule import check_consistency_grid, sigma_grid
from diffrl.sampling.sde import step
from diffrl.sampling.settings import SamplerSettings
from diffrl.sampling.windows import step_kinds


@dataclass
class Trajectory:
    """A batch of denoising paths (B samples, T steps).

    ``latents[:, t]`` is x_t (t = 0 is the initial noise, t = T the final latent);
    step t maps latents[:, t] -> latents[:, t + 1] at sigmas[t] -> sigmas[t + 1].

    Latents and means stay fp32 when the model computes in bf16, on purpose: the old
    log-prob and mean are fp32 functions of the stored x_t, x_{t+1}, and bf16 copies
    move the first inner step's log-ratio by up to 4e-5 at 1024 px (2e-4 on the tiny
    twins; the configs clip at 1e-4, GRPO-Guard at 2e-6) and the DPPO KL by up to 3e-5
    (its threshold: 1e-5). tests/sampling/test_rollout_storage.py measures it.
    """

    latents: torch.Tensor  # (B, T+1, *shape) fp32
    means: torch.Tensor  # (B, T, *shape) fp32 transition means
    log_probs: torch.Tensor  # (B, T) log-prob of each taken step under the rollout policy
    stds: torch.Tensor  # (B, T) transition stds (0 for ODE steps)
    std_ts: torch.Tensor  # (B, T) the step rule's noise scale (for the flow_grpo KL variant)
    sigmas: torch.Tensor  # (T+1,) fp32
    step_kinds: list[str]  # (T,) rule used at each step ("ode" outside the SDE window)
    # (B, T, *shape) the eps drawn per step (zeros for ODE steps), kept only when asked
    # (``keep_noise``): no update reads it, and at a pool's size it was a third of the
    # trajectory's memory; a path's noise follows from its key (``step_noise``)
    step_noise: torch.Tensor | None
    keys: list[tuple]  # (B,) per-sample RNG keys: (seed, step, prompt_index, sample_index)
    nfe: int = 0  # transformer evaluations spent (a CFG forward counts once per batch row)
    images: torch.Tensor | None = None  # decoded x_T, [0, 1]
    extras: dict = field(default_factory=dict)
    noise_levels: list[float] | None = None  # (T,) step-rule noise level per step (tree splits may scale it)

    @property
    def num_leaves(self) -> int:
        return len(self.keys)

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[1]

    def trainable_steps(self) -> list[int]:
        """Steps with a stochastic transition (std > 0): only these have a policy ratio."""
        stochastic = (self.stds > 0).all(0).tolist()  # one host read for every step
        return [t for t in range(self.num_steps) if self.step_kinds[t] != "ode" and stochastic[t]]

    def transition(self, rows, t: int):
        """(x_t, x_next, old log-prob, conditioning rows) of samples ``rows`` at step t."""
        ix = torch.as_tensor(rows)
        return (
            self.latents[ix, t],
            self.latents[ix, t + 1],
            self.log_probs[ix, t],
            [int(i) for i in ix.tolist()],
        )

    def old_means(self, rows, t: int) -> torch.Tensor:
        """The rollout's transition means of samples ``rows`` at step t."""
        return self.means[torch.as_tensor(rows), t]

    def select(self, index) -> Trajectory:
        idx = torch.as_tensor(index, dtype=torch.long)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("sigmas", "step_kinds", "nfe", "extras", "noise_levels"):
                out[f.name] = value
            elif f.name == "keys":
                out[f.name] = [value[i] for i in idx.tolist()]
            elif isinstance(value, torch.Tensor):
                out[f.name] = value[idx.to(value.device)]
            else:
                out[f.name] = value
        return Trajectory(**out)

    @staticmethod
    def cat(parts: list[Trajectory], consume: bool = False) -> Trajectory:
        """One trajectory of ``parts`` in order. ``consume``: the parts are dropped field by
        field as they are joined, so joining holds the whole plus one field's worth, not two
        wholes (an iteration's trajectories are its largest buffer)."""
        first = parts[0]
        out = {}
        for f in fields(first):
            values = [getattr(p, f.name) for p in parts]
            if f.name in ("sigmas", "step_kinds", "extras", "noise_levels"):
                out[f.name] = values[0]
            elif f.name == "nfe":
                out[f.name] = sum(values)
            elif f.name == "keys":
                out[f.name] = [k for v in values for k in v]
            elif values[0] is None:
                out[f.name] = None
            else:
                out[f.name] = torch.cat(values)
                if consume:
                    del values
                    for p in parts:
                        setattr(p, f.name, None)
        return Trajectory(**out)


@dataclass
class ExploredPool:
    """An independent exploration pool as Sol-RL reads it (Sol-RL, "FP4 Explore, BF16
    Train", Sec. 3): selection scores ``images``, and the BF16 regeneration replays
    ``keys`` (initial and per-step noise follow from a key). No per-step tensor is kept:
    nothing reads a pool's latents, means or log-probs, and at sd35_solrl's size (384
    candidates, 10 steps, 16x128x128 latents) its latents and means were 8064 MiB."""

    keys: list[tuple]  # (B,) per-sample RNG keys, as in :class:`Trajectory`
    nfe: int = 0
    images: torch.Tensor | None = None  # decoded x_T, [0, 1]; dropped once scored

    @property
    def num_leaves(self) -> int:
        return len(self.keys)

    def fill(self, start: int, part: ExploredPool) -> None:
        """Write the decoded chunk ``part`` (candidates from ``start`` on) into the pool's
        images, allocated once at the first chunk: joining the chunks at the end would hold
        every image twice for a moment."""
        if self.images is None:
            self.images = part.images.new_empty((len(self.keys), *part.images.shape[1:]))
        self.images[start : start + len(part.keys)] = part.images
        self.nfe += part.nfe


def initial_noise(shape, keys, same_in_group: bool = False) -> torch.Tensor:
    """One initial noise per sample key; with ``same_in_group`` the noise of the group's
    first sample for every member (a key is (seed, step, prompt, sample); DanceGRPO's
    ``init_same_noise``)."""
    if same_in_group:
        keys = [(*k[:-1], 0) for k in keys]
    return rng.randn_batch(shape, keys, "init")


def step_noise(shape, keys, t: int) -> torch.Tensor:
    return rng.randn_batch(shape, keys, "sde", t)


@torch.no_grad()
def denoise(
    adapter,
    transformer,
    cond,
    keys,
    sigmas,
    kinds,
    noise_levels,
    reduction="mean",
    init_noise: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    keep_noise: bool = False,
    ode_solver: str = "euler",
) -> Trajectory:
    """Run one batch of independent paths to x_T.

    Noise is drawn from each path's key unless given: ``init_noise`` (B, *shape) and
    ``noise`` (B, T, *shape) replay stored draws (a tree path, a BF16 regeneration).
    ``noise_levels`` is one float for every step, or one per step. ``keep_noise`` stores
    the draws in ``step_noise`` (for a replay). ``ode_solver: dpm2`` takes the
    deterministic steps by DPM-Solver++(2M) (:mod:`diffrl.sampling.dpm`), else Euler."""
    device = adapter.device
    shape = adapter.latent_shape()
    b, n = len(keys), len(kinds)
    levels = (
        [float(noise_levels)] * n
        if isinstance(noise_levels, (int, float))
        else [float(a) for a in noise_levels]
    )
    x = rng.to_device(initial_noise(shape, keys) if init_noise is None else init_noise.float(), device)
    sigma_1 = float(sigmas[1]) if len(sigmas) > 1 else None
    latents, means, noises = [x], [], []
    log_probs, stds, std_ts = (torch.zeros(b, n, device=device) for _ in range(3))
    dpm = DPM2(n) if ode_solver == "dpm2" else None
    for t, kind in enumerate(kinds):
        v = adapter.velocity(transformer, x, sigmas[t].expand(b).to(device), cond)
        if kind == "ode":
            eps = torch.zeros_like(x)
        else:
            eps = rng.to_device(step_noise(shape, keys, t) if noise is None else noise[:, t].float(), device)
        x, mean, res = _advance(kind, x, v, sigmas, t, levels[t], sigma_1, eps, reduction, dpm)
        if res is not None:
            log_probs[:, t], stds[:, t], std_ts[:, t] = res.log_prob, res.std, res.std_t
        latents.append(x)
        means.append(mean)
        noises += [eps] if keep_noise else []
    return Trajectory(
        latents=torch.stack(latents, 1),
        means=torch.stack(means, 1),
        log_probs=log_probs,
        stds=stds,
        std_ts=std_ts,
        sigmas=sigmas.cpu(),
        step_kinds=list(kinds),
        step_noise=torch.stack(noises, 1) if keep_noise else None,
        keys=list(keys),
        nfe=b * n,
        noise_levels=levels,
    )


def _advance(kind, x, v, sigmas, t: int, level: float, sigma_1, eps, reduction, dpm):
    """One step of :func:`denoise`: (next latents, mean, the step's result or None). A
    deterministic step of the DPM-Solver++(2M) solver has no log-prob and std 0."""
    if dpm is not None and kind == "ode":
        x = dpm.step(t, x.float(), v.float(), float(sigmas[t]), float(sigmas[t + 1]))
        return x, x, None
    res = step(kind, x, v, sigmas[t], sigmas[t + 1], level, sigma_1=sigma_1, noise=eps, reduction=reduction)
    return res.next_latents, res.mean, res


def rollout_independent(
    adapter,
    transformer,
    cond,
    keys,
    cfg,
    num_steps: int | None = None,
    kinds: list[str] | None = None,
    iteration: int = 0,
    on_images=None,
    keep_noise: bool = False,
    keep_steps: bool = True,
) -> Trajectory | ExploredPool:
    """Independent rollouts for ``keys`` in chunks of ``rollout.batch_size``, decoded.

    ``cfg`` is a Config or its :class:`SamplerSettings`. ``cond`` holds one row per key.
    Each path's noise depends only on its key, so the result is the same whatever the
    chunking (tested). ``iteration`` places a sliding SDE window (see
    :mod:`diffrl.sampling.windows`). ``on_images(indices, images)`` is called with each
    decoded chunk as soon as it exists (a reward server starts scoring it while the next
    chunk denoises). ``keep_noise``: as in :func:`denoise`. ``keep_steps=False`` (a Sol-RL
    exploration pool) drops each chunk's per-step tensors once it is decoded and returns
    an :class:`ExploredPool`: one chunk's steps are held at a time, not the pool's.
    """
    s = SamplerSettings.of(cfg)
    n = num_steps or s.sampling.num_steps
    sigmas = sigma_grid(adapter, n, s.sampling.sigma_shift)
    kinds = kinds or step_kinds(s.sampling, n, iteration, seed=s.seed)
    check_consistency_grid(sigmas, kinds)
    parts, pool = [], ExploredPool(list(keys))
    for start in range(0, len(keys), s.batch_size):
        idx = list(range(start, min(start + s.batch_size, len(keys))))
        chunk_keys = [keys[i] for i in idx]
        args = (cond.select(idx), chunk_keys, sigmas, kinds, s.sampling.noise_level)
        init = initial_noise(adapter.latent_shape(), chunk_keys, True) if s.same_noise else None
        part = _decoded_chunk(
            adapter,
            transformer,
            args,
            s.logprob_reduction,
            keep_noise,
            keep_steps,
            init,
            s.sampling.ode_solver,
        )
        if on_images is not None:
            on_images(idx, part.images)
        if keep_steps:
            parts.append(part)
        else:
            pool.fill(start, part)
    return Trajectory.cat(parts, consume=True) if keep_steps else pool


def _decoded_chunk(
    adapter, transformer, args, reduction, keep_noise: bool, keep_steps: bool, init=None, ode_solver="euler"
):
    """One chunk denoised and decoded; without ``keep_steps`` only its keys, NFE and
    images leave this function (the chunk's trajectory is freed on return)."""
    traj = denoise(
        adapter, transformer, *args, reduction, init_noise=init, keep_noise=keep_noise, ode_solver=ode_solver
    )
    with torch.no_grad():
        traj.images = adapter.decode(traj.latents[:, -1]).float()
    return traj if keep_steps else ExploredPool(traj.keys, traj.nfe, traj.images)

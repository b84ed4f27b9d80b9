"""Flow-matching pretraining of the toy model on ShapeWorld (``scripts/pretrain_toy.py``).

Rectified-flow objective as in SD3 (Esser et al. 2024, Eq. 1 with the logit-normal
timestep density of Sec. 3.1): x_sigma = (1 - sigma) x0 + sigma eps and the loss is the
MSE to v = eps - x0. The transformer predicts x0 and the velocity is derived from it
(x-prediction with v-loss, Li & He 2025), see ``diffrl.models.toy.velocity_from_output``.
Captions are dropped to "" with probability ``caption_dropout`` so classifier-free
guidance is available. The text encoder trains jointly from scratch.

``caption_noise`` models noisy web captions: with that probability a caption's image shows
a scene that violates one of its clauses (``shapeworld.corrupt``: a wrong count, colour or
shape, a missing object or the opposite relation) while the text stays. The model then
learns to draw the right scene only part of the time although it is able to draw it, the
situation preference alignment is for (real text-to-image models follow prompts loosely
because their captions do). ``init`` continues from a saved toy model instead of a random
one (a fresh optimizer and warm-up).

Everything random is keyed by (seed, step): batches are re-rendered from the seed, the
learning rate is constant after warm-up and the EMA has no horizon, so a run stopped at
step N equals a run with ``--steps N`` (on the same torch build and thread count).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from diffrl.models import tiny
from diffrl.models.toy import ToyPipeline, build_components
from diffrl.training.policy import EMA
from rewards.shapeworld import grammar
from rewards.shapeworld.render import corrupt, render


@dataclass
class PretrainConfig:
    out: str = "assets/toy_model"
    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 250
    ema_decay: float = 0.999
    caption_dropout: float = 0.1
    resolution: int = 32
    prediction: str = "x0"  # what the transformer outputs; the loss is on the velocity either way
    grid: int = 8  # one object per patch-sized cell (patch size 8): see shapeworld.layout
    seed: int = 0
    eval_every: int = 500
    eval_prompts: int = 96
    eval_steps: int = 20
    snapshots: str | None = None  # directory for a copy of the EMA model at every eval
    caption_noise: float = 0.0  # probability that an image violates one clause of its caption
    init: str | None = None  # a saved toy model directory to continue from (None: random init)
    sigma_location: float = 0.0  # m of the logit-normal(m, 1) sigma density; m > 0 favours high noise
    kind_weights: str = "1,1,1"  # relative frequency of count, pair and relation captions


def batch_captions(
    prompts_by_kind: list[list[str]],
    rnd: random.Random,
    n: int,
    dropout: float,
    kind_weights: list[float] | None = None,
):
    """``n`` (spec caption, conditioning caption) pairs, kinds drawn uniformly or in
    proportion to ``kind_weights`` (one per :data:`grammar.KINDS`)."""
    uniform = kind_weights is None or len(set(kind_weights)) == 1
    out = []
    for _ in range(n):
        # uniform weights keep the original draw (rnd.choice), so old runs replay bitwise
        kind = rnd.choice(prompts_by_kind) if uniform else rnd.choices(prompts_by_kind, kind_weights)[0]
        caption = rnd.choice(kind)
        out.append((caption, "" if rnd.random() < dropout else caption))
    return out


def scene_specs(captions: list[str], noise: float, rnd: random.Random) -> list[grammar.Spec]:
    """What each image shows: its caption's spec, or with probability ``noise`` a spec that
    violates one clause of it (a mismatched caption)."""
    specs = [grammar.parse(c) for c in captions]
    if noise <= 0:
        return specs
    return [corrupt(s, rnd) if rnd.random() < noise else s for s in specs]


def render_batch(
    specs: list[grammar.Spec], rnd: random.Random, resolution: int, grid: int | None
) -> torch.Tensor:
    images = np.stack([render(s, rnd, resolution, grid) for s in specs])
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def noised(x0: torch.Tensor, gen: torch.Generator, location: float = 0.0):
    """(sigma, noise, x_sigma): one logit-normal(location, 1) sigma per sample and
    x_sigma = (1 - sigma) x0 + sigma noise, for images (B, C, H, W) and clips alike."""
    b = x0.shape[0]
    sigma = torch.sigmoid(torch.randn(b, generator=gen) + location)
    noise = torch.randn(x0.shape, generator=gen)
    s = sigma.view(b, *([1] * (x0.ndim - 1)))
    return sigma, noise, (1 - s) * x0 + s * noise


def optimizer_step(opt, params, loss: torch.Tensor, lr: float) -> None:
    """Set ``lr``, backpropagate ``loss``, clip the gradient norm to 1 and step."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def check_resolution(resolution: int, patch: int = 8) -> None:
    """The frame side must tile into patches (``build_components``' default patch size)."""
    if resolution % patch or resolution < 2 * patch:
        raise ValueError(
            f"--resolution must be a multiple of {patch} and at least {2 * patch}, got {resolution}"
        )


def flow_matching_loss(
    pipe: ToyPipeline, x0: torch.Tensor, captions: list[str], gen: torch.Generator, location: float = 0.0
):
    """MSE between predicted and true velocity at logit-normal(location, 1) sigmas (SD3,
    Esser et al. 2024, Sec. 3.1: a positive location puts more training on high noise,
    where layout is decided)."""
    sigma, noise, x_t = noised(x0, gen, location)
    embeds, pooled = pipe.text_embeddings(captions)
    return torch.nn.functional.mse_loss(pipe.velocity(x_t, sigma, embeds, pooled), noise - x0)


@torch.no_grad()
def evaluate(pipe: ToyPipeline, prompts: list[str], steps: int, guidance: float, seed: int = 1234) -> dict:
    """Strict and partial ShapeWorld accuracy of ODE samples (fixed noise per index)."""
    from rewards.shapeworld import ShapeWorldVerifier

    gen = torch.Generator().manual_seed(seed)
    images = pipe(
        prompts, num_inference_steps=steps, guidance_scale=guidance, generator=gen, output_type="pt"
    )
    scores = ShapeWorldVerifier()(images, prompts)
    return {
        "strict": float(scores["shapeworld_strict"].mean()),
        "partial": float(scores["shapeworld_partial"].mean()),
    }


def _save(pipe: ToyPipeline, ema: EMA, directory: Path) -> None:
    """Save the EMA weights (the training weights are restored afterwards)."""
    with ema.swapped_in():
        pipe.save_pretrained(directory)


def eval_sets(n: int) -> dict[str, list[str]]:
    train, heldout = grammar.split()
    return {"heldout": heldout[:n], "train": train[:n]}


def pretrain(cfg: PretrainConfig, log=print) -> dict:
    """Train, evaluate every ``eval_every`` steps, save the EMA model to ``cfg.out``."""
    _validate(cfg)
    train, _ = grammar.split()
    by_kind = [[p for p in train if grammar.parse(p).kind == k] for k in grammar.KINDS]
    pipe = _initial_pipeline(cfg)
    modules = [pipe.transformer, pipe.text_encoder]
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    ema = EMA(params, cfg.ema_decay, warmup=True)
    evals = eval_sets(cfg.eval_prompts)
    history, start, loss_acc = [], time.time(), 0.0
    weights = kind_weights(cfg)
    for step in range(1, cfg.steps + 1):
        rnd = random.Random(f"{cfg.seed}-{step}")
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        pairs = batch_captions(by_kind, rnd, cfg.batch_size, cfg.caption_dropout, weights)
        # its own stream, so that caption_noise = 0 draws exactly the batches it always did
        specs = scene_specs(
            [c for c, _ in pairs], cfg.caption_noise, random.Random(f"{cfg.seed}-{step}-noise")
        )
        x0 = render_batch(specs, rnd, cfg.resolution, cfg.grid or None)
        loss = flow_matching_loss(pipe, x0, [c for _, c in pairs], gen, cfg.sigma_location)
        optimizer_step(opt, params, loss, cfg.lr * min(1.0, step / cfg.warmup))
        ema.update()
        loss_acc += float(loss.detach())
        if step % cfg.eval_every == 0 or step == cfg.steps:
            row = {
                "step": step,
                "loss": loss_acc / (step - (history[-1]["step"] if history else 0)),
                "minutes": (time.time() - start) / 60,
            }
            loss_acc = 0.0
            row.update(_eval_ema(pipe, ema, evals, cfg))
            history.append(row)
            log(json.dumps(row))
            if cfg.snapshots:
                _save(pipe, ema, Path(cfg.snapshots) / f"step-{step}")
    _save(pipe, ema, Path(cfg.out))
    summary = {"config": asdict(cfg), "minutes": (time.time() - start) / 60, "history": history}
    (Path(cfg.out) / "pretrain_log.json").write_text(json.dumps(summary, indent=1))
    return summary


def _initial_pipeline(cfg: PretrainConfig) -> ToyPipeline:
    if cfg.init is None:
        with tiny.seeded(cfg.seed):
            return ToyPipeline(**build_components(resolution=cfg.resolution), prediction=cfg.prediction)
    pipe = ToyPipeline.from_pretrained(cfg.init)
    size = pipe.transformer.config.sample_size
    if size != cfg.resolution or pipe.config.prediction != cfg.prediction:
        raise ValueError(
            f"--init '{cfg.init}' is a {size} px, {pipe.config.prediction}-prediction model; pass "
            f"--resolution {size} --prediction {pipe.config.prediction}"
        )
    return pipe


def kind_weights(cfg: PretrainConfig) -> list[float]:
    """``cfg.kind_weights`` as floats, one per kind in :data:`grammar.KINDS`."""
    try:
        weights = [float(w) for w in cfg.kind_weights.split(",")]
    except ValueError:
        weights = []
    if len(weights) != len(grammar.KINDS) or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(
            f"--kind-weights must be {len(grammar.KINDS)} non-negative numbers for "
            f"{', '.join(grammar.KINDS)} (for example 1,1,2), got '{cfg.kind_weights}'"
        )
    return weights


def _validate(cfg: PretrainConfig) -> None:
    check_resolution(cfg.resolution)
    if cfg.grid and not 4 <= cfg.grid <= cfg.resolution // 2:
        raise ValueError(f"--grid must be 0 (free layout) or 4..{cfg.resolution // 2} pixels, got {cfg.grid}")
    if cfg.prediction not in ("x0", "velocity"):
        raise ValueError(f"--prediction must be 'x0' or 'velocity', got '{cfg.prediction}'")
    if not 0.0 <= cfg.caption_noise < 1.0:
        raise ValueError(f"--caption-noise must be in [0, 1), got {cfg.caption_noise}")
    kind_weights(cfg)
    if cfg.init is not None and not (Path(cfg.init) / "model_index.json").is_file():
        raise ValueError(f"--init '{cfg.init}' is not a saved toy model (no model_index.json there)")
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.eval_every < 1:
        raise ValueError("--steps, --batch-size and --eval-every must be positive")


def _eval_ema(pipe, ema, evals, cfg) -> dict:
    """Strict accuracy of the EMA model on each eval set, without and with CFG (scale 3)."""
    out = {}
    with ema.swapped_in():
        for name, prompts in evals.items():
            for guidance in (1.0, 3.0):
                scores = evaluate(pipe, prompts, cfg.eval_steps, guidance)
                out[f"{name}_strict_g{guidance:g}"] = round(scores["strict"], 3)
    return out

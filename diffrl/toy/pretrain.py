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

The default recipe (:data:`RECIPE`, issue 36) is a curriculum: single-object position
captions ("a red circle to the left", :mod:`diffrl.toy.positions`) first, so the position
words get a signal of their own, then relations, then every kind; the sigma density of the
first two stages sits at high noise where the layout is decided (a logit-normal of location
2.5 instead of SD3's 0). Without the first stages and the density the model never reads
"left of" against "right of" (docs/BENCHMARKS.md). ``kind_weights`` replaces the curriculum
with one stage; ``--kind-weights 1,1,1 --lr 1e-3`` is the recipe of the bases before it.

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
from diffrl.toy import late_world, positions
from diffrl.toy.recipe import SigmaDensity, Stage, parse_curriculum, parse_density, parse_weights, stage_at
from diffrl.training.ema import EMA
from rewards.shapeworld import grammar
from rewards.shapeworld.render import corrupt, render

# The caption kinds pretraining draws from: the RL grammar's three, then the
# pretraining-only single-object positions (diffrl/toy/positions.py).
KINDS = (*grammar.KINDS, "position")


# The shipped recipe (issue 36, docs/BENCHMARKS.md "A base that reads relation words"):
# single-object positions first, then positions with relations, both with the sigma density
# centred at high noise (logit-normal location 2.5, where the layout is decided), then every
# kind at location 1.0 so colours, shapes and counts are drawn too. The learning rate is
# 3e-4: at 1e-3 the position words are learnt in about one seed in eight.
RECIPE = "0,0,0,1@1500~2.5; 0,0,1,1@1500~2.5; 1,1,2,1~1.0"


@dataclass
class PretrainConfig:
    out: str = "assets/toy_model_capable"
    steps: int = 10000
    batch_size: int = 64
    lr: float = 3e-4
    warmup: int = 250
    ema_decay: float = 0.999
    caption_dropout: float = 0.1
    resolution: int = 32
    prediction: str = "x0"  # what the transformer outputs; the loss is on the velocity either way
    grid: int = 8  # one object per patch-sized cell (patch size 8): see shapeworld.layout
    seed: int = 0
    eval_every: int = 1000
    eval_prompts: int = 96
    eval_steps: int = 20
    snapshots: str | None = None  # directory for a copy of the EMA model at every eval
    caption_noise: float = 0.0  # probability that an image violates one clause of its caption
    init: str | None = None  # a saved toy model directory to continue from (None: random init)
    # stages 'WEIGHTS@STEPS[~LOCATIONS[/WEIGHTS]]; ...; WEIGHTS[~...]' of caption-kind weights
    # (count, pair, relation, position) and sigma densities: diffrl/toy/recipe.py
    curriculum: str = RECIPE
    # one stage of these caption-kind weights instead of the curriculum (3 or 4 numbers)
    kind_weights: str = ""
    # locations m of a mixture of logit-normal(m, 1) sigma densities (m > 0 favours high
    # noise, where layout is decided) and their weights (default equal), for every stage
    # that names no density of its own
    sigma_location: str = "0"
    sigma_weights: str = ""
    qk_norm: str = ""  # "" (the shipped architecture) or "rms_norm" (SD3.5's query-key norm); new models only
    probe_prompts: int = 16  # held-out relation prompts of the relation probe at each eval (0: none)
    # "shapeworld", or "late": the late-step world's textured captions, noise on textures
    # only, and the texture words in the vocabulary (diffrl/toy/late_world.py)
    world: str = "shapeworld"


def batch_captions(
    prompts_by_kind: list[list[str]],
    rnd: random.Random,
    n: int,
    dropout: float,
    kind_weights: list[float] | None = None,
):
    """``n`` (spec caption, conditioning caption) pairs, kinds drawn uniformly or in
    proportion to ``kind_weights`` (one per list of ``prompts_by_kind``)."""
    uniform = kind_weights is None or len(set(kind_weights)) == 1
    out = []
    for _ in range(n):
        # uniform weights keep the original draw (rnd.choice), so old runs replay bitwise
        kind = rnd.choice(prompts_by_kind) if uniform else rnd.choices(prompts_by_kind, kind_weights)[0]
        caption = rnd.choice(kind)
        out.append((caption, "" if rnd.random() < dropout else caption))
    return out


def parse_caption(caption: str):
    """The scene spec of a training caption: a position caption's
    :class:`~diffrl.toy.positions.PositionSpec`, else the RL grammar's :class:`grammar.Spec`."""
    return positions.parse(caption) or grammar.parse(caption)


def scene_specs(captions: list[str], noise: float, rnd: random.Random, corrupt_fn=None) -> list:
    """What each image shows: its caption's spec, or with probability ``noise`` a spec that
    violates one clause of it (a mismatched caption; ``corrupt_fn`` picks the clause)."""
    specs = [parse_caption(c) for c in captions]
    if noise <= 0:
        return specs
    corrupt_fn = corrupt_fn or _corrupt
    return [corrupt_fn(s, rnd) if rnd.random() < noise else s for s in specs]


def _corrupt(spec, rnd: random.Random):
    return positions.corrupt(spec, rnd) if spec.kind == "position" else corrupt(spec, rnd)


def render_batch(specs: list, rnd: random.Random, resolution: int, grid: int | None) -> torch.Tensor:
    images = np.stack(
        [(positions.render if s.kind == "position" else render)(s, rnd, resolution, grid) for s in specs]
    )
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def noised(x0: torch.Tensor, gen: torch.Generator, density: SigmaDensity | float = 0.0):
    """(sigma, noise, x_sigma): one sigma per sample from ``density`` (a number m is
    logit-normal(m, 1)) and x_sigma = (1 - sigma) x0 + sigma noise, for images
    (B, C, H, W) and clips alike."""
    if not isinstance(density, SigmaDensity):
        density = SigmaDensity((float(density),))
    b = x0.shape[0]
    sigma = density.sample(b, gen)
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
    pipe: ToyPipeline,
    x0: torch.Tensor,
    captions: list[str],
    gen: torch.Generator,
    density: SigmaDensity | float = 0.0,
):
    """MSE between predicted and true velocity at sigmas from ``density`` (SD3, Esser et
    al. 2024, Sec. 3.1: a positive logit-normal location puts more training on high noise,
    where layout is decided)."""
    sigma, noise, x_t = noised(x0, gen, density)
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
    out = {
        "strict": float(scores["shapeworld_strict"].mean()),
        "partial": float(scores["shapeworld_partial"].mean()),
    }
    for clause in ("shapes", "texture_given_shapes"):  # textured prompts (the late world)
        if f"shapeworld_clause/{clause}" in scores:
            out[clause] = float(scores[f"shapeworld_clause/{clause}"].nanmean())
    return out


def _save(pipe: ToyPipeline, ema: EMA, directory: Path) -> None:
    """Save the EMA weights (the training weights are restored afterwards)."""
    with ema.swapped_in():
        pipe.save_pretrained(directory)


def eval_sets(n: int) -> dict[str, list[str]]:
    train, heldout = grammar.split()
    return {"heldout": heldout[:n], "train": train[:n]}


def training_batch(cfg: PretrainConfig, by_kind: list[list[str]], stage: Stage, step: int):
    """(images (B, 3, H, W) in [-1, 1], conditioning captions) of ``step``, keyed by
    (seed, step): captions drawn with the stage's kind weights, some dropped to "", and
    each image rendered from its caption's scene (or a corrupted one, ``caption_noise``)."""
    rnd = random.Random(f"{cfg.seed}-{step}")
    kinds, weights = drawn_kinds(by_kind, stage.kind_weights)
    pairs = batch_captions(kinds, rnd, cfg.batch_size, cfg.caption_dropout, weights)
    # its own stream, so that caption_noise = 0 draws exactly the batches it always did
    noise_rnd = random.Random(f"{cfg.seed}-{step}-noise")
    corrupt_fn = late_world.flip_texture if cfg.world == "late" else None
    specs = scene_specs([c for c, _ in pairs], cfg.caption_noise, noise_rnd, corrupt_fn)
    return render_batch(specs, rnd, cfg.resolution, cfg.grid or None), [c for _, c in pairs]


def pretrain(cfg: PretrainConfig, log=print) -> dict:
    """Train, evaluate every ``eval_every`` steps, save the EMA model to ``cfg.out``."""
    _validate(cfg)
    late = cfg.world == "late"
    by_kind = late_world.captions_by_kind() if late else captions_by_kind()
    stages = training_stages(cfg)
    pipe = _initial_pipeline(cfg)
    modules = [pipe.transformer, pipe.text_encoder]
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    ema = EMA(params, cfg.ema_decay, warmup=True)
    evals = (late_world.eval_sets if late else eval_sets)(cfg.eval_prompts)
    history, start, loss_acc = [], time.time(), 0.0
    for step in range(1, cfg.steps + 1):
        stage = stages[stage_at(stages, step)]
        x0, captions = training_batch(cfg, by_kind, stage, step)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        loss = flow_matching_loss(pipe, x0, captions, gen, stage.density)
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
    pipe = _loaded_or_new_pipeline(cfg)
    if cfg.world == "late":
        late_world.read_texture_words(pipe)
    return pipe


def _loaded_or_new_pipeline(cfg: PretrainConfig) -> ToyPipeline:
    if cfg.init is None:
        with tiny.seeded(cfg.seed):
            comps = build_components(resolution=cfg.resolution, qk_norm=cfg.qk_norm or None)
            return ToyPipeline(**comps, prediction=cfg.prediction)
    pipe = ToyPipeline.from_pretrained(cfg.init)
    size = pipe.transformer.config.sample_size
    if size != cfg.resolution or pipe.config.prediction != cfg.prediction:
        raise ValueError(
            f"--init '{cfg.init}' is a {size} px, {pipe.config.prediction}-prediction model; pass "
            f"--resolution {size} --prediction {pipe.config.prediction}"
        )
    return pipe


def captions_by_kind() -> list[list[str]]:
    """The training captions of each kind of :data:`KINDS`: the RL grammar's training
    split, then the position captions (none for objects whose count-1 prompt is held out)."""
    train, _ = grammar.split()
    return [[p for p in train if grammar.parse(p).kind == k] for k in grammar.KINDS] + [positions.captions()]


def drawn_kinds(by_kind: list[list[str]], weights: tuple[float, ...]):
    """(caption lists, weights) to draw from. Without position captions the three grammar
    kinds are passed alone, so every older three-kind command draws the batches it did."""
    if weights[-1] == 0:
        return by_kind[:-1], list(weights[:-1])
    return by_kind, list(weights)


def training_stages(cfg: PretrainConfig) -> list[Stage]:
    """The curriculum's stages, or one stage of ``kind_weights`` when those are given (the
    three grammar kinds equally when the curriculum is empty too: the recipe before issue
    36); a stage without its own sigma density uses (``sigma_location``, ``sigma_weights``)."""
    density = parse_density(cfg.sigma_location, cfg.sigma_weights)
    if cfg.world == "late":  # one stage: single objects and pairs, never the curriculum
        weights = cfg.kind_weights.strip() or late_world.KIND_WEIGHTS
        return [Stage(parse_weights(weights, KINDS, "--kind-weights", min_length=3), None, density)]
    if cfg.kind_weights.strip() or not cfg.curriculum.strip():
        weights = cfg.kind_weights.strip() or "1,1,1"
        return [Stage(parse_weights(weights, KINDS, "--kind-weights", min_length=3), None, density)]
    stages = parse_curriculum(cfg.curriculum, KINDS)
    return [Stage(s.kind_weights, s.steps, s.density or density) for s in stages]


def _validate(cfg: PretrainConfig) -> None:
    check_resolution(cfg.resolution)
    if cfg.grid and not 4 <= cfg.grid <= cfg.resolution // 2:
        raise ValueError(f"--grid must be 0 (free layout) or 4..{cfg.resolution // 2} pixels, got {cfg.grid}")
    if cfg.prediction not in ("x0", "velocity"):
        raise ValueError(f"--prediction must be 'x0' or 'velocity', got '{cfg.prediction}'")
    if cfg.world not in ("shapeworld", "late"):
        raise ValueError(f"--world must be 'shapeworld' or 'late', got '{cfg.world}'")
    if not 0.0 <= cfg.caption_noise < 1.0:
        raise ValueError(f"--caption-noise must be in [0, 1), got {cfg.caption_noise}")
    training_stages(cfg)
    if cfg.init is not None and not (Path(cfg.init) / "model_index.json").is_file():
        raise ValueError(f"--init '{cfg.init}' is not a saved toy model (no model_index.json there)")
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.eval_every < 1:
        raise ValueError("--steps, --batch-size and --eval-every must be positive")


def _eval_ema(pipe, ema, evals, cfg) -> dict:
    """Strict accuracy of the EMA model on each eval set, without and with CFG (scale 3),
    and the relation probe's placement on ``probe_prompts`` held-out relation prompts."""
    out = {}
    with ema.swapped_in():
        for name, prompts in evals.items():
            for guidance in (1.0, 3.0):
                scores = evaluate(pipe, prompts, cfg.eval_steps, guidance)
                out[f"{name}_strict_g{guidance:g}"] = round(scores["strict"], 3)
                for clause in ("shapes", "texture_given_shapes"):
                    if clause in scores:
                        out[f"{name}_{clause}_g{guidance:g}"] = round(scores[clause], 3)
        if cfg.probe_prompts and cfg.world == "shapeworld":  # the late world has no relations
            out.update(probe_placement(pipe, cfg.probe_prompts, cfg.eval_steps))
    return out


def probe_placement(pipe, n: int, steps: int) -> dict:
    """Share of held-out relation samples with the second object right of the first when
    asked "to the left of" / "to the right of", and below it when asked "above" / "below"
    (``scripts/probe_toy_relations.py``; a model that reads the words has the first of each
    pair near 1 and the second near 0)."""
    from diffrl.toy import relation_probe as probe

    rows = probe.sample_placement(pipe, probe.relation_prompts("heldout", n), steps=steps)
    alone = probe.position_placement(pipe, steps=steps)
    mass = probe.position_mass(pipe)
    return {
        "position_mass_in_named_half": round(sum(mass.values()) / len(mass), 3),
        "position_left_if_left": round(alone["to the left"]["left_half"], 3),
        "position_left_if_right": round(alone["to the right"]["left_half"], 3),
        "position_top_if_above": round(alone["above"]["top_half"], 3),
        "position_top_if_below": round(alone["below"]["top_half"], 3),
        "probe_right_if_left_of": round(rows["to the left of"]["b_right_of_a"], 3),
        "probe_right_if_right_of": round(rows["to the right of"]["b_right_of_a"], 3),
        "probe_below_if_above": round(rows["above"]["b_below_a"], 3),
        "probe_below_if_below": round(rows["below"]["b_below_a"], 3),
    }

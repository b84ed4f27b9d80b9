"""Flow-matching pretraining of the toy video model on ShapeWorld clips
(``scripts/pretrain_toy_video.py``).

The objective is the image toy's (:mod:`diffrl.toy.pretrain`): rectified flow with the
v-loss at logit-normal sigmas (SD3, Esser et al. 2024, Eq. 1 and Sec. 3.1), x-prediction
(Li & He 2025), captions dropped to "" with probability ``caption_dropout``, the UMT5
text encoder trained jointly from scratch, an EMA of the weights saved.

``caption_noise`` keeps the base imperfect in the one way a video model should be
aligned: with that probability a clip does not do what its caption says. It either moves
in one of the three other directions or stands still (each 1/4), while the caption stays,
as web video captions describe a clip loosely. The model then moves objects the named
way only part of the time, although it can, and the video reward has something to fix:
standing still and moving the wrong way are the failures video-RL users report.

The defaults are the shipped recipe (issue 53, docs/BENCHMARKS.md "The video toy"): a
model whose tokens are tubes of all 5 frames (as a Wan token spans 4 frames through its
VAE; with one frame per token each frame's object was drawn on its own and no direction
word was read), trained on a curriculum of clip kinds (:data:`CLIP_KINDS`): still clips
first, then paths without their direction word, then direction captions. A run continued
with ``init`` starts the curriculum again unless ``curriculum`` says otherwise (the RL
base's stage passes ``--curriculum 1,0,0``).

``init`` continues from a saved model (a fresh optimizer and warm-up). Everything random
is keyed by (seed, step), so a run stopped at step N equals a run with ``--steps N`` (on the
same torch build and thread count).
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
from diffrl.models.toy_video import ToyVideoPipeline, build_components
from diffrl.toy.motion_probe import frame_coupling, motion_mass, sampled_motion
from diffrl.toy.pretrain import check_resolution, noised, optimizer_step
from diffrl.toy.recipe import SigmaDensity, Stage, parse_curriculum, parse_density, stage_at
from diffrl.training.ema import EMA
from rewards.shapeworld.video import DIRECTIONS, Motion, parse_motion, render_clip, video_split

# The shipped recipe (issue 53): still clips at high noise (one object in the same place in
# every frame), then paths without their direction word, then direction captions
# (2 : 1 direction : moving) to the end; sigmas from logit-normal(1.5) and (0) equally,
# where the stage names no density of its own.
RECIPE = "0,0,1@1000~2,0; 0,1,1@1000; 2,1,0"


@dataclass
class VideoPretrainConfig:
    out: str = "assets/toy_video_model_capable"
    steps: int = 6000
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 250
    ema_decay: float = 0.999
    caption_dropout: float = 0.1
    resolution: int = 32
    frames: int = 5
    step_px: int = 3  # pixels per frame: 12 px over 5 frames, the verifier asks for 0.15 x 32 = 4.8
    seed: int = 0
    eval_every: int = 2000
    eval_steps: int = 20
    caption_noise: float = 0.0  # probability that a clip moves another way or stands still
    init: str | None = None  # a saved toy video model to continue from (None: random init)
    # a mixture of logit-normal(m, 1) sigma densities and its weights (diffrl/toy/recipe.py)
    sigma_location: str = "1.5,0"
    sigma_weights: str = ""
    # stages of clip-kind weights for direction, moving, still (diffrl/toy/recipe.py's syntax);
    # "" or "1,0,0" trains direction clips only (the recipe before issue 53)
    curriculum: str = RECIPE
    # the transformer (a fresh model only). A token spans frame_patch frames of patch x patch
    # pixels: a tube, as a Wan token spans 4 frames and 16 x 16 pixels through its VAE. With
    # one frame per token (the model before issue 53) each frame's object was drawn on its own
    layers: int = 4
    heads: int = 4
    head_dim: int = 48
    patch: int = 8
    frame_patch: int = 5


# What a clip shows and what its caption says. direction: "a red circle moving left" and
# it moves left; moving: the same clip captioned "a red circle moving" (a coherent path, the
# word for which way left out); still: "a red circle", standing in one place.
CLIP_KINDS = ("direction", "moving", "still")


def clip_motions(captions: list[str], noise: float, rnd: random.Random) -> list[tuple[Motion, int]]:
    """What each clip shows, as (motion, pixels per frame multiplier): its caption's motion,
    or with probability ``noise`` another direction (multiplier 1) or no motion
    (multiplier 0), each of the four equally likely."""
    out = []
    for caption in captions:
        motion = parse_motion(caption)
        if noise > 0 and rnd.random() < noise:
            wrong = [d for d in DIRECTIONS if d != motion.direction] + [None]
            direction = rnd.choice(wrong)
            motion = Motion(motion.colour, motion.shape, direction or motion.direction)
            out.append((motion, 0 if direction is None else 1))
        else:
            out.append((motion, 1))
    return out


def kind_captions(captions: list[str], kinds: list[str]) -> tuple[list[str], list[int]]:
    """Captions as each clip's kind says them, and the pixels-per-frame multiplier (0 for a
    still clip). The motion stays the training caption's, so no held-out combination of
    colour, shape and direction is ever drawn."""
    dropped = {"direction": 0, "moving": 1, "still": 2}  # trailing words left out
    out = [" ".join(c.split()[: len(c.split()) - dropped[k]]) for c, k in zip(captions, kinds)]
    return out, [0 if kind == "still" else 1 for kind in kinds]


def render_clips(
    motions: list[tuple[Motion, int]], rnd: random.Random, cfg: VideoPretrainConfig
) -> torch.Tensor:
    """(B, 3, F, H, W) in [-1, 1], Wan's latent layout."""
    clips = np.stack(
        [render_clip(m, rnd, cfg.frames, cfg.resolution, cfg.step_px * moving) for m, moving in motions]
    )
    return torch.from_numpy(clips).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def flow_matching_loss(
    pipe: ToyVideoPipeline,
    x0: torch.Tensor,
    captions: list[str],
    gen: torch.Generator,
    density: SigmaDensity | float = 0.0,
):
    """v-loss at sigmas from ``density`` (a number m: logit-normal(m, 1)), one sigma per clip."""
    sigma, noise, x_t = noised(x0, gen, density)
    embeds = pipe.text_embeddings(captions)
    return torch.nn.functional.mse_loss(pipe.velocity(x_t, sigma, embeds), noise - x0)


@torch.no_grad()
def evaluate(pipe: ToyVideoPipeline, prompts: list[str], frames: int, steps: int, seed: int = 1234) -> dict:
    """Strict accuracy and the moves clause of ODE samples (no CFG), fixed noise per index."""
    from rewards.shapeworld.video import ShapeWorldVideoVerifier

    gen = torch.Generator().manual_seed(seed)
    clips = pipe(prompts, num_frames=frames, num_inference_steps=steps, generator=gen)
    scores = ShapeWorldVideoVerifier()(clips, prompts)
    return {
        "strict": round(float(scores["shapeworld_video_strict"].mean()), 3),
        "moves": round(float(scores["shapeworld_video_moves"].mean()), 3),
        "coherent": round(float(scores["shapeworld_video_coherent"].mean()), 3),
    }


def pretrain_video(cfg: VideoPretrainConfig, log=print) -> dict:
    """Train, evaluate the EMA model every ``eval_every`` steps, save it to ``cfg.out``."""
    _validate(cfg)
    train, heldout = video_split()
    pipe = _initial_pipeline(cfg)
    params = [p for m in (pipe.transformer, pipe.text_encoder) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    ema = EMA(params, cfg.ema_decay, warmup=True)
    stages = _stages(cfg)
    history, start, loss_acc = [], time.time(), 0.0
    for step in range(1, cfg.steps + 1):
        loss = _train_step(pipe, opt, params, train, step, cfg, stages[stage_at(stages, step)])
        ema.update()
        loss_acc += loss
        if step % cfg.eval_every == 0 or step == cfg.steps:
            row = {"step": step, "loss": loss_acc / (step - (history[-1]["step"] if history else 0))}
            row["minutes"], loss_acc = (time.time() - start) / 60, 0.0
            with ema.swapped_in():
                for name, prompts in (("heldout", heldout), ("train", train)):
                    scores = evaluate(pipe, prompts, cfg.frames, cfg.eval_steps)
                    row.update({f"{name}_{k}": v for k, v in scores.items()})
                row.update(_probes(pipe, cfg))
            history.append(row)
            log(json.dumps(row))
    with ema.swapped_in():
        pipe.save_pretrained(cfg.out)
    summary = {"config": asdict(cfg), "minutes": (time.time() - start) / 60, "history": history}
    (Path(cfg.out) / "pretrain_log.json").write_text(json.dumps(summary, indent=1))
    return summary


def _probes(pipe: ToyVideoPipeline, cfg: VideoPretrainConfig) -> dict:
    """The motion probes (diffrl/toy/motion_probe.py): the mean shift along the named
    direction from noise and in samples (each direction's own in the saved log), and
    how far the frames are tied."""
    sampled = sampled_motion(pipe, cfg.frames, cfg.eval_steps, seeds=(0,))
    return {
        "motion_mass_shift_px": round(motion_mass(pipe, cfg.frames)["mean"], 3),
        "sampled_shift_px": {k: round(v, 2) for k, v in sampled.items()},
        "frame_coupling": round(frame_coupling(pipe, cfg.frames), 3),
    }


def _initial_pipeline(cfg: VideoPretrainConfig) -> ToyVideoPipeline:
    if cfg.init is None:
        with tiny.seeded(cfg.seed):
            components = build_components(
                cfg.resolution,
                patch=cfg.patch,
                layers=cfg.layers,
                heads=cfg.heads,
                head_dim=cfg.head_dim,
                frame_patch=cfg.frame_patch,
            )
            return ToyVideoPipeline(**components, resolution=cfg.resolution)
    pipe = ToyVideoPipeline.from_pretrained(cfg.init)
    if pipe.config.resolution != cfg.resolution:
        side = pipe.config.resolution
        raise ValueError(f"--init '{cfg.init}' is a {side} px model; pass --resolution {side}")
    return pipe


def _stages(cfg: VideoPretrainConfig) -> list[Stage]:
    """The curriculum's stages (a stage without its own density uses the run's), or one
    stage of direction clips."""
    density = parse_density(cfg.sigma_location, cfg.sigma_weights)
    stages = parse_curriculum(cfg.curriculum, CLIP_KINDS) if cfg.curriculum.strip() else []
    stages = stages or [Stage((1.0, 0.0, 0.0))]
    return [Stage(s.kind_weights, s.steps, s.density or density) for s in stages]


def _train_step(
    pipe, opt, params, train: list[str], step: int, cfg: VideoPretrainConfig, stage: Stage
) -> float:
    rnd = random.Random(f"{cfg.seed}-{step}")
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    captions = [rnd.choice(train) for _ in range(cfg.batch_size)]
    conditioning = ["" if rnd.random() < cfg.caption_dropout else c for c in captions]
    # its own streams, so that caption_noise = 0 and direction clips alone draw the same
    # clips as they always did
    motions = clip_motions(captions, cfg.caption_noise, random.Random(f"{cfg.seed}-{step}-noise"))
    if stage.kind_weights != (1.0, 0.0, 0.0):
        kind_rnd = random.Random(f"{cfg.seed}-{step}-kind")
        kinds = kind_rnd.choices(CLIP_KINDS, weights=stage.kind_weights, k=len(captions))
        conditioning, moving = kind_captions(conditioning, kinds)
        motions = [(m, mult * k) for (m, mult), k in zip(motions, moving)]
    x0 = render_clips(motions, rnd, cfg)
    loss = flow_matching_loss(pipe, x0, conditioning, gen, stage.density)
    optimizer_step(opt, params, loss, cfg.lr * min(1.0, step / cfg.warmup))
    return float(loss.detach())


def _validate(cfg: VideoPretrainConfig) -> None:
    check_resolution(cfg.resolution)
    if cfg.frames < 2 or cfg.step_px < 1:
        raise ValueError(
            f"--frames must be at least 2 and --step-px at least 1, got {cfg.frames} and {cfg.step_px}"
        )
    if cfg.step_px * (cfg.frames - 1) > cfg.resolution - cfg.resolution // 3:
        raise ValueError(
            f"{cfg.frames} frames of {cfg.step_px} px carry an object out of a {cfg.resolution} px frame; "
            "lower --step-px or --frames"
        )
    if cfg.init is None and (cfg.frames % cfg.frame_patch or cfg.resolution % cfg.patch):
        raise ValueError(
            f"--frames ({cfg.frames}) must be a multiple of --frame-patch ({cfg.frame_patch}) and "
            f"--resolution ({cfg.resolution}) of --patch ({cfg.patch})"
        )
    if not 0.0 <= cfg.caption_noise < 1.0:
        raise ValueError(f"--caption-noise must be in [0, 1), got {cfg.caption_noise}")
    _stages(cfg)
    if cfg.init is not None and not (Path(cfg.init) / "model_index.json").is_file():
        raise ValueError(f"--init '{cfg.init}' is not a saved toy video model (no model_index.json there)")
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.eval_every < 1:
        raise ValueError("--steps, --batch-size and --eval-every must be positive")

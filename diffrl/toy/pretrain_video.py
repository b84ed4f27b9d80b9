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
from diffrl.toy.motion_probe import motion_mass
from diffrl.toy.pretrain import check_resolution, noised, optimizer_step
from diffrl.toy.recipe import SigmaDensity, parse_density
from diffrl.training.policy import EMA
from rewards.shapeworld.video import DIRECTIONS, Motion, parse_motion, render_clip, video_split


@dataclass
class VideoPretrainConfig:
    out: str = "assets/toy_video_model"
    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    warmup: int = 250
    ema_decay: float = 0.999
    caption_dropout: float = 0.1
    resolution: int = 32
    frames: int = 5
    step_px: int = 3  # pixels per frame: 12 px over 5 frames, the verifier asks for 0.15 x 32 = 4.8
    seed: int = 0
    eval_every: int = 500
    eval_steps: int = 20
    caption_noise: float = 0.0  # probability that a clip moves another way or stands still
    init: str | None = None  # a saved toy video model to continue from (None: random init)
    # a mixture of logit-normal(m, 1) sigma densities and its weights (diffrl/toy/recipe.py)
    sigma_location: str = "0"
    sigma_weights: str = ""


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
    }


def pretrain_video(cfg: VideoPretrainConfig, log=print) -> dict:
    """Train, evaluate the EMA model every ``eval_every`` steps, save it to ``cfg.out``."""
    _validate(cfg)
    train, heldout = video_split()
    pipe = _initial_pipeline(cfg)
    params = [p for m in (pipe.transformer, pipe.text_encoder) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    ema = EMA(params, cfg.ema_decay, warmup=True)
    density = parse_density(cfg.sigma_location, cfg.sigma_weights)
    history, start, loss_acc = [], time.time(), 0.0
    for step in range(1, cfg.steps + 1):
        loss = _train_step(pipe, opt, params, train, step, cfg, density)
        ema.update()
        loss_acc += loss
        if step % cfg.eval_every == 0 or step == cfg.steps:
            row = {"step": step, "loss": loss_acc / (step - (history[-1]["step"] if history else 0))}
            row["minutes"], loss_acc = (time.time() - start) / 60, 0.0
            with ema.swapped_in():
                for name, prompts in (("heldout", heldout), ("train", train)):
                    scores = evaluate(pipe, prompts, cfg.frames, cfg.eval_steps)
                    row.update({f"{name}_{k}": v for k, v in scores.items()})
                row["motion_mass_shift_px"] = round(motion_mass(pipe, cfg.frames)["mean"], 3)
            history.append(row)
            log(json.dumps(row))
    with ema.swapped_in():
        pipe.save_pretrained(cfg.out)
    summary = {"config": asdict(cfg), "minutes": (time.time() - start) / 60, "history": history}
    (Path(cfg.out) / "pretrain_log.json").write_text(json.dumps(summary, indent=1))
    return summary


def _initial_pipeline(cfg: VideoPretrainConfig) -> ToyVideoPipeline:
    if cfg.init is None:
        with tiny.seeded(cfg.seed):
            return ToyVideoPipeline(**build_components(resolution=cfg.resolution), resolution=cfg.resolution)
    pipe = ToyVideoPipeline.from_pretrained(cfg.init)
    if pipe.config.resolution != cfg.resolution:
        side = pipe.config.resolution
        raise ValueError(f"--init '{cfg.init}' is a {side} px model; pass --resolution {side}")
    return pipe


def _train_step(
    pipe, opt, params, train: list[str], step: int, cfg: VideoPretrainConfig, density: SigmaDensity
) -> float:
    rnd = random.Random(f"{cfg.seed}-{step}")
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    captions = [rnd.choice(train) for _ in range(cfg.batch_size)]
    conditioning = ["" if rnd.random() < cfg.caption_dropout else c for c in captions]
    # its own stream, so that caption_noise = 0 draws the same clips as any other noise level
    motions = clip_motions(captions, cfg.caption_noise, random.Random(f"{cfg.seed}-{step}-noise"))
    x0 = render_clips(motions, rnd, cfg)
    loss = flow_matching_loss(pipe, x0, conditioning, gen, density)
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
    if not 0.0 <= cfg.caption_noise < 1.0:
        raise ValueError(f"--caption-noise must be in [0, 1), got {cfg.caption_noise}")
    parse_density(cfg.sigma_location, cfg.sigma_weights)
    if cfg.init is not None and not (Path(cfg.init) / "model_index.json").is_file():
        raise ValueError(f"--init '{cfg.init}' is not a saved toy video model (no model_index.json there)")
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.eval_every < 1:
        raise ValueError("--steps, --batch-size and --eval-every must be positive")

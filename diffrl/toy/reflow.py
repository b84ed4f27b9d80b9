"""A few-step ShapeWorld model: the shipped base distilled by reflow (issue 63).

Reflow (Liu, Gong and Liu 2023, "Flow Straight and Fast", ICLR, Sec. 2.2 and Alg. 1; the
first stage of InstaFlow, Liu et al. 2024): sample pairs (z, x0 = ODE_teacher(z, c)) with
the teacher's own sampler, then train the student by flow matching on the straight line
between each pair, x_sigma = (1 - sigma) x0 + sigma z with target velocity z - x0. The
coupling is deterministic, so the student's clean-sample prediction from any x_sigma on
such a line is one image, not the blurred average over every image the noise could
become: exactly what a few-step sampler that predicts the clean sample at each step
(multistep consistency sampling, ``sampling.sde_type: consistency``) or takes few Euler
steps needs. Chosen over consistency distillation (Song et al. 2023) because it needs no
target network or ODE solver inside the training loop, and because the toy predicts x0
directly (``diffrl.models.toy``), which is what reflow sharpens; chosen over shortcut
models (Frans et al. 2024) because it keeps the base's architecture, so every config and
adapter of the ``toy`` family loads it unchanged.

The teacher samples with 20 Euler steps (the toy's evaluation sampler) from keyed noise;
captions are drawn from the base's own training captions with its last curriculum stage's
kind weights (count, pair, relation, position 1 : 1 : 2 : 1), so no held-out prompt is
seen. The student starts from the teacher; its transformer is trained (the text encoder
stays the teacher's), with an EMA of its weights saved.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from diffrl.models.toy import ToyPipeline
from diffrl.toy.pretrain import batch_captions, captions_by_kind, eval_sets, optimizer_step
from diffrl.toy.recipe import SigmaDensity
from diffrl.training.ema import EMA

KIND_WEIGHTS = [1.0, 1.0, 2.0, 1.0]  # the base's last stage (diffrl/toy/pretrain.py RECIPE)


@dataclass
class ReflowConfig:
    teacher: str = "assets/toy_model"
    out: str = "assets/toy_model_fewstep"
    pairs: int = 32768
    teacher_steps: int = 20
    steps: int = 4000
    batch_size: int = 64
    lr: float = 1e-4
    warmup: int = 100
    ema_decay: float = 0.999
    # logit-normal(m, 1) sigmas of the reflow loss; m = 1 (median sigma 0.73) weights the high
    # noise where a few-step sampler takes its first, largest steps
    sigma_location: float = 1.0
    seed: int = 0
    eval_every: int = 1000
    eval_prompts: int = 96
    eval_steps: str = "2,4"  # few-step evaluations, each with Euler and consistency sampling


def teacher_pairs(teacher: ToyPipeline, n: int, steps: int, seed: int, batch: int = 256):
    """(noise z, teacher sample x0, caption) for ``n`` captions: each batch's captions and
    noise keyed by (seed, batch index), its sample from ``steps`` Euler steps."""
    by_kind = captions_by_kind()
    size = teacher.transformer.config.sample_size
    zs, x0s, captions = [], [], []
    for i in range(0, n, batch):
        rnd = random.Random(f"reflow-{seed}-{i}")
        caps = [c for c, _ in batch_captions(by_kind, rnd, min(batch, n - i), 0.0, KIND_WEIGHTS)]
        gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
        z = torch.randn((len(caps), 3, size, size), generator=gen)
        with torch.no_grad():
            images = teacher(caps, num_inference_steps=steps, latents=z, output_type="pt")
        zs.append(z)
        x0s.append(images * 2.0 - 1.0)  # back to the model's [-1, 1] pixel range
        captions += caps
    return torch.cat(zs), torch.cat(x0s), captions


def reflow_loss(student: ToyPipeline, z, x0, captions, gen, density: SigmaDensity) -> torch.Tensor:
    """Flow matching on the pairs' straight lines: MSE of the velocity against z - x0."""
    sigma = density.sample(x0.shape[0], gen)
    s = sigma.view(-1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * z
    embeds, pooled = student.text_embeddings(captions)
    return torch.nn.functional.mse_loss(student.velocity(x_t, sigma, embeds, pooled), z - x0)


@torch.no_grad()
def few_step_scores(pipe: ToyPipeline, prompts: list[str], steps: int, kind: str, seed: int = 1234) -> dict:
    """Strict and partial ShapeWorld accuracy of ``steps``-step samples: Euler (``ode``) or
    multistep consistency sampling (``consistency``, the last step deterministic), the
    step rule of :mod:`diffrl.sampling.sde`, noise keyed by ``seed``."""
    from diffrl.models import tiny
    from diffrl.sampling.sde import step
    from diffrl.sampling.windows import last_step_deterministic
    from rewards.shapeworld import ShapeWorldVerifier

    gen = torch.Generator().manual_seed(seed)
    size = pipe.transformer.config.sample_size
    x = torch.randn((len(prompts), 3, size, size), generator=gen)
    embeds, pooled = pipe.text_embeddings(prompts)
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    for t, rule in enumerate(last_step_deterministic([kind] * steps)):
        v = pipe.velocity(x, sigmas[t].expand(len(prompts)), embeds, pooled)
        x = step(
            rule, x, v, sigmas[t], sigmas[t + 1], 0.0, noise=torch.randn(x.shape, generator=gen)
        ).next_latents
    scores = ShapeWorldVerifier()(tiny.to_unit_range(x), prompts)
    return {
        "strict": float(scores["shapeworld_strict"].mean()),
        "partial": float(scores["shapeworld_partial"].mean()),
    }


def _evaluations(pipe: ToyPipeline, cfg: ReflowConfig) -> dict:
    prompts = eval_sets(cfg.eval_prompts)["heldout"]
    out = {}
    for steps in (int(s) for s in cfg.eval_steps.split(",")):
        for kind in ("ode", "consistency"):
            for name, value in few_step_scores(pipe, prompts, steps, kind).items():
                out[f"heldout_{kind}{steps}_{name}"] = value
    return out


def reflow(cfg: ReflowConfig, log=print) -> dict:
    """Sample the teacher's pairs, train the student on them, save its EMA to ``cfg.out``."""
    start = time.time()
    teacher = ToyPipeline.from_pretrained(cfg.teacher)
    z, x0, captions = teacher_pairs(teacher, cfg.pairs, cfg.teacher_steps, cfg.seed)
    log(json.dumps({"pairs": len(captions), "minutes": (time.time() - start) / 60}))
    student = teacher  # trained in place: the pairs are fixed already
    student.text_encoder.requires_grad_(False)
    params = list(student.transformer.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    ema = EMA(params, cfg.ema_decay, warmup=True)
    density, history, loss_acc = SigmaDensity((cfg.sigma_location,)), [], 0.0
    with ema.swapped_in():
        history.append({"step": 0, **_evaluations(student, cfg)})
    log(json.dumps(history[-1]))
    for it in range(1, cfg.steps + 1):
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + it)
        rows = torch.randint(len(captions), (cfg.batch_size,), generator=gen)
        loss = reflow_loss(student, z[rows], x0[rows], [captions[i] for i in rows.tolist()], gen, density)
        optimizer_step(opt, params, loss, cfg.lr * min(1.0, it / cfg.warmup))
        ema.update()
        loss_acc += float(loss.detach())
        if it % cfg.eval_every == 0 or it == cfg.steps:
            row = {
                "step": it,
                "loss": loss_acc / (it - history[-1]["step"]),
                "minutes": (time.time() - start) / 60,
            }
            loss_acc = 0.0
            with ema.swapped_in():
                row.update(_evaluations(student, cfg))
            history.append(row)
            log(json.dumps(row))
    with ema.swapped_in():
        student.save_pretrained(cfg.out)
    summary = {"config": asdict(cfg), "minutes": (time.time() - start) / 60, "history": history}
    (Path(cfg.out) / "reflow_log.json").write_text(json.dumps(summary, indent=1))
    return summary

"""The measurements of ``scripts/gpu_suite.sh`` (issue 37, item 3), one function each.

Every function returns rows ``{"step", "measure", "value", "target", "ok"}``; ``ok`` is
``True``/``False`` where the row has a pass condition and ``None`` where it only reports.
On a GPU the suite runs the shipped configs' published architectures with random
weights (no downloads), shrunk to one prompt at 256 px so that every family fits one
80 GB GPU; with ``cpu=True`` it runs each family's tiny twin instead, so CI runs every
line of it. The memory measure differs by device (:mod:`diffrl.perf.holdings`): the
caching allocator's peak on a GPU (activations and transients included), the inventory
of live tensors right before an optimizer step on a CPU (activations excluded).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from diffrl.perf.hardware import synchronize
from diffrl.perf.memory import GIB

# family -> the shipped config whose architecture the GPU suite builds at full size
FAMILY_CONFIGS = {
    "flux": "flux_flowgrpo",
    "flux_kontext": "flux_kontext_flowgrpo",
    "flux2": "flux2_flowgrpo",
    "sd3": "sd35_flowgrpo",
    "sana": "sana_solrl",
    "qwenimage": "qwenimage_flowgrpo",
    "qwenimage_edit": "qwenimage_edit_flowgrpo",
    "wan": "wan_branchgrpo",
    "wan22": "wan22_flowgrpo",
}
TINY_CONFIGS = {
    "flux": "tiny_flux_flowgrpo",
    "flux_kontext": "tiny_flux_kontext_flowgrpo",
    "flux2": "tiny_flux2_flowgrpo",
    "sd3": "tiny_sd3_flowgrpo",
    "sana": "tiny_sana_flowgrpo",
    "qwenimage": "tiny_qwenimage_flowgrpo",
    "qwenimage_edit": "tiny_qwenimage_edit_flowgrpo",
    "wan": "tiny_wan_branchgrpo",
    "wan22": "tiny_wan22_flowgrpo",
}
# one prompt, a group of 2, 256 px, one micro-batch per optimizer step: every family's
# full-size iteration then fits one 80 GB GPU (Wan2.2's two 14B experts are 53 GiB)
SHRINK = (
    "model.height=256",
    "model.width=256",
    "rollout.prompts_per_step=1",
    "rollout.group_size=2",
    "rollout.batch_size=2",
    "train.micro_batch_size=1",
    "train.gradient_accumulation=1",
    "solrl.pool_size=4",
    # Sol-RL's max-autotune compile spent over 180 s tuning SANA's GEMMs on an H200
    # (2026-11-28) before its first iteration: the suite measures memory and seconds
    # per iteration, which the default mode's kernels serve
    "perf.compile_mode=default",
)
VIDEO_SHRINK = ("model.num_frames=5",)
TREE_SHRINK = ("tree.split_steps=[0]", "tree.branch_factors=[2]")


def row(step: str, measure: str, value, target: str = "-", ok: bool | None = None) -> dict:
    return {"step": step, "measure": measure, "value": value, "target": target, "ok": ok}


# -- the quantization stack ---------------------------------------------------------------
def quant_stack(cpu: bool) -> list[dict]:
    """Which quantization libraries import, what ``auto`` picks, and whether each real
    backend that runs here reproduces the reference quantizer's copy."""
    from diffrl.precision.backends import choose_backend, detect_hardware

    hw = detect_hardware(probe_imports=True)
    rows = [
        row("quant", "modelopt importable", hw["modelopt"], "yes", hw["modelopt"]),
        row("quant", "torchao importable", hw["torchao"], "yes (GPU)", None if cpu else hw["torchao"]),
    ]
    expected = {"fp8": "reference", "nvfp4": "reference"} if cpu else {"fp8": "torchao", "nvfp4": "modelopt"}
    for precision, want in expected.items():
        chosen = choose_backend(precision, "auto", hw)[0]
        rows.append(row("quant", f"auto backend for {precision}", chosen, want, chosen == want))
    runnable = (
        [("fp8", "modelopt")] if cpu else [("fp8", "modelopt"), ("fp8", "torchao"), ("nvfp4", "modelopt")]
    )
    for precision, backend in runnable:
        if not hw[backend]:
            continue
        try:
            rows += _copy_vs_reference(precision, backend, torch.device("cpu" if cpu else "cuda"))
        except Exception as err:  # one backend's failure must not hide the others'
            message = f"{type(err).__name__}: {err}".splitlines()[0][:200]
            rows.append(row("quant", f"{precision} via {backend}: copy built", message, "runs", False))
    return rows


def _copy_vs_reference(precision: str, backend: str, device: torch.device) -> list[dict]:
    """A backend's copy against the reference quantizer's, on the FLUX twin: the weights
    each quantized layer computes with (the largest relative difference over layers; the
    same quantizer gives rounding-level differences), and how much the output moves from
    the unquantized copy's, as a ratio to how much the reference moves it (activation
    scales may be taken over other groups, so the noise differs but its size should not)."""
    from diffrl.config import load_config
    from diffrl.models import build_adapter
    from diffrl.models.policy import Policy
    from diffrl.precision.backends import build_exploration_copy

    cfg = load_config("tiny_flux_flowgrpo")
    adapter = build_adapter(cfg.model)
    adapter.to(device)
    transformer = Policy(adapter, cfg.model).transformer
    # torchao quantizes BF16 weights only, so its comparison starts from BF16 weights on
    # every side; the dequantized weights then agree to BF16 resolution, not fp32's
    tolerance = 1e-5
    if backend == "torchao":
        transformer.to(torch.bfloat16)
        tolerance = 2.0**-8
    cond = adapter.encode_prompts(["a red circle", "two cats"])
    x = torch.randn((2, *adapter.latent_shape()), generator=torch.Generator().manual_seed(0)).to(device)
    sigma = torch.tensor([0.7, 0.7], device=device)
    copies = {
        name: build_exploration_copy(transformer, "flux", prec, name, log=lambda _: None, compile=False)
        for name, prec in (("none", "bf16"), ("reference", precision), (backend, precision))
    }
    with torch.no_grad():
        out = {name: adapter.velocity(c.model, x, sigma, cond).float() for name, c in copies.items()}
        worst = max(
            float((_effective_weight(copies[backend], n) - w).norm() / w.norm())
            for n in copies["reference"].quantized
            if (w := copies["reference"].model.get_submodule(n).weight.float()).norm() > 0
        )
    shift = (out["reference"] - out["none"]).norm()
    noise = float((out[backend] - out["none"]).norm() / shift)
    apart = float((out[backend] - out["reference"]).norm() / shift)
    label = f"{precision} via {backend}"
    return [
        row("quant", f"{label}: output vs the reference's, relative to the quantization shift", apart),
        row(
            "quant",
            f"{label}: weights vs reference, max relative difference",
            worst,
            f"<= {tolerance:.0e}",
            worst <= tolerance,
        ),
        row("quant", f"{label}: output shift vs the reference's", noise, "0.5-2", 0.5 <= noise <= 2),
    ]


def _effective_weight(copy, name: str) -> torch.Tensor:
    """The weight a quantized layer of ``copy`` multiplies by, dequantized."""
    layer = copy.model.get_submodule(name)
    if copy.backend == "modelopt":
        return layer.weight_quantizer(layer.weight).float()
    weight = layer.weight
    return (weight.dequantize() if hasattr(weight, "dequantize") else weight).float()


# -- one iteration per family, its memory against the estimate ------------------------------
def iteration_overrides(family: str, cpu: bool, output_dir: str) -> tuple[str, list[str]]:
    """(config, ``--set`` list) of the suite's iteration of ``family``."""
    from diffrl.config import load_config
    from diffrl.models import adapter_class
    from diffrl.twin import QUIET_RUN, full_size_overrides

    run = [f"output_dir={output_dir}", "train.max_steps=2", "logging.progress_bar=false"]
    if cpu:
        return TINY_CONFIGS[family], [*run, *QUIET_RUN]
    name = FAMILY_CONFIGS[family]
    cfg = load_config(name)
    video = VIDEO_SHRINK if adapter_class(cfg.model.family).is_video_family() else ()
    # a tree's leaves per prompt must equal the group: one split into 2 fits SHRINK's group
    tree = TREE_SHRINK if cfg.rollout.strategy == "tree" else ()
    return name, [*full_size_overrides(cfg, steps=2), *SHRINK, *video, *tree, *run]


def measure_iteration(cfg, device: torch.device, sharding: str = "none", iterations: bool = True) -> dict:
    """Two training iterations of ``cfg``: the second's seconds, the memory measured
    (GiB; see the module docstring) and the estimate of the same parts. With
    ``iterations=False`` only the start-up is measured (FSDP's start-up peak)."""
    from diffrl.perf.estimate import TRANSIENT_PARTS, estimate_built
    from diffrl.perf.holdings import PeakBeforeOptimizerStep, live_tensor_bytes
    from diffrl.training.trainer import Trainer

    cuda = device.type == "cuda"
    before = 0 if cuda else live_tensor_bytes()
    trainer = Trainer(cfg)
    startup = torch.cuda.max_memory_allocated() if cuda else live_tensor_bytes() - before
    seconds, measured = None, startup
    if iterations:
        peak = PeakBeforeOptimizerStep(trainer.optimizer)
        trainer.train_step(0)
        synchronize(device)
        start = time.perf_counter()
        trainer.train_step(1)
        synchronize(device)
        seconds = time.perf_counter() - start
        measured = torch.cuda.max_memory_allocated() if cuda else peak.peak - before
        peak.remove()
    parts = estimate_built(
        cfg, trainer.adapter, trainer.policy, trainer.reward_fn, trainer.acc.num_processes, sharding
    )
    if not cuda:  # the inventory runs before an optimizer step, when neither exists
        for transient in TRANSIENT_PARTS:
            parts.pop(transient, None)
    # what exists before the first step: no gradients, AdamW moments, activations or rollouts
    rollout = (*TRANSIENT_PARTS, "trajectory buffer", "rollout conditioning")
    at_start = (
        sum(v for k, v in parts.items() if k not in rollout) - 0.75 * parts["trainable + grads + AdamW"]
    )
    return {
        "seconds": seconds,
        "measured_gib": measured / GIB,
        "estimated_gib": sum(parts.values()) / GIB,
        "startup_gib": startup / GIB,
        "estimated_startup_gib": at_start / GIB,
        "parts_gib": {k: v / GIB for k, v in parts.items()},
    }


def iteration_rows(family: str, result: dict, cpu: bool) -> list[dict]:
    """Pass on a GPU: measured / estimated in 0.5-1.3 (VAE-decode and attention
    transients are not modelled). On a CPU: within 15% + 1 MiB of the inventory (a tiny
    twin's weights are a few MiB, and about a MiB of per-sample rollout tensors, the
    decoded images and copies of the conditioning, is not itemized; at full size that
    is under 1% of the total)."""
    measured, estimated = result["measured_gib"], result["estimated_gib"]
    ratio = measured / estimated
    if cpu:
        ok, target = abs(measured - estimated) * GIB <= 0.15 * estimated * GIB + 2**20, "within 15% + 1 MiB"
        sizes = f"{measured * 1024:.2f} / {estimated * 1024:.2f} MiB"
    else:
        ok, target, sizes = 0.5 <= ratio <= 1.3, "0.5-1.3", f"{measured:.2f} / {estimated:.2f} GiB"
    return [
        row("iteration", f"{family}: seconds per iteration", result["seconds"]),
        row("iteration", f"{family}: measured / estimated memory ({sizes})", ratio, target, ok),
    ]


def _size(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.2f} MiB"


def fsdp_startup_rows(result: dict, processes: int) -> list[dict]:
    """FSDP start-up on ``processes`` processes: the peak while the trainer is built
    against the estimate of what exists then (sharded weights, fp32 master shards,
    reference shards, whole encoders and rewards). A whole model materialised before
    sharding shows as a ratio well above 1."""
    ratio = result["startup_gib"] / result["estimated_startup_gib"]
    return [
        row(
            "fsdp",
            f"start-up peak / estimate on {processes} process(es) "
            f"({_size(result['startup_gib'])} / {_size(result['estimated_startup_gib'])})",
            ratio,
            "<= 1.15",
            ratio <= 1.15,
        )
    ]


# -- rewards ------------------------------------------------------------------------------
def reward_throughput(cpu: bool) -> list[dict]:
    """HPSv2.1 with random weights scoring real-size images (resize and normalisation
    included): ViT-H-14 in bf16 on 1024 px images on a GPU, ViT-B-32 on 512 px on a CPU."""
    import rewards
    from rewards.bench import measure_speed

    device = torch.device("cpu" if cpu else "cuda")
    model, size, sizes, dtype = (
        ("ViT-B-32", 512, [4], "float32") if cpu else ("ViT-H-14", 1024, [64, 256], "bfloat16")
    )
    reward = rewards.build(
        "hpsv21", checkpoint="random", model_name=model, dtype=dtype, batch_size=max(sizes)
    )
    reward.to(device)
    images = torch.rand((8, 3, size, size), generator=torch.Generator().manual_seed(0)).to(device)
    speed = measure_speed(reward, "hpsv21", images, ["a photo of a cat"] * 8, sizes, repeats=2, device=device)
    target = "-" if cpu else ">= 800 img/s"
    return [
        row(
            "rewards",
            f"hpsv21 {model} {dtype} at {size} px, batch {s['batch_size']}: img/s",
            s["images_per_s"],
            target,
            None if cpu else s["images_per_s"] >= 800,
        )
        for s in speed
    ]


# -- the configs' promises ----------------------------------------------------------------
FITS = re.compile(r"^# fits: (\d+) ?x (\d+) GB, (ddp|fsdp)", re.MULTILINE)


def configs_fit(config_dir) -> list[dict]:
    """One :func:`config_fits` row per config in ``config_dir`` whose header promises
    hardware (``# fits: 8x 80 GB, ddp``)."""
    rows = []
    for path in sorted(Path(config_dir).glob("*.yaml")):
        match = FITS.search(path.read_text())
        if match:
            n, gb, sharding = match.groups()
            rows.append(config_fits(path.stem, int(n), float(gb), "none" if sharding == "ddp" else "fsdp"))
    return rows


def config_fits(name: str, processes: int, gb: float, sharding: str) -> dict:
    """Whether ``name`` fits the GPUs its header promises (``# fits: ...``) by the
    meta-device estimate: at most 95% of the GPU's memory (the allocator's slack)."""
    from diffrl.config import load_config
    from diffrl.perf.estimate import estimate_config

    total = estimate_config(load_config(name), processes, sharding)["total_gib"]
    budget = 0.95 * gb * 1e9 / GIB
    return row(
        "estimate",
        f"{name}: {processes}x {gb:g} GB, {sharding} (GiB per process)",
        total,
        f"<= {budget:.1f}",
        total <= budget,
    )

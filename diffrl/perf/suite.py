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


# -- exploration precision ----------------------------------------------------------------
# where the whole FLUX does not fit beside its copies, the race runs FLUX's widths on a
# few blocks: a speed ratio is a per-block ratio (the embeddings and final layer then
# weigh a little more, so the cut model's ratio sits slightly closer to 1)
PRECISION_BLOCKS = {"transformer_blocks": 2, "single_transformer_blocks": 4}
_BLOCK_WORDS = {"transformer_blocks": "double", "single_transformer_blocks": "single"}
# the race's peak besides the policy: the merged BF16 copy (2 bytes a weight) and the FP8
# copy while it is built (a BF16 deep copy, quantized layer by layer: 2 bytes at first,
# about 1.1 after), and activations
RACE_COPY_BYTES_PER_WEIGHT = 2 + 2
RACE_HEADROOM_GIB = 8


def precision_config(cpu: bool) -> tuple[str, list[str]]:
    """(config, ``--set`` list) of the precision race: FLUX.1-dev size at 1024 px with
    random weights, or the tiny FLUX twin on a CPU."""
    from diffrl.twin import QUIET_RUN

    if cpu:
        return "tiny_flux_solrl", list(QUIET_RUN)
    from diffrl.config import load_config
    from diffrl.twin import full_size_overrides

    name = "flux_solrl"
    return name, [*full_size_overrides(load_config(name)), "model.height=1024", "model.width=1024"]


def keep_blocks(transformer: torch.nn.Module, counts: dict[str, int]) -> dict[str, int]:
    """Keep the first ``counts[name]`` blocks of each block list ``name`` (widths untouched);
    returns how many each keeps."""
    kept = {}
    for name, n in counts.items():
        blocks = getattr(transformer, name)
        setattr(transformer, name, blocks[:n])  # a ModuleList's slice is a ModuleList
        kept[name] = min(n, len(blocks))
    return kept


def block_counts(transformer: torch.nn.Module) -> dict[str, int]:
    return {name: len(getattr(transformer, name)) for name in PRECISION_BLOCKS if hasattr(transformer, name)}


def race_fits_full_depth(transformer: torch.nn.Module, free_bytes: float) -> bool:
    """Whether the race's two copies and its activations fit beside the policy at full
    depth (FLUX.1-dev: 12B weights, 48 GB of copies at their peak + 8 GiB; beside the 24 GB
    policy that fits an H100's 80 GB, barely, and an H200's 141 GB easily)."""
    weights = sum(p.numel() for p in transformer.parameters())
    return weights * RACE_COPY_BYTES_PER_WEIGHT + RACE_HEADROOM_GIB * GIB <= free_bytes


def attention_settings() -> str:
    """PyTorch's SDPA backends that are on, as training leaves them (cuDNN off)."""
    flags = {
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
    }
    return "SDPA " + "/".join(k for k, on in flags.items() if on)


def measure_precision(
    cfg, device, modes: list[str], batch: int, repeats: int, compile: bool, emit=None, train: bool = False
) -> dict:
    """``bench.exploration_precision`` on ``cfg``'s model, at full depth where memory allows
    (else cut to :data:`PRECISION_BLOCKS`), under training's autocast and its attention
    settings (cuDNN SDPA off), every raced model compiled alike by block or none. With
    ``train``, then the training step (``bench.training_step``) on the same model, so the
    GPU builds FLUX once for both. ``emit(key, value)`` gets each result the moment it
    exists (the GPU suite writes it out at once)."""
    from diffrl.models import build_adapter
    from diffrl.models.loading import torch_dtype
    from diffrl.models.policy import Policy
    from diffrl.perf import bench
    from diffrl.training.setup import avoid_cudnn_attention

    emit = emit or (lambda key, value: None)
    avoid_cudnn_attention(log=lambda _: None)  # the kernel training runs
    adapter = build_adapter(cfg.model, device=device)
    adapter.to(device)
    Policy(adapter, cfg.model, seed=cfg.seed)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else float("inf")
    full = race_fits_full_depth(adapter.transformer, free)
    blocks = block_counts(adapter.transformer) if full else keep_blocks(adapter.transformer, PRECISION_BLOCKS)
    bench.release_memory()  # the cut blocks
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision)
    sol = cfg.solrl
    steps = (sol.explore_num_steps if sol.explore == "ode" else None) or cfg.sampling.num_steps
    rows = bench.exploration_precision(
        adapter, modes, batch, steps, repeats, log=lambda _: None, autocast=autocast, compile=compile
    )
    result = {"blocks": blocks, "full_depth": full, "attention": attention_settings(), "rows": rows}
    emit("precision", result)
    if train:
        bench.release_memory()
        result["train"] = bench.training_step(
            adapter,
            cfg.train.micro_batch_size,
            max(2, repeats // 2),
            torch_dtype(cfg.model.dtype),
            cfg.objective.train_cfg,
            autocast,
        )
        emit("train", result["train"])
        bench.release_memory()
        result["train_fp8"] = bench.training_step_precision(
            adapter,
            cfg.train.micro_batch_size,
            max(2, repeats // 2),
            autocast,
            cfg.objective.train_cfg,
            cfg.precision.backend,
            cfg.precision.scaling,
            compile,
        )
        emit("train_fp8", result["train_fp8"])
    return result


def precision_rows(result: dict, cpu: bool) -> list[dict]:
    """Each low-precision mode's speed against the merged BF16 copy raced with it, and
    each raced model's first call (compilation and one run); FP8 on a GPU has the 1.4x
    target (NVFP4 is simulated on Hopper: numerics, no speed)."""
    depth = "all" if result.get("full_depth") else "cut to"
    blocks = " + ".join(f"{n} {_BLOCK_WORDS.get(k, k)}" for k, n in result["blocks"].items())
    where = f"{depth} {blocks} blocks, {result.get('attention', 'SDPA')}"
    rows = []
    for r in result["rows"]:
        how = "compiled by block" if r["compiled"] else "eager"
        if r["compiled"]:
            failed = r.get("compile_failed")
            rows.append(
                row(
                    "precision",
                    f"{r['mode']}: first call, compile included (s)",
                    r["first_call_s"],
                    "compiles",
                    failed is None,
                )
            )
            if failed:
                rows.append(row("precision", f"{r['mode']}: compile failed, ran eagerly", failed[:200]))
        if r["mode"] == "bf16":
            rows.append(row("precision", f"bf16 merged copy, {how}: ms per call", r["ms_per_call"]))
            continue
        fp8 = r["mode"].startswith(("fp8", "auto")) and not cpu
        rows.append(
            row(
                "precision",
                f"{r['mode']} exploration / merged bf16, {how}, {where}: speed",
                r["speed_vs_bf16"],
                ">= 1.4x" if fp8 else "-",
                r["speed_vs_bf16"] >= 1.4 if fp8 else None,
            )
        )
    return rows


def train_rows(t: dict, cpu: bool) -> list[dict]:
    """The training step's seconds and MFU (target 40% on a GPU)."""
    target = "-" if cpu else ">= 40%"
    return [
        row("train", f"training-step seconds (batch {t['batch']})", t["seconds"]),
        row(
            "train", f"MFU ({t['peak_basis']} peak)", 100 * t["mfu"], target, None if cpu else t["mfu"] >= 0.4
        ),
        row("train", "training-step peak GiB", t["peak_gib"]),
    ]


def train_precision_rows(t: dict, cpu: bool) -> list[dict]:
    """Jet-RL's unified FP8 training step against the BF16 one on the same model. The
    target on a GPU with FP8 GEMMs is a speed-up (> 1x; Jet-RL reports up to 1.41x on 8B
    LLMs); on a CPU the reference casts only cost time."""
    how = "compiled by block" if t["compiled"] else "eager"
    fast = not cpu and t["backend"] == "torchao"
    return [
        row(
            "train",
            f"unified FP8 training step / bf16 ({t['backend']}, {t['scaling']}, {how}, "
            f"{t['quantized_layers']} layers, autocast {t['autocast']}, batch {t['batch']}): speed",
            t["speed_vs_bf16"],
            "> 1x" if fast else "-",
            t["speed_vs_bf16"] > 1 if fast else None,
        ),
        row("train", "unified FP8 training step seconds", t["fp8_s"]),
        *(
            [
                row(
                    "train",
                    "unified FP8 training step: compile failed, ran eagerly",
                    t["compile_failed"][:200],
                )
            ]
            if t.get("compile_failed")
            else []
        ),
        row(
            "train",
            "unified FP8 training step peak GiB (bf16 step's beside it)",
            f"{t['fp8_peak_gib']:.1f} ({t['bf16_peak_gib']:.1f})",
        ),
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

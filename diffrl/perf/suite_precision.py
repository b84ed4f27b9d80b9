"""The GPU suite's precision race (``scripts/gpu_suite.sh``, step ``precision``): the
exploration copy's FP8 / NVFP4 forwards against BF16, compiled alike by block, and the
FP8 training step against BF16's, at FLUX.1-dev's widths (or the tiny FLUX twin on a CPU).
Rows as :func:`diffrl.perf.suite.row` makes them."""

from __future__ import annotations

import torch

from diffrl.perf.memory import GIB
from diffrl.perf.suite import row

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
            False,  # eager, as the trainer trains (its compiled blocks are the rollouts')
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

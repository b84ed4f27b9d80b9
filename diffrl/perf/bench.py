"""The measurements behind ``scripts/bench_rollout.py``, one function per table.

Every comparison is measured side by side in one process: the variants of a row take
turns within each repeat (so machine drift hits them alike), the first round warms up
(and compiles) and is dropped, and the median is reported with the ratio to the row's
baseline. On CUDA each call is synchronised and its peak allocated memory recorded.
"""

from __future__ import annotations

import statistics
import time

import torch

from diffrl.perf import flops as F
from diffrl.perf.hardware import device_name, gemm_peak, spec_peak, synchronize

GIB = 2**30


def release_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(fn, device) -> tuple[float, float]:
    """(seconds, peak GiB allocated during the call; 0 off CUDA)."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0, (torch.cuda.max_memory_allocated() / GIB if cuda else 0.0)


def race(fns: dict, device, repeats: int) -> dict[str, dict]:
    """Median seconds and peak GiB of each ``fns`` entry, run in turn ``repeats`` + 1 times."""
    times = {k: [] for k in fns}
    peaks = dict.fromkeys(fns, 0.0)
    for r in range(repeats + 1):
        for name, fn in fns.items():
            t, peak = timed(fn, device)
            if r:
                times[name].append(t)
                peaks[name] = max(peaks[name], peak)
    return {k: {"seconds": statistics.median(v), "peak_gib": peaks[k]} for k, v in times.items()}


# -- tree vs independent ------------------------------------------------------------------
def tree_vs_independent(adapter, cfg, schedules, prompts: int, repeats: int) -> list[dict]:
    """BranchGRPO trees against independent rollouts at equal leaves per prompt: NFE and
    wall time per leaf, and their ratios (BranchGRPO sec. 3; the target is <= 0.55x)."""
    from diffrl.sampling import TreeSpec

    rows = []
    for splits, factors in schedules:
        spec = TreeSpec.build(
            cfg.sampling.num_steps, splits, factors, cfg.tree.split_noise_scale, cfg.tree.split_noise
        )
        keys = [(0, 0, g, s) for g in range(prompts) for s in range(spec.leaves)]
        texts = F.benchmark_prompts(adapter, len(F.PROMPTS))
        cond = adapter.encode_prompts([texts[k[2] % len(texts)] for k in keys])
        out = {}
        fns = _samplers(adapter, cfg, spec, keys, cond, out)
        with torch.no_grad():
            res = race(fns, adapter.device, repeats)
        n = len(keys)
        nfe_ratio = out["tree"].nfe / out["ind"].nfe
        time_ratio = res["tree"]["seconds"] / res["independent"]["seconds"]
        rows.append(
            {
                "schedule": f"{splits}x{factors}",
                "leaves": spec.leaves,
                "tree_nfe_per_leaf": out["tree"].nfe / n,
                "independent_nfe_per_leaf": out["ind"].nfe / n,
                "nfe_ratio": nfe_ratio,
                "tree_ms_per_leaf": 1e3 * res["tree"]["seconds"] / n,
                "independent_ms_per_leaf": 1e3 * res["independent"]["seconds"] / n,
                "time_ratio": time_ratio,
            }
        )
    return rows


def _samplers(adapter, cfg, spec, keys, cond, out: dict) -> dict:
    """Closures rolling out ``keys`` as trees and independently, keeping the last results."""
    from diffrl.sampling import rollout_independent, rollout_tree

    def tree():
        out["tree"] = rollout_tree(adapter, adapter.transformer, cond, keys, cfg, spec=spec)

    def independent():
        out["ind"] = rollout_independent(adapter, adapter.transformer, cond, keys, cfg)

    return {"tree": tree, "independent": independent}


# -- exploration precision ----------------------------------------------------------------
def exploration_precision(
    adapter,
    modes: list[str],
    batch: int,
    steps: int,
    repeats: int,
    log=print,
    *,
    autocast: torch.dtype | None = None,
    compile: bool = False,
) -> list[dict]:
    """The policy against exploration copies (Sol-RL stage 1), one velocity evaluation over
    ``batch`` pool candidates per call; images/s assumes ``steps`` evaluations per image.

    ``modes``: ``policy`` (the trainable model itself, LoRA unmerged, in its own dtype),
    ``bf16`` (an exploration copy with LoRA merged and nothing quantized: the like-for-like
    baseline) or ``precision:backend`` (``fp8:torchao``, ``nvfp4:auto``...). The baseline
    is ``bf16`` when listed, else the first mode. Every other mode is raced against the
    baseline in its own pair, and its copy is freed before the next is built, so at most
    the policy and two copies are resident (FLUX.1-dev: 24 GB each in BF16).
    ``speed_vs_bf16`` is the pair's ratio; ``policy_dtype`` says what the policy runs in
    (fp32 on the CPU twins).

    Like for like: every raced model is built eager (torchao's copy too) and, with
    ``compile``, every one is compiled the same way, block by block
    (:class:`diffrl.runtime.regional.RegionalCompile`, ``fullgraph``), so a ratio never
    includes compile gains on one side only. Each model's first call (its compilation,
    and one run) happens before the timed rounds and is reported as ``first_call_s``.
    Every call runs under ``autocast`` when given (training's ``train.mixed_precision``).
    Inductor settings that a backend changes are restored afterwards, so later sections
    compile as before.
    """
    import torch._inductor.config as inductor

    settings = inductor.get_config_copy()
    try:
        return _race_precisions(adapter, modes, batch, steps, repeats, log, autocast, compile)
    finally:
        inductor.load_config(settings)


def _race_precisions(adapter, modes, batch, steps, repeats, log, autocast, compile) -> list[dict]:
    base_mode = "bf16" if "bf16" in modes else modes[0]
    base_model = _exploration_model(adapter, base_mode, log, compile)
    first_call = {base_mode: _first_call(adapter, base_model, batch, autocast)}
    dtype = str(next(adapter.transformer.parameters()).dtype).removeprefix("torch.")
    rows = {}
    for mode in [m for m in modes if m != base_mode] or [base_mode]:
        model = base_model if mode == base_mode else _exploration_model(adapter, mode, log, compile)
        first_call.setdefault(mode, _first_call(adapter, model, batch, autocast))
        fns = {
            base_mode: F.velocity_fn(adapter, base_model, batch, autocast=autocast),
            mode: F.velocity_fn(adapter, model, batch, autocast=autocast),
        }
        res = race(fns, adapter.device, repeats)
        rows.setdefault(base_mode, res[base_mode])
        rows[mode] = {**res[mode], "ratio": res[base_mode]["seconds"] / res[mode]["seconds"]}
        del model, fns
        release_memory()
    rows[base_mode]["ratio"] = 1.0
    return [
        {
            "mode": m,
            "policy_dtype": dtype,
            "ms_per_call": 1e3 * rows[m]["seconds"],
            "images_per_s": batch / (rows[m]["seconds"] * steps),
            "speed_vs_bf16": rows[m]["ratio"],
            "peak_gib": rows[m]["peak_gib"],
            "compiled": "by block" if compile else False,
            "first_call_s": first_call[m]["seconds"],
            "compile_failed": first_call[m]["failed"],
            "autocast": str(autocast).removeprefix("torch.") if autocast else "no",
        }
        for m in modes
    ]


def _first_call(adapter, model, batch: int, autocast) -> dict:
    """The first call's seconds (compiling, and one run) and, if compiling failed, why."""
    seconds, _ = timed(F.velocity_fn(adapter, model, batch, autocast=autocast), adapter.device)
    return {"seconds": seconds, "failed": getattr(model, "failed", None)}


def _exploration_model(adapter, mode: str, log, compile: bool = False):
    """The model a mode explores with: eager, then compiled by block when asked (all alike)."""
    from diffrl.precision.backends import compile_by_block

    if mode == "policy":
        model = adapter.transformer
        if compile:  # the policy itself is compiled in place: keep a handle on its eager blocks
            from diffrl.runtime.regional import RegionalCompile

            return RegionalCompile(model, inference_only=True, log=None, fullgraph=True)
        return model
    from diffrl.precision.backends import build_exploration_copy

    precision, _, backend = mode.partition(":")
    model = build_exploration_copy(
        adapter.transformer, adapter.family, precision, backend or "auto", log=log, compile=False
    ).model
    return compile_by_block(model) if compile else model


# -- one training step --------------------------------------------------------------------
def training_step(
    adapter,
    batch: int,
    repeats: int,
    dtype: torch.dtype,
    guidance: bool = True,
    autocast: torch.dtype | None = None,
) -> dict:
    """One policy forward + backward over ``batch`` samples (CFG rows when ``guidance``):
    seconds, peak memory, FLOPs (counted by FlopCounterMode and printed), and utilisation.

    ``mfu`` counts the model's FLOPs (no recompute); ``hfu`` counts what ran, including
    gradient checkpointing's recompute. The denominator is the device's spec-sheet dense
    peak, or on an unlisted device a measured GEMM peak (``peak_basis`` says which). The
    step runs under ``autocast`` when given (training's ``train.mixed_precision``).

    The recompute is one more forward of the checkpointed blocks; it is taken as one whole
    no-grad forward (counted without running a backward, so nothing is turned off: running
    the step without checkpointing to count it ran out of memory at FLUX size). That
    slightly overstates the recompute by the few layers outside the blocks.
    """
    fn = F.train_step_fn(adapter, batch, guidance, autocast)
    executed = F.count_flops(fn)
    model_flops = executed
    if getattr(adapter.transformer, "is_gradient_checkpointing", False):
        model_flops -= F.count_flops(F.velocity_fn(adapter, adapter.transformer, batch, guidance, autocast))
    res = race({"step": fn}, adapter.device, repeats)["step"]
    name = device_name(adapter.device)
    peak, basis = spec_peak(name, str(dtype).removeprefix("torch.")), "spec sheet"
    if peak is None:
        peak, basis = gemm_peak(adapter.device, dtype), "measured GEMM"
    return {
        "batch": batch,
        "seconds": res["seconds"],
        "peak_gib": res["peak_gib"],
        "model_tflop": model_flops / 1e12,
        "executed_tflop": executed / 1e12,
        "achieved_tflops": executed / res["seconds"] / 1e12,
        "peak_tflops": peak / 1e12,
        "mfu": model_flops / res["seconds"] / peak,
        "hfu": executed / res["seconds"] / peak,
        "peak_basis": basis,
    }


def training_step_precision(
    adapter,
    batch: int,
    repeats: int,
    autocast: torch.dtype | None = None,
    guidance: bool = True,
    backend: str = "auto",
    scaling: str = "rowwise",
    compile: bool = False,
) -> dict:
    """The training step (:func:`~diffrl.perf.flops.train_step_fn`) in the model's precision
    and through Jet-RL's unified FP8 flow (:mod:`diffrl.precision.fp8_flow`), on the same model,
    raced side by side: both eager (the path the trainer takes, and the one the GPU suite
    races), or both with the blocks compiled in place (one graph per block and phase: what
    compiling the training blocks would give; the trainer does not). First calls,
    compilation included, are timed outside the race.
    The transformer stays patched afterwards (outside a phase its layers run as before)."""
    from diffrl.precision.fp8_flow import Fp8Flow, choose_flow_backend
    from diffrl.runtime.regional import RegionalCompile

    backend, _ = choose_flow_backend(backend, scaling)
    flow = Fp8Flow(adapter.transformer, True, True, scaling, backend, adapter.keep_high)
    regional = RegionalCompile(adapter.transformer, log=None) if compile else None
    step = F.train_step_fn(adapter, batch, guidance, autocast)

    def fp8_step():
        with flow.phase("train"):
            step()

    fns = {"bf16": step, "fp8": fp8_step}
    first = {name: timed(fn, adapter.device)[0] for name, fn in fns.items()}
    res = race(fns, adapter.device, repeats)
    return {
        "batch": batch,
        "backend": backend,
        "scaling": scaling,
        "compiled": "by block" if compile and not regional.failed else False,
        "compile_failed": regional.failed if compile else None,
        "quantized_layers": len(flow.quantized),
        "bf16_s": res["bf16"]["seconds"],
        "fp8_s": res["fp8"]["seconds"],
        "speed_vs_bf16": res["bf16"]["seconds"] / res["fp8"]["seconds"],
        "bf16_peak_gib": res["bf16"]["peak_gib"],
        "fp8_peak_gib": res["fp8"]["peak_gib"],
        "first_call_s": first,
        "autocast": str(autocast).removeprefix("torch.") if autocast else "no",
    }


# -- optimisations ------------------------------------------------------------------------
def rollout_optimisations(adapter, batch: int, repeats: int, variants: list[str]) -> list[dict]:
    """The rollout transformer's forward with and without each optimisation, side by side:
    ``eager``; ``compile`` (torch.compile, default mode); ``compile_exact`` (the same with
    inductor's ``emulate_precision_casts``, what ``perf.exact_replay`` compiles: its cost
    against ``compile`` is the price of exact replay); ``cudagraphs`` (compile with
    mode reduce-overhead, CUDA only; skipped elsewhere); ``attn:<backend>`` (diffusers attention backend,
    e.g. ``attn:flash`` or ``attn:_native_math``)."""
    fns = {}
    for v in variants:
        model = _variant_model(adapter.transformer, v)
        if model is None:
            continue
        fns[v] = _with_backend(F.velocity_fn(adapter, model, batch), adapter.transformer, v)
    res = race(fns, adapter.device, repeats)
    base = next(iter(res.values()))["seconds"]  # the first variant that runs here
    return [
        {
            "variant": v,
            "ms_per_call": 1e3 * r["seconds"],
            "speed_vs_first": base / r["seconds"],
            "peak_gib": r["peak_gib"],
        }
        for v, r in res.items()
    ]


def _variant_model(transformer, variant: str):
    if variant == "compile":
        return torch.compile(transformer)
    if variant == "compile_exact":
        from diffrl.runtime.compile import compile_kwargs

        return torch.compile(transformer, **compile_kwargs(None, exact=True))
    if variant == "cudagraphs":
        return (
            torch.compile(transformer, mode="reduce-overhead") if transformer.device.type == "cuda" else None
        )
    return transformer


def _with_backend(fn, transformer, variant: str):
    """``fn`` run with the diffusers attention backend named by ``attn:<backend>``."""
    if not variant.startswith("attn:"):
        return fn
    from diffusers.models.attention_dispatch import attention_backend

    backend = variant.split(":", 1)[1]
    if "hub" in backend:  # hub backends fetch kernels at run time; this toolkit never downloads
        raise ValueError(
            f"attention backend '{backend}' downloads kernels; use a local one (flash, "
            "_flash_3, native, _native_flash, _native_efficient, _native_cudnn, xformers, sage)"
        )

    def run():
        with attention_backend(backend):
            return fn()

    return run


# -- whole iterations -----------------------------------------------------------------------
STAGES = {  # reported stage -> the trainer's StageClock names that make it up
    "sync": ("sync",),
    "explore": ("explore",),
    "select": ("select",),
    "regenerate": ("regenerate",),
    "rollout": ("rollout",),
    "score": ("pool_reward", "reward"),
    "train": ("update",),
}


def iteration_breakdown(cfg, warmup: int = 1) -> dict:
    """Run ``cfg`` for ``cfg.train.max_steps`` iterations with the real Trainer and report the
    median seconds of each stage over the iterations after ``warmup``, their share of the
    iteration, and the largest stage peak memory (CUDA). Sol-RL runs report sync, explore,
    select, regenerate, score and train; plain runs rollout, score and train."""
    from diffrl.training.trainer import Trainer

    trainer = Trainer(cfg)
    history = trainer.fit()
    del trainer  # the next run builds its own models: free this one's first
    release_memory()
    rows = history[warmup:] or history

    def median(key: str) -> float:
        return statistics.median(float(r.get(key, 0.0)) for r in rows)

    stages = {}
    for stage, parts in STAGES.items():
        if any(f"time/{p}" in rows[0] for p in parts):
            stages[stage] = sum(median(f"time/{p}") for p in parts)
    total = sum(stages.values())
    peaks = [float(v) for r in rows for k, v in r.items() if k.startswith("memory/")]
    return {
        "seconds": stages,
        "share": {k: v / total for k, v in stages.items()},
        "total_seconds": total,
        "peak_gib": max(peaks, default=0.0),
        "iterations_timed": len(rows),
    }

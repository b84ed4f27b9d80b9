"""Rollout and training speed of a config, measured side by side in one run.

Sections (``--sections``, default all):

* ``tree``: BranchGRPO trees against independent rollouts at equal leaves per prompt:
  NFE and wall time per leaf.
* ``precision``: the BF16 policy against low-precision exploration copies (Sol-RL
  stage 1): ms per velocity call, images/s, speed ratio, peak memory.
* ``train``: one LoRA training step (policy forward + backward): time, peak memory, the
  FLOPs it executes (counted, printed) and MFU.
* ``optimisations``: the rollout transformer eager, under torch.compile, with CUDA graphs
  and with other attention backends.
* ``estimate``: for configs of a shipped architecture, FLOPs per sample and step and a
  per-process memory estimate at full size, counted on the meta device (no GPU, no
  weights; see ``diffrl.perf.estimate``).
* ``iteration``: whole iterations of the config through the real trainer, broken into
  stages (Sol-RL: sync, explore, select, regenerate, score, train), against the same
  config with Sol-RL off (plain flow-GRPO at the same trained group size).

The model: ``--full-size`` builds the config's published architecture with random
weights (``random:<arch>``, a GPU run); a config naming real weights otherwise runs on
its family's tiny twin (``--tiny-twin``, a CPU smoke run); toy configs run as they are.
Tables are printed (markdown) and everything is written to ``--json``.

    python scripts/bench_rollout.py                                  # toy_solrl on CPU
    python scripts/bench_rollout.py --config flux_solrl --full-size  # FLUX.1-dev size, GPU
    python scripts/bench_rollout.py --config flux_flowgrpo --full-size --sections precision \\
        --modes bf16,fp8:torchao,nvfp4:auto --resolution 1024 --batch 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from diffrl.config import load_config, with_overrides  # noqa: E402
from diffrl.perf import bench  # noqa: E402
from diffrl.perf.hardware import device_name  # noqa: E402

SECTIONS = ("tree", "precision", "train", "optimisations", "estimate", "iteration")
TARGETS = {  # measure -> (target text, peer anchor)
    "tree_nfe_ratio": ("<= 0.55x", "BranchGRPO: 13.68 of 20 NFE per leaf (0.68x)"),
    "fp8_speed": (">= 1.4x (FLUX size, 1024^2, H100)", "diffusers + torchao FLUX FP8: 1.30-1.42x on H100"),
    "train_mfu": (">= 40% (FLUX size, H100 bf16)", "-"),
    "solrl_iteration_ratio": ("-", "Sol-RL: rollout 2.4x faster; BranchGRPO FLUX iteration 698 s -> 148 s"),
}


def parse_schedules(text: str) -> list[tuple[list[int], list[int]]]:
    """ "0,3,6,9:2;1,4:4" -> [([0, 3, 6, 9], [2]), ([1, 4], [4])]."""
    out = []
    for item in text.split(";"):
        steps, factors = item.split(":")
        out.append(([int(s) for s in steps.split(",")], [int(f) for f in factors.split(",")]))
    return out


def check_modes(text: str) -> list[str]:
    """``--modes`` entries, each ``policy`` or ``precision[:backend]`` with known names."""
    from diffrl.config import ConfigError
    from diffrl.precision.backends import BACKENDS, PRECISIONS

    modes = text.split(",")
    precisions = ("auto", *PRECISIONS)  # auto: what this hardware runs fastest
    for mode in modes:
        precision, _, backend = mode.partition(":")
        if mode != "policy" and (precision not in precisions or (backend and backend not in BACKENDS)):
            raise ConfigError(
                f"--modes entry '{mode}': use policy or PRECISION[:BACKEND] with PRECISION one of "
                f"{', '.join(precisions)} and BACKEND one of {', '.join(BACKENDS)}"
            )
    return modes


def default_schedules(cfg) -> list[tuple[list[int], list[int]]]:
    """The config's own tree (when it fits its step count) and 16 leaves from the first 4 steps."""
    n = cfg.sampling.num_steps
    out = [([0, 1, 2, 3], [2])] if n > 4 else []
    if (
        max(cfg.tree.split_steps) < n
        and (list(cfg.tree.split_steps), list(cfg.tree.branch_factors)) not in out
    ):
        out.insert(0, (list(cfg.tree.split_steps), list(cfg.tree.branch_factors)))
    return out


def resolve_config(args):
    """(the config to measure, with the model swap ``--full-size`` or the tiny twin implies;
    the config as written)."""
    from diffrl.models.arch import RANDOM_PREFIX
    from diffrl.twin import QUIET_RUN, full_size_overrides, tiny_twin_overrides

    cfg = load_config(args.config, args.overrides)
    pretrained = cfg.model.pretrained
    if args.full_size:
        extra = full_size_overrides(cfg, steps=args.iterations)
    elif pretrained in ("tiny", "shapeworld") or pretrained.startswith(RANDOM_PREFIX):
        extra = [f"train.max_steps={args.iterations}", *QUIET_RUN]
    else:
        extra = tiny_twin_overrides(cfg) + [f"train.max_steps={args.iterations}"]
    if args.resolution:
        extra += [f"model.height={args.resolution}", f"model.width={args.resolution}"]
    return load_config(args.config, extra + list(args.overrides)), cfg


def build_policy(cfg, device):
    from diffrl.models import build_adapter
    from diffrl.models.policy import Policy

    adapter = build_adapter(cfg.model, device=device)  # only random:<arch> builds on the device directly
    adapter.to(device)
    return adapter, Policy(adapter, cfg.model, seed=cfg.seed)


def run_sections(args, cfg, written, device) -> dict:
    from diffrl.models.arch import arch_for
    from diffrl.models.loading import torch_dtype

    out: dict = {}
    wanted = args.sections.split(",")
    # forwards and training steps run under what training runs them under
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision)
    if any(s in wanted for s in ("tree", "precision", "train", "optimisations")):
        adapter, policy = build_policy(cfg, device)
        if "tree" in wanted:
            schedules = parse_schedules(args.schedules) if args.schedules else default_schedules(cfg)
            out["tree"] = bench.tree_vs_independent(adapter, cfg, schedules, args.prompts, args.repeats)
        if "precision" in wanted:
            steps = cfg.solrl.explore_num_steps if cfg.solrl.explore == "ode" else cfg.sampling.num_steps
            out["precision"] = bench.exploration_precision(
                adapter,
                check_modes(args.modes),
                args.batch,
                steps or cfg.sampling.num_steps,
                args.repeats,
                autocast=autocast,
                compile=args.compile,
            )
        if "optimisations" in wanted:
            out["optimisations"] = bench.rollout_optimisations(
                adapter, args.batch, args.repeats, args.variants.split(",")
            )
        if "train" in wanted:
            out["train"] = bench.training_step(
                adapter,
                cfg.train.micro_batch_size,
                args.repeats,
                torch_dtype(cfg.model.dtype),
                cfg.objective.train_cfg,
                autocast,
            )
        del adapter, policy  # the iteration section builds its own trainers
        bench.release_memory()
    if "estimate" in wanted:
        if arch_for(written.model.pretrained) is None:
            print(
                f"estimate: skipped, '{written.model.pretrained}' is not a shipped architecture (assets/arch)"
            )
        else:
            from diffrl.perf.estimate import estimate_config

            out["estimate"] = estimate_config(written, args.processes, args.sharding)
    if "iteration" in wanted:
        out["iteration"] = iterations(cfg, args.vs)
    return out


def iterations(cfg, versus: list[str] = ()) -> dict:
    """The config's iterations, and with Sol-RL on, the same config with Sol-RL off, and
    each ``versus`` assignment (``perf.compile_rollout=true``) applied alone."""
    runs = {"config": cfg}
    for assignment in versus:
        runs[f"config + {assignment}"] = with_overrides(cfg, [assignment])
    if cfg.solrl.enabled:
        runs["flow-GRPO (solrl off)"] = with_overrides(
            cfg, ["solrl.enabled=false", "rollout.strategy=independent"]
        )
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, c in runs.items():
            c = with_overrides(c, [f"output_dir={tmp}/{len(result)}", "logging.progress_bar=false"])
            result[name] = bench.iteration_breakdown(c)
    return result


def markdown(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append(
            "| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()) + " |"
        )
    return "\n".join(lines)


def ratio_rows(results: dict) -> list[dict]:
    """The headline ratios next to their targets and the peer anchors."""
    rows = []

    def add(key, measure, value):
        target, anchor = TARGETS[key]
        rows.append({"measure": measure, "ours": value, "target": target, "peer anchor": anchor})

    for r in results.get("tree", []):
        add(
            "tree_nfe_ratio",
            f"tree/independent NFE per leaf, {r['schedule']}",
            f"{r['nfe_ratio']:.2f}x (time {r['time_ratio']:.2f}x)",
        )
    for r in results.get("precision", []):
        if r["mode"] not in ("policy", "bf16"):
            add("fp8_speed", f"{r['mode']} exploration vs merged bf16 copy", f"{r['speed_vs_bf16']:.2f}x")
    if "train" in results:
        t = results["train"]
        add(
            "train_mfu",
            f"training-step MFU ({t['peak_basis']} peak; HFU {100 * t['hfu']:.1f}%)",
            f"{100 * t['mfu']:.1f}%",
        )
    it = results.get("iteration", {})
    if "flow-GRPO (solrl off)" in it:
        a, b = it["config"]["total_seconds"], it["flow-GRPO (solrl off)"]["total_seconds"]
        add("solrl_iteration_ratio", "Sol-RL iteration / flow-GRPO iteration", f"{a / b:.2f}x")
    for name, run in it.items():
        if name.startswith("config + "):
            speed = it["config"]["total_seconds"] / run["total_seconds"]
            rows.append(
                {
                    "measure": f"iteration speed-up of {name[9:]}",
                    "ours": f"{speed:.2f}x",
                    "target": "> 1x to keep it",
                    "peer anchor": "-",
                }
            )
    return rows


def report(results: dict) -> str:
    parts = []
    for name in ("tree", "precision", "optimisations"):
        if name in results:
            parts += [f"### {name}", markdown(results[name])]
    if "train" in results:
        t = results["train"]
        parts += [
            "### train",
            f"FLOPs per step (FlopCounterMode): model {t['model_tflop']:.4g} TFLOP, executed "
            f"{t['executed_tflop']:.4g} TFLOP (with checkpointing's recompute)",
            markdown([t]),
        ]
    if "estimate" in results:
        e = results["estimate"]
        parts += [
            f"### estimate: {e['arch']} at full size, per process of {e['num_processes']} "
            f"(meta device, sharding {e['sharding']})",
            markdown([{k: v for k, v in e.items() if not isinstance(v, dict)}]),
            markdown([{"part": k, "GiB": v} for k, v in e["memory_gib"].items()]),
            "GiB per process by sharding (none: DDP, every process holds the whole model):",
            markdown([e["total_gib_by_sharding"]]),
        ]
    for name, it in results.get("iteration", {}).items():
        rows = [{"stage": k, "seconds": v, "share": it["share"][k]} for k, v in it["seconds"].items()]
        parts += [
            f"### iteration: {name} (median of {it['iterations_timed']}; total {it['total_seconds']:.3f} s, "
            f"peak {it['peak_gib']:.1f} GiB)",
            markdown(rows),
        ]
    ratios = ratio_rows(results)
    if ratios:
        parts += ["### ratios", markdown(ratios)]
    return "\n\n".join(parts)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="toy_solrl", help="config name or path (default: toy_solrl)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--full-size", action="store_true", help="published architecture, random weights (GPU)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--resolution", type=int, default=None, help="override model height and width")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per variant (median reported)")
    p.add_argument("--prompts", type=int, default=4, help="trees per rollout in the tree section")
    p.add_argument(
        "--schedules",
        default=None,
        help="tree section: ';'-separated 'split steps:branch factors' (default: the config's tree "
        "and splits at 0,1,2,3 into 2)",
    )
    p.add_argument(
        "--modes",
        default="policy,bf16,fp8:auto,nvfp4:auto",
        help="precision section: policy (LoRA unmerged), bf16 (merged copy) or precision:backend",
    )
    p.add_argument(
        "--variants", default="eager,compile,compile_exact,cudagraphs", help="optimisations section"
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="samples per call in the precision/optimisations sections (default: rollout.batch_size)",
    )
    p.add_argument("--iterations", type=int, default=3, help="trainer iterations (the first is dropped)")
    p.add_argument(
        "--vs",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="iteration section: also run the config with this assignment (repeatable)",
    )
    p.add_argument(
        "--processes", type=int, default=8, help="estimate section: processes the config is split over"
    )
    p.add_argument(
        "--sharding",
        choices=("none", "fsdp"),
        default="none",
        help="estimate section: whose parts to list (both totals are printed side by side)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="precision section: torch.compile every raced model alike (baseline included)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    check_modes(args.modes)  # before any model is built
    cfg, written = resolve_config(args)
    args.batch = args.batch or cfg.rollout.batch_size
    device = torch.device(args.device)
    head = (
        f"# {args.config}: {cfg.model.family} {cfg.model.pretrained} at "
        f"{cfg.model.height}x{cfg.model.width}, "
        f"{cfg.model.dtype}, {cfg.sampling.num_steps} steps; {device_name(device)}; torch {torch.__version__}"
    )
    print(head, flush=True)
    from diffrl.training.setup import avoid_cudnn_attention

    avoid_cudnn_attention()  # time what training runs
    results = run_sections(args, cfg, written, device)
    print(report(results))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"head": head, "args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    from diffrl.cli import run_cli

    run_cli(main)

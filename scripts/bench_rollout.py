"""Tree (BranchGRPO) vs independent rollouts at the same number of leaves per prompt.

For each branching schedule, both samplers roll out ``--prompts`` prompts with the same
leaves per prompt, alternating runs so that machine drift hits both alike. The table
gives transformer evaluations (NFE) and wall time per leaf, their tree/independent
ratios, and how far the time ratio is from the NFE ratio.

    python scripts/bench_rollout.py                       # shipped toy model, 10 steps
    python scripts/bench_rollout.py --steps 20 --schedules "0,3,6,9:2;0,4,8,12:2"
    python scripts/bench_rollout.py --config tiny_flux_branchgrpo --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from diffrl.config import load_config  # noqa: E402
from diffrl.models import build_adapter  # noqa: E402
from diffrl.sampling import TreeSpec, rollout_independent, rollout_tree  # noqa: E402


def parse_schedules(text: str) -> list[tuple[list[int], list[int]]]:
    """"0,3,6,9:2;1,4:4" -> [([0, 3, 6, 9], [2]), ([1, 4], [4])]."""
    out = []
    for item in text.split(";"):
        steps, factors = item.split(":")
        out.append(([int(s) for s in steps.split(",")], [int(f) for f in factors.split(",")]))
    return out


def _timed(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def bench_schedule(adapter, cfg, splits, factors, prompts: int, repeats: int) -> dict:
    spec = TreeSpec.build(cfg.sampling.num_steps, splits, factors, cfg.tree.split_noise_scale)
    leaves = spec.leaves
    keys = [(0, 0, g, s) for g in range(prompts) for s in range(leaves)]
    words = ["a red circle", "two blue squares", "a green triangle to the left of a cyan circle"]
    cond = adapter.encode_prompts([words[g % len(words)] for g in range(prompts) for _ in range(leaves)])
    tree_times, ind_times = [], []
    for r in range(repeats + 1):  # the first pair warms up and is dropped
        t_tree, tree = _timed(lambda: rollout_tree(adapter, adapter.transformer, cond, keys, cfg, spec=spec))
        t_ind, ind = _timed(lambda: rollout_independent(adapter, adapter.transformer, cond, keys, cfg))
        if r:
            tree_times.append(t_tree)
            ind_times.append(t_ind)
    n = prompts * leaves
    nfe_ratio = tree.nfe / ind.nfe
    time_ratio = statistics.median(tree_times) / statistics.median(ind_times)
    return {"schedule": f"{splits}x{factors}", "leaves": leaves, "tree_nfe_leaf": tree.nfe / n,
            "ind_nfe_leaf": ind.nfe / n, "nfe_ratio": nfe_ratio,
            "tree_ms_leaf": 1e3 * statistics.median(tree_times) / n, "ind_ms_leaf": 1e3 * statistics.median(ind_times) / n,
            "time_ratio": time_ratio, "gap": time_ratio / nfe_ratio - 1}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="toy_branchgrpo", help="config whose model and sampling settings are used")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the config's)")
    p.add_argument("--schedules", default="0,1,2,3:2;0,2,4,6:2;1,4:4",
                   help="';'-separated 'split steps:branch factors' (one factor for all splits, or one per split)")
    p.add_argument("--prompts", type=int, default=16, help="prompts (trees) per rollout")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per sampler (median reported)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per transformer forward (default: the config's)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    overrides = ["rollout.strategy=independent", "sampling.sde_window=null"]
    if args.steps:
        overrides.append(f"sampling.num_steps={args.steps}")
    if args.batch_size:
        overrides.append(f"rollout.batch_size={args.batch_size}")
    cfg = load_config(args.config, overrides)
    adapter = build_adapter(cfg.model)
    adapter.to(torch.device(args.device))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu x{torch.get_num_threads()} threads"
    print(f"# {cfg.model.family} ({cfg.model.pretrained}), {cfg.sampling.num_steps} steps, {args.prompts} prompts, "
          f"batch {cfg.rollout.batch_size}, {device}, median of {args.repeats}")
    rows = [bench_schedule(adapter, cfg, s, f, args.prompts, args.repeats) for s, f in parse_schedules(args.schedules)]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python
"""Where is your reward decided? Branch one trajectory per prompt at every denoising step
into several children and measure the reward variance each step's noise creates; print
split steps and an SDE window that follow from it, and draw the curve.

    python scripts/probe_decision_depth.py --config toy_flowgrpo
    python scripts/probe_decision_depth.py --config toy_flowgrpo --prompts 32 --children 8 --out probe/
    python scripts/probe_decision_depth.py --config RUN/config.yaml --checkpoint RUN/checkpoints/step-100
    python scripts/probe_decision_depth.py --config toy_late_flowgrpo \
        --scores shapeworld_clause/shapes shapeworld_clause/texture_given_shapes
    python scripts/probe_decision_depth.py --compare base=a/probe.json late=b/probe.json --out cmp/

--scores also measures named parts of the reward (the names the run logs, e.g. a verifier's
clauses): a total decided early can hide a part that is decided late.

Cost: prompts x children x T(T+1)/2 transformer rows (T = sampling.num_steps), so a real
model wants few prompts. Writes probe.json and probe.png to --out. The method is in
diffrl/evaluation/decision_depth.py.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="config name or path")
    p.add_argument(
        "--compare",
        nargs="+",
        metavar="LABEL=PROBE.json",
        help="instead of probing: put earlier probes side by side (a table and compare.png)",
    )
    p.add_argument("--checkpoint", default="base", help="'base' or a checkpoints/step-N directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--prompts", type=int, default=16, help="prompts, evenly spaced through the file")
    p.add_argument("--prompt-file", default=None, help="default: the config's data.train_prompts")
    p.add_argument("--children", type=int, default=8, help="children per branch (>= 2)")
    p.add_argument("--num-steps", type=int, default=None, help="default: sampling.num_steps")
    p.add_argument("--noise-level", type=float, default=None, help="default: sampling.noise_level")
    p.add_argument("--splits", type=int, default=3, help="split steps to recommend")
    p.add_argument("--window", type=int, default=None, help="SDE window width (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scores",
        nargs="+",
        default=[],
        metavar="NAME",
        help="logged scores of the reward to measure per step too (e.g. shapeworld_clause/shapes)",
    )
    p.add_argument("--out", type=Path, default=None, help="default: outputs/probe_decision_depth/CONFIG")
    return p


def measure(args):
    """(config, curve, steps, window width): the probe run on the config's policy, or on a
    checkpoint's (the weights its evaluations scored) in an inference session."""
    from diffrl.config import load_config
    from diffrl.data.prompts import spaced_subset
    from diffrl.evaluation import decision_depth as dd
    from diffrl.inference.session import Session, session_for_checkpoint
    from diffrl.sampling.windows import sde_window_at

    if args.checkpoint == "base":
        session = Session(load_config(args.config, list(args.overrides)))
    else:
        session = session_for_checkpoint(args.checkpoint, args.config, list(args.overrides))
    cfg = session.cfg
    steps = args.num_steps or cfg.sampling.num_steps
    level = cfg.sampling.noise_level if args.noise_level is None else args.noise_level
    prompts = spaced_subset(session.read_prompts(args.prompt_file or cfg.data.train_prompts), args.prompts)
    start, end = sde_window_at(cfg.sampling, steps, 0)
    curve = dd.probe(
        session.adapter,
        session.policy.transformer,
        session.reward_fn,
        prompts,
        steps,
        cfg.sampling.sde_type,
        level,
        children=args.children,
        batch=cfg.rollout.batch_size,
        seed=args.seed,
        scores=tuple(args.scores),
    )
    return cfg, curve, steps, args.window or max(end - start, 1)


def print_table(curve, advice) -> None:
    print("\n| step | variance | s.e. | share | cumulative | mean reward |\n|---|---|---|---|---|---|")
    for k, (v, e, s, c, r) in enumerate(
        zip(curve.variance, curve.standard_error, curve.share, curve.cumulative_share, curve.mean_reward)
    ):
        print(f"| {k} | {v:.4g} | {e:.2g} | {s:.3f} | {c:.3f} | {r:.3f} |")
    if curve.scores:
        from diffrl.evaluation.decision_depth import decided_by

        names = list(curve.scores)
        print("\nshare of each part's between-sibling variance per step:\n")
        print("| step | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        shares = {n: curve.score_share(n) for n in names}
        for k in range(len(curve.variance)):
            print(f"| {k} | " + " | ".join(f"{shares[n][k]:.3f}" for n in names) + " |")
        for n in names:
            half, most = decided_by(shares[n], 0.5), decided_by(shares[n], 0.8)
            print(f"{n}: half decided by step {half}, 80% by step {most}")
    print("\n" + "\n".join(advice.lines()))


def record(args, steps: int, curve, advice) -> dict:
    return {
        "config": args.config,
        "checkpoint": args.checkpoint,
        "overrides": args.overrides,
        "seed": args.seed,
        "num_steps": steps,
        **curve.as_dict(),
        "recommendation": {
            "split_steps": advice.split_steps,
            "split_share": advice.split_share,
            "sde_window": list(advice.window),
            "window_share": advice.window_share,
            "steps_for_80_percent": advice.steps_for_80,
        },
    }


def compare(specs: list[str], out: Path) -> int:
    """Earlier probes side by side: each step's share and the cumulative share per probe."""
    from diffrl.evaluation import decision_depth as dd

    curves = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            raise ValueError(f"--compare takes LABEL=PATH/probe.json entries; got '{spec}'")
        curves[label] = dd.DepthCurve.from_dict(json.loads(Path(path).read_text()))
    steps = max(len(c.variance) for c in curves.values())
    print("| step | " + " | ".join(f"{k} share | {k} cumulative" for k in curves) + " |")
    print("|---|" + "---|---|" * len(curves))
    for k in range(steps):
        cells = [
            f"{c.share[k]:.3f} | {c.cumulative_share[k]:.3f}" if k < len(c.share) else "- | -"
            for c in curves.values()
        ]
        print(f"| {k} | " + " | ".join(cells) + " |")
    out.mkdir(parents=True, exist_ok=True)
    dd.plot_many(curves, out / "compare.png")
    print(f"wrote {out / 'compare.png'}")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from diffrl.evaluation import decision_depth as dd

    if args.compare:
        return compare(args.compare, args.out or Path("outputs/probe_decision_depth/compare"))
    if not args.config:
        raise ValueError("give --config NAME to probe, or --compare LABEL=probe.json ... to compare probes")

    cfg, curve, steps, window = measure(args)
    advice = dd.recommend(curve, splits=args.splits, window=window)
    out = args.out or Path("outputs/probe_decision_depth") / cfg.run_name
    out.mkdir(parents=True, exist_ok=True)
    print_table(curve, advice)
    (out / "probe.json").write_text(json.dumps(record(args, steps, curve, advice), indent=1))
    dd.plot(curve, out / "probe.png", f"{args.config}: where the reward is decided")
    print(f"wrote {out / 'probe.json'} and {out / 'probe.png'}")
    return 0


if __name__ == "__main__":
    from diffrl.cli import run_cli

    run_cli(main)

"""Benchmark reward models side by side: pairwise preference accuracy (with and without
ties, Pick-a-Pic's tie credit), throughput and latency at several batch sizes, peak
memory, score distributions, and Spearman / Kendall correlations across rewards.

    python scripts/bench_rewards.py                                   # the shipped ShapeWorld pairs
    python scripts/bench_rewards.py --reward shapeworld --reward jpeg_compressibility \\
        --reward 'hpsv2={"checkpoint": "/models/HPS_v2_compressed.pt"}' \\
        --pairs data/hpdv2_test/pairs.jsonl --batch-sizes 1 8 32 --device cuda --out outputs/bench_rewards
    python scripts/bench_rewards.py --reward pickscore --images my_folder   # a folder with prompts.jsonl

Writes ``results.json``, ``results.md`` and ``results.png`` to ``--out``. ``--reward``
takes a registered name, optionally ``=`` a JSON object of its constructor arguments
(weights paths, model names).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import rewards  # noqa: E402
from rewards import bench  # noqa: E402
from rewards.bench_report import figure, markdown  # noqa: E402

DEFAULT_PAIRS = Path(__file__).resolve().parents[1] / "assets" / "reward_bench" / "shapeworld" / "pairs.jsonl"


def parse_reward(spec: str) -> tuple[str, dict]:
    name, _, args = spec.partition("=")
    try:
        kwargs = json.loads(args) if args else {}
    except json.JSONDecodeError as err:
        raise SystemExit(
            f"error: --reward '{spec}': the arguments after '=' must be a JSON object ({err.msg})"
        ) from None
    if not isinstance(kwargs, dict):
        raise SystemExit(f"error: --reward '{spec}': the arguments after '=' must be a JSON object")
    return name.strip(), kwargs


def build(name: str, kwargs: dict, device: str):
    try:
        reward = rewards.build(name, **kwargs)
    except (KeyError, FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: reward '{name}': {err}") from None
    if hasattr(reward, "to"):
        reward.to(device)
    return reward


def bench_one(reward, name: str, data: dict, args) -> tuple[dict, torch.Tensor]:
    images, prompts = data["images"], data["prompts"]
    scores = bench.score_all(reward, name, images, prompts, max(args.batch_sizes))
    result = {"scores": bench.score_stats(scores)}
    if data.get("labels"):
        n = len(data["labels"])
        a, b = scores[:n], scores[n : 2 * n]
        result["pairwise"] = bench.pairwise_accuracy(a, b, data["labels"], args.tie_threshold)
        result["pairwise"]["tie_threshold"] = args.tie_threshold
        t, acc = bench.best_tie_threshold(a, b, data["labels"])
        result["pairwise"].update(best_tie_threshold=t, accuracy_at_best_threshold=acc)
    if not args.no_speed:
        result["speed"] = bench.measure_speed(
            reward, name, images, prompts, args.batch_sizes, args.repeats, args.device
        )
    return result, scores


def load_data(args) -> dict:
    if args.images:
        paths, prompts = bench.load_folder(args.images)
        return {
            "images": bench.read_images(paths, [f"{args.images}/prompts.jsonl"] * len(paths)),
            "prompts": prompts,
        }
    pairs = bench.load_pairs(args.pairs)
    images = bench.read_images(
        [p.image_a for p in pairs] + [p.image_b for p in pairs],
        [f"{p.where} (image_a)" for p in pairs] + [f"{p.where} (image_b)" for p in pairs],
    )
    prompts = [p.prompt for p in pairs] * 2
    return {"images": images, "prompts": prompts, "labels": [p.label for p in pairs]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--reward",
        action="append",
        help="NAME or NAME={json args}; repeatable (default: shapeworld and jpeg_compressibility)",
    )
    ap.add_argument(
        "--pairs", default=str(DEFAULT_PAIRS), help="preference JSONL (prompt, image_a, image_b, label)"
    )
    ap.add_argument("--images", help="a folder of images with prompts.jsonl, instead of --pairs")
    ap.add_argument(
        "--tie-threshold", type=float, default=0.0, help="|score_a - score_b| <= this predicts a tie"
    )
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-speed", action="store_true", help="skip the throughput measurement")
    ap.add_argument("--out", default="outputs/bench_rewards")
    args = ap.parse_args(argv)
    specs = [parse_reward(s) for s in (args.reward or ["shapeworld", "jpeg_compressibility"])]
    try:
        data = load_data(args)
    except bench.PreferenceFileError as err:
        raise SystemExit(f"error: {err}") from None
    data["images"] = data["images"].to(args.device)
    results, all_scores = {"device": str(args.device), "data": args.images or args.pairs, "rewards": {}}, {}
    for name, kwargs in specs:
        reward = build(name, kwargs, args.device)
        results["rewards"][name], all_scores[name] = bench_one(reward, name, data, args)
        print(f"{name}: done", flush=True)
    results["rank_correlations"] = bench.rank_correlations(all_scores) if len(all_scores) > 1 else {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (out / "results.md").write_text(table)
    figure(results, all_scores, out / "results.png")
    print(table)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'results.png'}")
    return results


if __name__ == "__main__":
    main()

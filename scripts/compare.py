"""Alignment comparison grids: the same prompts and seeds (the same initial noise) through
the base model and each checkpoint, scored by the chosen rewards, as PNG pages, a
sortable HTML page and scores.jsonl. ``--rlg-scales`` adds RLG columns per checkpoint
(w = 0 base, 1 aligned, > 1 extrapolated).

    python scripts/compare.py --config toy_flowgrpo --checkpoint base \\
        --checkpoint trained=outputs/toy_flowgrpo/checkpoints/step-100 --num-prompts 8 --seeds 0 1
    python scripts/compare.py --config toy_flowgrpo --checkpoint base --checkpoint RUN/checkpoints/step-100 \\
        --rlg-scales 0,0.5,1,1.5,2 --prompts my_prompts.txt --out outputs/compare
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffrl.cli import run_cli  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", required=True, help="config name or path (model family, base weights, rewards)"
    )
    ap.add_argument(
        "--checkpoint",
        action="append",
        required=True,
        help="base, PATH or NAME=PATH (a checkpoints/step-N or diffusers LoRA directory); repeatable",
    )
    ap.add_argument("--prompts", help="prompt file (.txt or .jsonl); default: the config's eval prompts")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, help="ODE steps; default: sampling.eval_num_steps")
    ap.add_argument("--rlg-scales", help="comma list of RLG scales, e.g. 0,0.5,1,1.5,2")
    ap.add_argument("--rows-per-page", type=int, default=16)
    ap.add_argument(
        "--scale", type=int, help="integer pixel zoom of the PNG tiles (default: to about 160 px)"
    )
    ap.add_argument(
        "--groups-per-row",
        type=int,
        default=1,
        help="prompt x seed groups side by side in the PNG (1: one per row; 3 makes a wide figure)",
    )
    ap.add_argument("--set", action="append", default=[], help="config override key=value")
    ap.add_argument("--out", default="outputs/compare")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    from diffrl.config import load_config
    from diffrl.data.prompts import holdout_split, load_prompts
    from diffrl.evaluation.compare import CompareError, parse_checkpoints, run_comparison, with_rlg_scales
    from diffrl.evaluation.compare_report import grid_pages, write_html, write_jsonl
    from diffrl.inference.session import Session

    args = parse_args(argv)
    if args.num_prompts < 1:
        raise CompareError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.groups_per_row < 1:
        raise CompareError(f"--groups-per-row must be at least 1, got {args.groups_per_row}")
    cfg = load_config(args.config, args.set)
    try:
        scales = [float(w) for w in args.rlg_scales.split(",")] if args.rlg_scales else []
    except ValueError:
        raise CompareError(f"--rlg-scales must be comma-separated numbers, got '{args.rlg_scales}'") from None
    columns = with_rlg_scales(parse_checkpoints(args.checkpoint), scales)
    if args.prompts or not cfg.data.eval_holdout:
        source = args.prompts or cfg.data.eval_prompts
        prompts = load_prompts(source)
    else:  # the evaluation prompts the config holds out of its training file
        source = cfg.data.train_prompts
        prompts = holdout_split(load_prompts(source), cfg.data.eval_holdout, source)[1]
    prompts = prompts[: args.num_prompts]  # a bad file fails before any model is built
    session = Session(cfg)
    session.check_prompts(prompts, source)
    steps = args.steps or cfg.sampling.eval_num_steps or cfg.sampling.num_steps
    tiles = run_comparison(session, columns, prompts, args.seeds, steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [c.name for c in columns]
    main_reward = cfg.rewards[0].key
    pages = grid_pages(tiles, names, main_reward, args.rows_per_page, args.scale, args.groups_per_row)
    for i, page in enumerate(pages):
        page.save(out / (f"grid_{i + 1}.png" if len(pages) > 1 else "grid.png"))
    write_jsonl(tiles, out / "scores.jsonl")
    write_html(
        tiles,
        names,
        sorted({k for t in tiles for k in t.scores}),
        out / "index.html",
        f"{cfg.run_name}: {', '.join(names)}",
    )
    print(f"wrote {len(pages)} PNG page(s), index.html and scores.jsonl to {out}")
    return {"tiles": tiles, "pages": len(pages), "out": out}


if __name__ == "__main__":
    run_cli(main)

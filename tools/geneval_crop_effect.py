#!/usr/bin/env python
"""How much does classifying a raw box crop, instead of GenEval's masked crop, change the
colour vote? Measured on the ShapeWorld twin, whose detector knows each object's pixels.

GenEval composites the detector's mask onto #999 grey before CLIP names an object's colour;
OWLv2 gives boxes only, so our crops keep the background (rewards/geneval_models.py). On
rendered ShapeWorld scenes this script reports, per shape, the share of each box crop that
is not the object, and how often a colour vote names the right palette colour on the box
crop and on the masked crop. The vote is CLIP (``--clip``, a CLIPModel directory) when
given, else an offline stand-in: the crop's mean colour, nearest palette colour (it shows
how much the extra pixels move a vote; CLIP's sensitivity to them is not the same).

    python tools/geneval_crop_effect.py                       # stand-in vote, 600 scenes, 32 px
    python tools/geneval_crop_effect.py --resolution 64 --clip openai/clip-vit-large-patch14
"""

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402

from rewards.geneval_models import ClipColours, ShapeWorldDetector, colour_crop  # noqa: E402
from rewards.shapeworld import grammar  # noqa: E402
from rewards.shapeworld.render import PALETTE, render  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenes", type=int, default=600, help="rendered scenes, prompts cycled through")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--prompts", type=Path, default=ROOT / "assets" / "shapeworld" / "heldout.txt")
    p.add_argument("--clip", default=None, help="CLIPModel hub id or directory (default: the stand-in)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the table as JSON here")
    return p


def mean_colour_vote(image: torch.Tensor, found, cls: str, masks: bool) -> list[str]:
    """The stand-in: each crop's mean RGB, named by the nearest palette colour."""
    palette = torch.tensor(list(PALETTE.values()), dtype=torch.float32) / 255
    means = torch.stack([colour_crop(image, f, masks).flatten(1).mean(1) for f in found])
    return [list(PALETTE)[i] for i in torch.cdist(means, palette).argmin(1).tolist()]


def measure(args) -> dict:
    prompts = [p for p in args.prompts.read_text().splitlines() if p.strip() and not p.startswith("#")]
    rnd, detector = random.Random(args.seed), ShapeWorldDetector()
    if args.clip:
        cpu = torch.device("cpu")
        clip = {m: ClipColours(args.clip, cpu, torch.float32, grammar.COLOURS, m) for m in (False, True)}
        vote = lambda image, found, cls, masks: clip[masks](image, found, cls)  # noqa: E731
    else:
        vote = mean_colour_vote
    rows: dict[str, dict] = {}
    for k in range(args.scenes):
        pixels = torch.from_numpy(render(grammar.parse(prompts[k % len(prompts)]), rnd, args.resolution))
        image = pixels.permute(2, 0, 1).float() / 255
        for cls, found in detector(image[None], list(grammar.SHAPES))[0].items():
            row = rows.setdefault(cls, {"objects": 0, "not_object": 0.0, "box_right": 0, "mask_right": 0})
            row["objects"] += len(found)
            for f in found:
                area = (f.box[2] - f.box[0]) * (f.box[3] - f.box[1])
                row["not_object"] += 1 - f.mask.sum().item() / area
            truth = [f.colour for f in found]
            for key, masks in (("box_right", False), ("mask_right", True)):
                row[key] += sum(a == b for a, b in zip(vote(image, found, cls, masks), truth))
    return {
        cls: {
            "objects": r["objects"],
            "non_object_share_of_box": r["not_object"] / r["objects"],
            "colour_right_box_crop": r["box_right"] / r["objects"],
            "colour_right_masked_crop": r["mask_right"] / r["objects"],
        }
        for cls, r in sorted(rows.items())
    }


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    table = measure(args)
    vote = f"CLIP {args.clip}" if args.clip else "stand-in (mean colour, nearest palette colour)"
    print(f"{args.scenes} scenes at {args.resolution} px from {args.prompts.name}; vote: {vote}")
    print("| shape | objects | box pixels not the object | colour right: box crop | masked crop |")
    print("|---|---|---|---|---|")
    for cls, r in table.items():
        print(
            f"| {cls} | {r['objects']} | {r['non_object_share_of_box']:.1%} | "
            f"{r['colour_right_box_crop']:.1%} | {r['colour_right_masked_crop']:.1%} |"
        )
    if args.out:
        settings = {**vars(args), "prompts": str(args.prompts), "out": str(args.out)}
        args.out.write_text(json.dumps({"args": settings, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

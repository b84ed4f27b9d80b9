#!/usr/bin/env python
"""Does a toy model read the relation word? Prints, for each relation word, where ODE
samples put the second object; for each single-object position caption ("a red circle to
the left", the pretraining curriculum's first kind), where the object lands; and how much
the transformer output moves when only the relation word changes (see
diffrl/toy/relation_probe.py).

    python scripts/probe_toy_relations.py                      # the shipped base
    python scripts/probe_toy_relations.py --model DIR --prompts heldout
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a saved toy model directory (default: the shipped base)")
    p.add_argument("--prompts", choices=["train", "heldout"], default="train")
    p.add_argument("--n", type=int, default=64, help="relation prompts, each asked with all four words")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    import torch

    from diffrl.models.toy import SHIPPED, ToyPipeline
    from diffrl.toy import relation_probe as probe

    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else SHIPPED
    if not (path / "model_index.json").is_file():
        print(
            f"error: --model '{path}' is not a saved toy model (no model_index.json there)", file=sys.stderr
        )
        return 2
    pipe = ToyPipeline.from_pretrained(path)
    prompts = probe.relation_prompts(args.prompts, args.n)
    print(f"{path}: {len(prompts)} {args.prompts} relation prompts")
    print(f"{'asked':<18}{'n':>4}  {'2nd right of 1st':>17}  {'2nd below 1st':>14}")
    for relation, row in probe.sample_placement(pipe, prompts).items():
        print(f"{relation:<18}{row['n']:>4}  {row['b_right_of_a']:>17.2f}  {row['b_below_a']:>14.2f}")
    print(f"\n{'single object':<18}{'n':>4}  {'in left half':>17}  {'in top half':>14}")
    for position, row in probe.position_placement(pipe).items():
        print(f"{position:<18}{row['n']:>4}  {row['left_half']:>17.2f}  {row['top_half']:>14.2f}")
    mass = probe.position_mass(pipe)
    print(
        "x0 mass in the named half from noise at sigma 0.98 (0.5: the word is ignored): "
        + ", ".join(f"{p} {v:.2f}" for p, v in mass.items())
    )
    moved = probe.sensitivity(pipe, prompts)
    print(
        f"output change (sigma 0.8): relation word left -> right {moved['relation_word']:.5f}, "
        f"first colour {moved['first_colour']:.5f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

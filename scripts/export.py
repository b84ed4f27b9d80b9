#!/usr/bin/env python
"""Export a checkpoint's weights for use outside diffrl: a diffusers LoRA folder, or with
``--merge`` the transformer with the LoRA merged into it.

    python scripts/export.py outputs/toy_flowgrpo/checkpoints/step-100 --out exported
    python scripts/export.py RUN/checkpoints/step-500 --out exported --weights raw
    python scripts/export.py RUN/checkpoints/step-500 --out merged --merge

``--weights evaluated`` (the default) takes what the run's evaluations scored: the EMA
weights when ``train.ema_decay`` > 0, else the trained ones; ``raw`` the trained ones.
A LoRA folder loads with ``pipe.load_lora_weights(folder)``; a merged one holds
``transformer/`` (``from_pretrained``). A run with PromptRL's refiner also exports it to
``refiner/`` (a PEFT adapter over ``refiner.model``, or the whole LM, with its tokenizer:
``PeftModel.from_pretrained`` / ``AutoModelForCausalLM.from_pretrained``), since the
flow model was trained to render its rewrites. ``export.json`` beside them says which
weights they are and from which checkpoint.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


def chosen_folder(checkpoint: Path, weights: str) -> Path:
    """The checkpoint folder holding the diffusers export of ``weights``."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    note = meta.get("weights", {"export": "trained"})
    if weights == "raw" and "raw/" in note:
        return checkpoint / "raw"
    return checkpoint  # the export is the evaluated weights, which are the raw ones without an EMA


def export(checkpoint: Path, out: Path, weights: str = "evaluated", merge: bool = False) -> Path:
    from diffrl.inference.checkpoints import (
        CheckpointError,
        checkpoint_problem,
        find_checkpoint,
        open_to_the_umask,
    )

    checkpoint = find_checkpoint(checkpoint)  # a run directory means its newest complete checkpoint
    problem = checkpoint_problem(checkpoint)
    if problem:
        raise CheckpointError(f"cannot export {checkpoint}: {problem}")
    folder = chosen_folder(checkpoint, weights)
    out.mkdir(parents=True, exist_ok=True)
    if merge:
        _merge(checkpoint, folder, out)
    elif (folder / "pytorch_lora_weights.safetensors").is_file():
        shutil.copy2(folder / "pytorch_lora_weights.safetensors", out / "pytorch_lora_weights.safetensors")
    else:
        shutil.copytree(folder / "transformer", out / "transformer", dirs_exist_ok=True)
    if (checkpoint / "refiner").is_dir():  # PromptRL: the flow model renders the refiner's rewrites
        shutil.copytree(checkpoint / "refiner", out / "refiner", dirs_exist_ok=True)
    meta = json.loads((checkpoint / "meta.json").read_text())
    note = {"checkpoint": str(checkpoint), "step": meta["step"], "weights": weights, "merged": merge}
    note["holds"] = meta.get("weights", {}).get("raw/" if folder != checkpoint else "export", "trained")
    (out / "export.json").write_text(json.dumps(note, indent=1) + "\n")
    open_to_the_umask(out)  # copy2 keeps safetensors' 0600
    return out


def _merge(checkpoint: Path, folder: Path, out: Path) -> None:
    """The config's base model with the LoRA loaded and fused, saved whole."""
    from diffrl.config import load_config
    from diffrl.models import build_adapter

    cfg = load_config(str(checkpoint / "config.yaml"))
    adapter = build_adapter(cfg.model)
    adapter.pipe.load_lora_weights(str(folder))
    loadable = getattr(adapter.pipe, "_lora_loadable_modules", ["transformer"])
    adapter.pipe.fuse_lora(components=[c for c in ("transformer", "transformer_2") if c in loadable])
    adapter.pipe.unload_lora_weights()  # the fused weights stay; the LoRA layers go
    adapter.transformer.save_pretrained(out / "transformer")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "checkpoint",
        type=Path,
        help="a run's checkpoints/step-N folder, or a run directory (its newest complete checkpoint)",
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--weights", choices=("evaluated", "raw"), default="evaluated")
    p.add_argument("--merge", action="store_true", help="write the transformer with the LoRA merged in")
    a = p.parse_args(argv)
    out = export(a.checkpoint, a.out, a.weights, a.merge)
    step = json.loads((out / "export.json").read_text())["checkpoint"]
    print(f"exported {a.weights} weights of {step} to {out}")
    return 0


if __name__ == "__main__":
    from diffrl.cli import run_cli

    run_cli(main)

"""What a run says on the console while it runs: each evaluation's headline figures, a
readable progress-bar postfix, and at the end where everything is."""

from __future__ import annotations

import math
from pathlib import Path

from tqdm import tqdm


def say(accelerator, message: str) -> None:
    """Print on the main process without tearing the progress bar."""
    if accelerator.is_main_process:
        tqdm.write(message)


def _value(metrics: dict, key: str) -> float | None:
    v = metrics.get(key)
    v = float(v) if v is not None else None
    return v if v is not None and math.isfinite(v) else None


def eval_line(step: int, metrics: dict, headlines: tuple[str, ...]) -> str:
    """'eval @ 25: held-out shapeworld_strict 0.383 ± 0.020 (n 656) | training 0.406 | ...'."""
    key = next((h for h in headlines if _value(metrics, h) is not None), None)
    parts = []
    if key is not None:
        name = key.split("/")[1]
        se = _value(metrics, key.replace("/mean", "/se"))
        n = _value(metrics, "eval/n")
        held = f"held-out {name} {metrics[key]:.3f}" + (f" ± {se:.3f}" if se is not None else "")
        parts.append(held + (f" (n {int(n)})" if n is not None else ""))
        train = _value(metrics, key.replace("eval/", "eval_train/", 1))
        if train is not None:
            parts.append(f"training {train:.3f}")
    diversity = _value(metrics, "eval/diversity")
    if diversity is not None:
        parts.append(f"diversity {diversity:.3f}")
    darkness = _value(metrics, "eval/fidelity/background_darkness/mean")
    if darkness is not None:
        parts.append(f"background darkness {darkness:.4f}")
    return f"eval @ {step}: " + " | ".join(parts)


def progress_fields(metrics: dict) -> dict[str, str]:
    """Progress-bar postfix a person can read: the mean reward, the policy's KL to the
    rollout policy and the share of clipped ratios (the raw policy loss is ~1e-6 and says
    little)."""
    fields = {}
    for label, key, fmt in (
        ("reward", "reward/mean", ".4g"),
        ("kl", "approx_kl", ".2e"),
        ("clipped", "clipfrac", ".0%"),
    ):
        v = _value(metrics, key)
        if v is not None:
            fields[label] = format(v, fmt)
    return fields


def closing_lines(run_dir: Path, last_checkpoint: Path | None, ema_decay: float = 0.0) -> str:
    """Where the run's outputs are, the commands that show them, and which weights the
    evaluations scored and the checkpoint exports."""
    run_dir = Path(run_dir)
    lines = [f"metrics:     {run_dir / 'metrics.jsonl'}"]
    if any((run_dir / "samples").glob("step-*.png")):  # only where an evaluation wrote sheets
        sheets = f"{run_dir / 'samples'}/step-N.png"
        lines.append(f"samples:     {sheets} (the fixed evaluation prompts and noise)")
    if (run_dir / "logs").is_dir():
        lines.append(f"tensorboard: tensorboard --logdir {run_dir / 'logs'}")
    lines.append(f"checkpoint:  {last_checkpoint}" if last_checkpoint else "checkpoint:  none saved")
    if ema_decay > 0:
        lines.append(
            f"weights:     the evaluations scored the EMA weights (train.ema_decay {ema_decay}); each "
            "checkpoint's diffusers export holds them, raw/ the trained ones"
        )
    else:
        lines.append("weights:     the evaluations scored the trained weights, which each checkpoint exports")
    from diffrl.data.prompts import PROJECT_ROOT

    script = PROJECT_ROOT / "scripts" / "report.py"  # absolute: the run may start from any directory
    lines.append(
        f"report:      python {script} {run_dir} --out {run_dir / 'report'}"
        f"  (writes {run_dir / 'report' / 'report.png'} and summary.md)"
    )
    return "\n".join(lines)

"""The golden runs and how their values are read (used by the test and by regenerate)."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
# one run per training mode: flow-GRPO on independent rollouts, a BranchGRPO tree, a
# Sol-RL pool (NVFP4 reference quantizer, BF16 regeneration) and DiffusionNFT
RUNS = {
    "flow_grpo": ("tiny_flux_flowgrpo", []),
    "tree": ("tiny_flux_branchgrpo", []),
    "solrl": ("tiny_flux_solrl", []),
    "nft": ("tiny_sd3_flowgrpo", ["objective.name=nft"]),
}
STEPS = 2
THREADS = 2
METRICS = ("loss", "policy_loss", "reward/mean", "kl", "approx_kl", "grad_norm")


def machine() -> str:
    """The CPU the float results depend on: torch's kernel dispatch level, the processor's
    vendor, family, model and stepping, and a digest of its feature flags (the same torch
    build gives other last bits on another CPU; a VM's model name alone, "AMD EPYC", does
    not tell them apart)."""
    fields: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().split("\n\n")[0].splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    flags = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:8]
    ident = " ".join(fields.get(k, "?") for k in ("vendor_id", "cpu family", "model", "stepping"))
    return f"{torch.backends.cpu.get_cpu_capability()} {ident} flags {flags}"


def run(name: str) -> dict:
    """Train ``name``'s config for 2 iterations at seed 0 and return its golden record."""
    from diffrl.config import load_config
    from diffrl.training.trainer import Trainer

    config, overrides = RUNS[name]
    out = Path(tempfile.mkdtemp(prefix=f"golden-{name}-"))
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)  # GEMM blocking, and so the last bits, depend on it
    try:
        cfg = load_config(
            config,
            [
                f"output_dir={out}",
                f"train.max_steps={STEPS}",
                "eval.every=0",
                "checkpoint.every=0",
                "logging.progress_bar=false",
                "logging.trackers=[]",
                "seed=0",
                *overrides,
            ],
        )
        trainer = Trainer(cfg)
        history = trainer.fit()
        weights = hashlib.sha256()
        for p in trainer.policy.trainable_parameters():
            weights.update(p.detach().float().cpu().numpy().tobytes())
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(out, ignore_errors=True)
    steps = [{k: float(h[k]) for k in METRICS if k in h} for h in history]
    return {
        "config": config,
        "overrides": overrides,
        "torch": torch.__version__,
        "cpu": machine(),
        "threads": THREADS,
        "steps": steps,
        "weights_sha256": weights.hexdigest(),
    }

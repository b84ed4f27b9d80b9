"""Sol-RL exploration throughput: a FLUX-size transformer (random weights; speed does not
depend on them) run as the BF16 policy and as low-precision exploration copies, side by
side in one run, plus the time and peak memory of each Sol-RL stage's unit of work.

Rows: one transformer forward over a batch of pool candidates (explore), the same in
the BF16 policy (regenerate), and one LoRA forward + backward (update). The ratio column
is BF16 time / row time, measured in the same process, alternating modes per repeat.

    python scripts/bench_explore.py                              # FLUX.1-dev shape, 1024^2, GPU
    python scripts/bench_explore.py --modes bf16,fp8:torchao,nvfp4:auto --batch 4
    python scripts/bench_explore.py --tiny --device cpu          # smoke run of the code path
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
TINY = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 6, 6))


def build_transformer(tiny: bool, device, dtype):
    from diffusers import FluxTransformer2DModel

    with torch.device(device):
        model = FluxTransformer2DModel(**(TINY if tiny else FLUX_DEV))
    return model.to(dtype).eval().requires_grad_(False)


def make_inputs(cfg: dict, batch: int, resolution: int, text_tokens: int, device, dtype) -> dict:
    side = resolution // 16  # 8x VAE downsampling, then 2x2 packing
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    axis = torch.arange(side, dtype=torch.float32)
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), axis, axis, indexing="ij"), -1)
    return dict(hidden_states=randn(batch, side * side, cfg["in_channels"]),
                encoder_hidden_states=randn(batch, text_tokens, cfg["joint_attention_dim"]),
                pooled_projections=randn(batch, cfg["pooled_projection_dim"]),
                timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),
                guidance=torch.full((batch,), 3.5, device=device, dtype=dtype),
                img_ids=img_ids.reshape(-1, 3).to(device), txt_ids=torch.zeros(text_tokens, 3, device=device),
                return_dict=False)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> tuple[float, float]:
    """(seconds, peak GiB allocated during the call; 0 on CPU)."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return time.perf_counter() - t0, peak


def build_modes(policy, names: list[str], log) -> dict:
    """name -> nn.Module to call: 'bf16' is the policy; 'precision:backend' is a copy."""
    from diffrl.quant.backends import build_exploration_copy

    modes = {}
    for name in names:
        if name == "bf16":
            modes[name] = policy
            continue
        precision, _, backend = name.partition(":")
        modes[name] = build_exploration_copy(policy, "flux", precision, backend or "auto", log=log).model
    return modes


def lora_update_fn(policy, inputs):
    """One LoRA forward + backward, the update stage's unit of work."""
    from peft import LoraConfig

    policy.add_adapter(LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian",
                                  target_modules=["to_q", "to_k", "to_v", "to_out.0"]))

    def run():
        with torch.enable_grad():
            out = policy(**inputs)[0]
            out.float().pow(2).mean().backward()
        for p in policy.parameters():
            p.grad = None

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="bf16,fp8:auto,nvfp4:auto", help="comma list: bf16 or precision:backend")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="the tiny twin's shape at 64^2 (a smoke run, not a benchmark)")
    ap.add_argument("--no-update", action="store_true", help="skip the LoRA forward + backward row")
    args = ap.parse_args(argv)
    if args.tiny:
        args.resolution, args.text_tokens = min(args.resolution, 64), min(args.text_tokens, 16)
    dtype = torch.bfloat16
    policy = build_transformer(args.tiny, args.device, dtype)
    cfg = TINY if args.tiny else FLUX_DEV
    inputs = make_inputs(cfg, args.batch, args.resolution, args.text_tokens, args.device, dtype)
    modes = build_modes(policy, args.modes.split(","), log=print)
    fns = {name: (lambda m=m: m(**inputs)) for name, m in modes.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    peaks: dict[str, float] = {}
    with torch.no_grad():
        for r in range(args.repeats + 1):  # the first round warms up (and compiles) and is dropped
            for name, fn in fns.items():
                t, peak = timed(fn, args.device)
                if r:
                    times[name].append(t)
                    peaks[name] = max(peaks.get(name, 0.0), peak)
    if not args.no_update:
        update = lora_update_fn(policy, inputs)
        times["update (bf16 LoRA fwd+bwd)"] = []
        for r in range(args.repeats + 1):
            t, peak = timed(update, args.device)
            if r:
                times["update (bf16 LoRA fwd+bwd)"].append(t)
                peaks["update (bf16 LoRA fwd+bwd)"] = max(peaks.get("update (bf16 LoRA fwd+bwd)", 0.0), peak)
    print(format_table(times, peaks, args))


def format_table(times, peaks, args) -> str:
    name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu"
    base = statistics.median(times["bf16"]) if "bf16" in times else None
    lines = [f"device: {name}; batch {args.batch} at {args.resolution}^2, {args.text_tokens} text tokens; "
             f"median of {args.repeats}", "",
             "| mode | ms per forward | images/s | speed vs bf16 | peak GiB |", "|---|---|---|---|---|"]
    for mode, ts in times.items():
        med = statistics.median(ts)
        ratio = f"{base / med:.2f}x" if base else "-"
        lines.append(f"| {mode} | {med * 1e3:.1f} | {args.batch / med:.2f} | {ratio} | {peaks.get(mode, 0.0):.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

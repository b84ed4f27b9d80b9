"""Peak dense throughput of common accelerators, the denominator of MFU.

Figures are the vendors' dense (no sparsity) tensor-core peaks per GPU. An unknown GPU
or a CPU has no entry: callers measure an achieved GEMM peak instead (:func:`gemm_peak`)
and say which denominator they used.
"""

from __future__ import annotations

import time

import torch

# substring of torch.cuda.get_device_name() -> dense bf16/fp16 tensor FLOP/s; checked in
# order, so the more specific names (NVL, PCIe, GB200) come before the names they contain
PEAKS = {
    "H200 NVL": 835.5e12,
    "H200": 989.4e12,  # SXM
    "H100 NVL": 835.5e12,
    "H100 PCIe": 756.0e12,
    "H100": 989.4e12,  # SXM
    "GB200": 2500e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362.1e12,
}


def spec_peak(device_name: str, dtype: str = "bfloat16") -> float | None:
    """The spec-sheet dense peak for ``device_name`` in bf16/fp16 (first matching key);
    None for other dtypes (fp32 runs on different units) and unlisted devices."""
    if dtype not in ("bfloat16", "float16"):
        return None
    return next((peak for key, peak in PEAKS.items() if key in device_name), None)


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def gemm_peak(device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Achieved FLOP/s of a square matmul: the practical ceiling on this device and dtype."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - t0)

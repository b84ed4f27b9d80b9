"""Peak dense throughput of common accelerators, the denominator of MFU.

Figures are the vendors' dense (no sparsity) tensor-core peaks per GPU. An unknown GPU
or a CPU has no entry: callers measure an achieved GEMM peak instead (:func:`gemm_peak`)
and say which denominator they used.
"""

from __future__ import annotations

import time

import torch

# substring of torch.cuda.get_device_name() -> {dtype name: FLOP/s}
PEAKS = {
    "H200": {"bfloat16": 989.4e12, "float8": 1978.9e12},
    "H100 PCIe": {"bfloat16": 756.0e12, "float8": 1513.0e12},
    "H100": {"bfloat16": 989.4e12, "float8": 1978.9e12},  # SXM
    "B200": {"bfloat16": 2250e12, "float8": 4500e12},
    "A100": {"bfloat16": 312e12},
    "L40S": {"bfloat16": 362.1e12, "float8": 733e12},
}


def spec_peak(device_name: str, dtype: str = "bfloat16") -> float | None:
    """The spec-sheet peak for ``device_name`` (first matching key, most specific first)."""
    for key, peaks in PEAKS.items():
        if key in device_name:
            return peaks.get(dtype)
    return None


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

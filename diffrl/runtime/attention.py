"""``perf.attention_backend``: the diffusers attention backend a run's transformer uses."""

from __future__ import annotations

import torch

from diffrl.schema import ConfigError


def apply_attention_backend(transformer: torch.nn.Module, name: str | None) -> None:
    """Switch a diffusers transformer's attention to backend ``name`` (None: leave as is).
    diffusers also makes ``name`` the process-wide active backend: a run uses one backend."""
    if name is None:
        return
    if "hub" in name:
        raise ConfigError(
            f"perf.attention_backend '{name}' downloads kernels at run time; this toolkit never "
            "downloads: use flash, _flash_3, _native_flash, _native_cudnn, xformers or sage"
        )
    setter = getattr(transformer, "set_attention_backend", None)
    if setter is None:
        raise ConfigError(
            f"perf.attention_backend: {type(transformer).__name__} is not a diffusers model with "
            "switchable attention; set perf.attention_backend: null"
        )
    try:
        setter(name)
    except (ValueError, RuntimeError, ImportError) as err:
        raise ConfigError(f"perf.attention_backend '{name}': {err}") from None

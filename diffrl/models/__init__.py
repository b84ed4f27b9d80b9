"""Model adapters by family name.

Family modules are imported lazily so that ``import diffrl`` stays cheap and never
touches diffusers' heavier pipeline code (or the network) until a run builds a model.
"""

from __future__ import annotations

from diffrl.models.base import Conditioning, FlowAdapter, ModelLoadError
from rewards.registry import Registry

# family name -> "module:Class", imported on first use
FAMILIES = Registry(
    "model family",
    {
        "flux": "diffrl.models.flux:FluxAdapter",
        "sd3": "diffrl.models.sd3:SD3Adapter",
        "sana": "diffrl.models.sana:SanaAdapter",
        "wan": "diffrl.models.wan:WanAdapter",
        "wan22": "diffrl.models.wan22:Wan22Adapter",
        "qwenimage": "diffrl.models.qwenimage:QwenImageAdapter",
        "qwenimage_edit": "diffrl.models.qwenimage_edit:QwenImageEditAdapter",
        "flux2": "diffrl.models.flux2:Flux2Adapter",
        "flux_kontext": "diffrl.models.flux_kontext:FluxKontextAdapter",
        "toy": "diffrl.models.toy:ToyAdapter",
        "toy_video": "diffrl.models.toy_video:ToyVideoAdapter",
    },
    plural="model families",
)


def register(family: str, target: str) -> None:
    """Register an adapter class as ``"package.module:ClassName"`` (imported on first use)."""
    FAMILIES.register(family, target)


def available() -> list[str]:
    return FAMILIES.available()


def adapter_class(family: str) -> type[FlowAdapter]:
    return FAMILIES.get(family)


def build_adapter(model_cfg, device=None) -> FlowAdapter:
    """Build the adapter for ``model_cfg.family``: the tiny offline twin when
    ``model_cfg.pretrained == "tiny"``, a published architecture with random weights for
    ``random:<arch>`` (built on ``device``: the GPU if there is one; ``"meta"`` allocates
    nothing), else the real pipeline from a hub id or local path."""
    cls = adapter_class(model_cfg.family)
    if model_cfg.pretrained == "tiny":
        return cls.build_tiny(model_cfg)
    if model_cfg.pretrained.startswith("random:"):
        from diffrl.models.arch import build_random_adapter

        return build_random_adapter(cls, model_cfg, device)
    return cls.from_pretrained(model_cfg)


__all__ = [
    "Conditioning",
    "FlowAdapter",
    "ModelLoadError",
    "available",
    "adapter_class",
    "build_adapter",
    "register",
]

"""Full-size architectures with random weights, built from published configs kept in-repo.

``model.pretrained: random:<arch>`` (for example ``random:flux1-dev``) builds the
family's pipeline with the *published* transformer and VAE (``assets/arch/<arch>.json``,
copied from the model's diffusers ``config.json`` files) and random weights, so speed
and memory can be measured at real size with nothing downloaded. Speed does not depend
on the weights' values.

The text encoders are the tiny twin's, widened only where their output enters the
transformer (CLIP/T5/Gemma hidden width). Prompts are encoded once per distinct prompt
and cached (``FlowAdapter.encode_prompts``), so the real encoders cost little time once
the prompt set has been seen, but they stay resident: their memory
(``text_encoders_published_params``) is missing from a random-weight run and added by
:mod:`diffrl.perf.estimate`. ``published_params`` in the JSON lets tests check
that the built transformer matches the model card.

Modules are built on the meta device and materialised straight onto the target device
in the target dtype, so FLUX.1-dev (11.9B) never sits in host memory in fp32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffrl.models.base import ModelLoadError

ARCH_DIR = Path(__file__).resolve().parents[2] / "assets" / "arch"
RANDOM_PREFIX = "random:"


@dataclass(frozen=True)
class Arch:
    """One published architecture: the diffusers classes and their config kwargs."""

    name: str
    family: str
    transformer_class: str
    transformer: dict
    vae_class: str
    vae: dict
    text_overrides: dict = field(default_factory=dict)  # component -> config fields
    published_params: float = 0.0
    text_encoder_params: float = 0.0  # the real text encoders' size (memory estimates)
    hub_ids: tuple[str, ...] = ()
    source: str = ""
    experts: int = 1  # Wan2.2 A14B: a second transformer of the same config (transformer_2)

    def build_transformer(self) -> torch.nn.Module:
        """The transformer with parameters on the meta device (see :func:`materialize`)."""
        import diffusers

        with _empty_parameters():
            return getattr(diffusers, self.transformer_class).from_config(self.transformer)

    def build_vae(self) -> torch.nn.Module:
        import diffusers

        with _empty_parameters():
            return getattr(diffusers, self.vae_class).from_config(self.vae)


def _empty_parameters():
    """Parameters on meta, buffers (rope tables, sin-cos position grids) computed for real:
    they are small and must hold their true values."""
    from accelerate import init_empty_weights

    return init_empty_weights(include_buffers=False)


def available_archs() -> list[str]:
    return sorted(p.stem for p in ARCH_DIR.glob("*.json"))


def load_arch(name: str) -> Arch:
    path = ARCH_DIR / f"{name}.json"
    if not path.is_file():
        raise ModelLoadError(
            f"unknown architecture '{name}' in 'random:{name}'; "
            f"shipped architectures: {', '.join(available_archs())}"
        )
    raw = json.loads(path.read_text())
    return Arch(
        name=raw["name"],
        family=raw["family"],
        transformer_class=raw["transformer_class"],
        transformer=raw["transformer"],
        vae_class=raw["vae_class"],
        vae=raw["vae"],
        text_overrides=raw.get("text_overrides", {}),
        published_params=raw.get("published_params", 0.0),
        text_encoder_params=raw.get("text_encoders_published_params", 0.0),
        hub_ids=tuple(raw.get("hub_ids", ())),
        source=raw.get("source", ""),
        experts=raw.get("experts", 1),
    )


def arch_for(pretrained: str) -> Arch | None:
    """The architecture a ``model.pretrained`` value names: ``random:<arch>``, or a hub id
    listed in an arch file (so a real config can be sized without its weights)."""
    if pretrained.startswith(RANDOM_PREFIX):
        return load_arch(pretrained[len(RANDOM_PREFIX) :])
    for name in available_archs():
        arch = load_arch(name)
        if pretrained in arch.hub_ids:
            return arch
    return None


def family_hub_ids(family: str) -> list[str]:
    """The published checkpoints of ``family`` that the shipped architectures list (the
    hub ids a missing local folder can be downloaded from), in file order."""
    archs = [load_arch(name) for name in available_archs()]
    return [hub_id for arch in archs if arch.family == family for hub_id in arch.hub_ids]


def _widened(encoder: torch.nn.Module, overrides: dict) -> torch.nn.Module:
    """The same text-encoder class with some config fields replaced (built on meta)."""
    config = type(encoder.config)(**{**encoder.config.to_dict(), **overrides})
    with _empty_parameters():
        return type(encoder)(config)


@torch.no_grad()
def materialize(module: torch.nn.Module, device, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Allocate a module's meta parameters on ``device`` and give them a random init.

    Parameters take ``dtype``, except in the modules a class lists in
    ``_keep_in_fp32_modules`` (Wan's time embedder and norms, T5's ``wo``), which stay fp32
    as ``from_pretrained(torch_dtype=...)`` keeps them. Buffers keep their computed values
    and move to ``device``. Modules with
    ``reset_parameters`` (linear, conv, norm, embedding) use torch's default init on the
    device; the remaining parameters (custom norms' scales, learned embeddings) get ones
    for 1-d ``weight``/``scale``, zeros for biases and N(0, 0.02) otherwise, so
    activations stay finite through a full-depth forward.
    """
    device = torch.device(device)
    keep_fp32 = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())  # as from_pretrained does
    for sub_name, sub in module.named_modules():
        for name, p in list(sub._parameters.items()):
            parts = f"{sub_name}.{name}".split(".")  # diffusers matches any part of the parameter name
            want = torch.float32 if any(k in parts for k in keep_fp32) else dtype
            if p is not None and (p.device != device or p.dtype != want):
                sub._parameters[name] = torch.nn.Parameter(
                    torch.empty_like(p, device=device, dtype=want), requires_grad=p.requires_grad
                )
        for name, b in list(sub._buffers.items()):  # computed values, kept in their dtype
            if b is not None:
                sub._buffers[name] = b.to(device)
    if device.type == "meta":
        return module
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        covered = set()
        for sub in module.modules():
            if callable(getattr(sub, "reset_parameters", None)):
                sub.reset_parameters()
                covered.update(id(p) for p in sub.parameters(recurse=False))
        for name, p in module.named_parameters():
            if id(p) not in covered:
                _init_leftover(name.rsplit(".", 1)[-1], p)
    return module


def _init_leftover(leaf: str, p: torch.nn.Parameter) -> None:
    if leaf == "bias":
        p.zero_()
    elif p.ndim == 1 and leaf in ("weight", "scale", "gamma"):
        p.fill_(1.0)
    else:
        p.normal_(0.0, 0.02)


def build_random_pipeline(
    twin_pipe, arch: Arch, device, dtype: torch.dtype, seed: int = 0, text_only: bool = False
):
    """``twin_pipe``'s class and tokenizers with the full-size transformer and VAE of ``arch``
    (random weights, on ``device``) and text encoders widened to the published widths.
    ``text_only`` keeps the twin's transformer and VAE (a prompt encoder)."""
    comps = dict(twin_pipe.components)
    if not text_only:
        comps["transformer"] = materialize(arch.build_transformer(), device, dtype, seed)
        comps["vae"] = materialize(arch.build_vae(), device, dtype, seed + 1)
        if arch.experts == 2:
            comps["transformer_2"] = materialize(
                arch.build_transformer(), device, dtype, seed + 2 + len(arch.text_overrides)
            )
    for i, (name, overrides) in enumerate(sorted(arch.text_overrides.items())):
        comps[name] = materialize(_widened(comps[name], overrides), device, dtype, seed + 2 + i)
    return type(twin_pipe)(**comps, **_pipeline_settings(twin_pipe, comps))


def _pipeline_settings(pipe, comps: dict) -> dict:
    """The pipeline's non-component ``__init__`` arguments (Wan2.2's ``boundary_ratio``),
    which ``components`` leaves out."""
    import inspect

    accepted = inspect.signature(type(pipe).__init__).parameters
    return {k: v for k, v in pipe.config.items() if k in accepted and k not in comps}


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_random_adapter(cls, model_cfg, device=None):
    """``cls`` (a FlowAdapter) over :func:`build_random_pipeline` for ``model_cfg.pretrained``.

    On the meta device (FLOP counts and shapes without allocating), prompts are encoded on
    the CPU by the same widened text encoders, then moved to meta: transformers' masking
    code reads tensor values, which meta tensors do not have.
    """
    from diffrl.models.loading import finalize_pipeline, torch_dtype

    arch = load_arch(model_cfg.pretrained[len(RANDOM_PREFIX) :])
    if arch.family != cls.family:
        raise ModelLoadError(
            f"architecture '{arch.name}' is a {arch.family} model, but model.family is "
            f"'{cls.family}'; set model.family: {arch.family}"
        )
    device = torch.device(device) if device is not None else default_device()
    dtype, seed = torch_dtype(model_cfg.dtype), model_cfg.tiny_seed
    twin = cls.build_tiny(model_cfg)
    adapter = cls(
        finalize_pipeline(
            build_random_pipeline(twin.pipe, arch, device, dtype, seed), model_cfg, device=device
        ),
        model_cfg,
    )
    if device.type == "meta":
        text_pipe = build_random_pipeline(twin.pipe, arch, "cpu", dtype, seed, text_only=True)
        encoder = cls(finalize_pipeline(text_pipe, model_cfg), model_cfg)
        # editing families run their prompt encoder (the text, and for Qwen-Image-Edit the
        # image through its VL encoder) on the CPU; the image latents go through the
        # full-size VAE on meta, which gives the real image-token count
        name = "_encode_text" if cls.edits_images else "_encode_uncached"
        setattr(adapter, name, lambda prompts: getattr(encoder, name)(prompts).to("meta"))
    return adapter

"""Loading real pipelines, and the plumbing every diffusers-backed adapter shares.

``load_pipeline`` turns every way a ``from_pretrained`` can fail (missing path, no
network, gated repo, missing files, wrong pipeline class) into one
:class:`ModelLoadError` that names the model and says how to point ``model.pretrained``
at a local diffusers directory. Nothing here touches the network at import time.

``PipelineAdapter`` holds what the four families (flux, sd3, sana, wan) have in common:
freezing the pipeline and classifier-free guidance as one batched forward. LoRA saving
(``FlowAdapter.save_lora``) lives in the base class. ``scheduler_sigmas`` is the schedule of
the families whose pipelines sample with DPM-Solver/UniPC over flow sigmas (sana, wan).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from diffrl.models.base import Conditioning, FlowAdapter, ModelLoadError, unwrap  # noqa: F401 (re-export)
from rewards.errors import one_line

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """Map a config dtype name (``float32``, ``bfloat16``, ``float16``) to a torch dtype."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype '{name}'; valid: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _looks_like_path(name: str) -> bool:
    """A hub id is ``org/name``; anything absolute, relative-dotted, ``~`` or deeper is a path."""
    return (
        os.path.isabs(name)
        or name.startswith((".", "~"))
        or "\\" in name
        or name.count("/") > 1
        or os.path.exists(name)
    )


def _fix_hint(name: str) -> str:
    hub_id = name if not _looks_like_path(name) else "<hub-id>"
    return (
        "To use weights stored locally, download them once on a machine with access "
        f"(`hf download {hub_id} --local-dir DIR`; gated models such as FLUX.1-dev "
        "also need `hf auth login` and the licence accepted on the hub) and set "
        "`model.pretrained: DIR`, a local path to a diffusers directory containing model_index.json."
    )


def _check_local(name: str) -> None:
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path '{name}' does not exist. {_fix_hint(name)}")
    if not path.is_dir() or not (path / "model_index.json").is_file():
        raise ModelLoadError(
            f"model path '{name}' is not a diffusers pipeline directory (no model_index.json). "
            f"{_fix_hint(name)}"
        )


def load_pipeline(pipeline_class, model_cfg, **component_overrides):
    """``pipeline_class.from_pretrained(model_cfg.pretrained, ...)`` with one clear error.

    ``component_overrides`` are passed through (e.g. a transformer loaded separately).
    Every failure is re-raised as :class:`ModelLoadError` chained to the original, so a
    run fails at start-up with the model name and the fix instead of a hub stack trace.
    """
    name = str(model_cfg.pretrained)
    if _looks_like_path(name):
        _check_local(name)
        name = str(Path(name).expanduser())
    try:
        return pipeline_class.from_pretrained(
            name,
            revision=model_cfg.revision,
            **_dtype_kwarg(torch_dtype(model_cfg.dtype)),
            **component_overrides,
        )
    except Exception as err:  # any failure (hub, files, config) becomes one actionable error
        rev = f" (revision {model_cfg.revision})" if model_cfg.revision else ""
        offline = " HF_HUB_OFFLINE is set, so nothing can be downloaded." if _offline() else ""
        raise ModelLoadError(
            f"could not load {pipeline_class.__name__} from '{model_cfg.pretrained}'{rev}: "
            f"{one_line(err)}.{offline} {_fix_hint(name)}"
        ) from err


def _dtype_kwarg(dtype: torch.dtype) -> dict:
    """Recent diffusers renamed ``torch_dtype`` to ``dtype`` (the old name warns); older ones
    only know ``torch_dtype``."""
    try:
        from diffusers.utils.deprecation_utils import _resolve_dtype  # noqa: F401
    except ImportError:
        return {"torch_dtype": dtype}
    return {"dtype": dtype}


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def finalize_pipeline(pipe, model_cfg, cast: bool = True, device="cpu"):
    """On ``device`` (CPU unless built elsewhere), configured dtype, eval mode, no grads:
    the trainer moves it and adds LoRA later.

    ``cast=False`` for loaded pipelines: ``torch_dtype`` already applied the dtype and
    kept the modules that must stay fp32 (``_keep_in_fp32_modules``) in fp32.
    """
    dtype = torch_dtype(model_cfg.dtype)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.to(device)
            if cast and module_dtype(module) != dtype:  # skip no-op casts: diffusers warns on each
                module.to(dtype)
            module.requires_grad_(False)
            module.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """Dtype the frozen weights run in (LoRA weights may be fp32 on a bf16 base)."""
    bare = unwrap(module)
    dtype = getattr(bare, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(p.dtype for p in bare.parameters() if p.is_floating_point())


def scheduler_sigmas(scheduler, num_steps: int) -> torch.Tensor:
    """The pipeline scheduler's own sigma grid for ``num_steps`` (N + 1 values, fp32),
    from a fresh copy so the pipeline's scheduler keeps its state. DPM-Solver and UniPC
    build different grids from ``flow_shift`` (DPM-Solver: shift(1 - linspace(1, 1/T,
    N + 1)) flipped, first value 0.9997 at shift 3; UniPC: shift(linspace(1, 1/T, N + 1)[:-1])
    with 1 - 1e-6 first); reading it from the scheduler matches either exactly. A grid that
    does not end at 0 (``final_sigmas_type: sigma_min``) is ended at 0 so that rollouts
    return clean samples."""
    fresh = type(scheduler).from_config(scheduler.config)
    fresh.set_timesteps(num_steps)
    sigmas = fresh.sigmas.detach().to("cpu", torch.float32).clone()
    sigmas[-1] = 0.0
    return sigmas


class PipelineAdapter(FlowAdapter):
    """FlowAdapter over a diffusers pipeline; families set ``pipeline_class`` and ``cond_keys``.

    ``cond_keys`` names the conditioning tensors the transformer needs; with CFG on, the
    same names prefixed by ``negative_`` hold the empty-prompt embeddings.
    """

    pipeline_class: type = None
    cond_keys: tuple[str, ...] = ("prompt_embeds",)

    @classmethod
    def from_pretrained(cls, model_cfg) -> PipelineAdapter:
        """Real weights from a hub id or a local diffusers directory (see :func:`load_pipeline`)."""
        pipe = load_pipeline(cls.pipeline_class, model_cfg)
        return cls(finalize_pipeline(pipe, model_cfg, cast=False), model_cfg)

    @property
    def do_cfg(self) -> bool:
        return self.cfg.guidance_scale > 1.0

    def _forward(self, transformer, latents, sigma, emb: dict[str, torch.Tensor]) -> torch.Tensor:
        """One raw transformer call for a batch; returns the velocity in the transformer's dtype."""
        raise NotImplementedError

    def velocity(
        self,
        transformer,
        latents,
        sigma,
        cond: Conditioning,
        guidance: bool = True,
        detach_uncond: bool = False,
    ) -> torch.Tensor:
        """CFG as one batched forward over [uncond; cond], combined in fp32 as v_u + s (v_c - v_u).

        Batching both halves keeps a sample's output independent of what else is in the
        batch, which the on-policy ratio and replay tests rely on. ``detach_uncond``: v_u
        carries no gradient (its value is unchanged), as flow_grpo's ``compute_log_prob``
        (``scripts/train_sd3.py``: ``noise_pred_uncond.detach()``) trains.
        """
        pos = {k: cond.tensors[k] for k in self.cond_keys}
        has_neg = all(f"negative_{k}" in cond.tensors for k in self.cond_keys)
        if not (guidance and self.do_cfg and has_neg):
            return self._forward(transformer, latents, sigma, pos).float()
        both = {k: torch.cat([cond.tensors[f"negative_{k}"], pos[k]]) for k in self.cond_keys}
        out = self._forward(
            transformer, torch.cat([latents, latents]), torch.cat([sigma, sigma]), both
        ).float()
        v_uncond, v_cond = out.chunk(2)
        return self._combine_cfg(v_uncond.detach() if detach_uncond else v_uncond, v_cond, sigma)

    def _combine_cfg(self, v_uncond, v_cond, sigma) -> torch.Tensor:
        """The guided velocity from its two fp32 halves; families whose pipelines combine
        differently (Qwen-Image's norm rescale, Wan2.2's per-expert scale) override this."""
        return v_uncond + self.cfg.guidance_scale * (v_cond - v_uncond)

    def _encoded(self, names: tuple[str, ...], values) -> Conditioning:
        """Conditioning from the encode_prompt outputs, dropping the ones that are None."""
        return Conditioning({n: v for n, v in zip(names, values) if v is not None})


class PackedLatentAdapter(PipelineAdapter):
    """A family whose transformer reads 2x2-packed latents (FLUX.1, Kontext, FLUX.2,
    Qwen-Image): the VAE latent (C, h, w) becomes (h/2 * w/2 tokens, 4C channels), with h
    and w rounded down to even numbers as those pipelines do."""

    def _latent_hw(self) -> tuple[int, int]:
        """Unpacked latent size: the pixels over the VAE factor, rounded to a multiple of 2."""
        vsf = self.pipe.vae_scale_factor
        return 2 * (self.cfg.height // (vsf * 2)), 2 * (self.cfg.width // (vsf * 2))

    def latent_shape(self) -> tuple[int, ...]:
        h, w = self._latent_hw()
        return ((h // 2) * (w // 2), self.transformer.config.in_channels)

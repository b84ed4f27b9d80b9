"""The model section's own checks, called when a config loads (:func:`diffrl.config.validate`):
family-specific keys, full fine-tuning's precision, and the attention backends a family
that masks its text tokens can use."""

from __future__ import annotations

from diffrl.schema import ConfigError


def check_model(cfg) -> None:
    """Family-specific model keys: Wan2.2's low-noise CFG scale and its LoRA-only training,
    and the attention backends a family that masks text tokens can use."""
    _check_attention_mask_support(cfg)
    _check_refiner(cfg)
    model = cfg.model
    if model.guidance_scale_2 is not None and model.family != "wan22":
        raise ConfigError(
            f"model.guidance_scale_2 is the CFG scale of Wan2.2's low-noise expert; family "
            f"'{model.family}' has one transformer: remove it (or use model.family: wan22)"
        )
    if model.guidance_scale_2 is not None and model.guidance_scale <= 1 < model.guidance_scale_2:
        raise ConfigError(
            "model.guidance_scale_2 only applies when model.guidance_scale > 1: WanPipeline runs CFG "
            "on both experts or on neither; raise model.guidance_scale or drop guidance_scale_2"
        )
    if model.full_finetune and model.dtype != "float32" and cfg.train.mixed_precision == "no":
        raise ConfigError(
            f"model.full_finetune with model.dtype {model.dtype} needs train.mixed_precision: "
            f"{'bf16' if model.dtype == 'bfloat16' else 'fp16'}: the trained weights are kept in "
            "fp32 (an update of lr 1e-5 is below bf16's resolution) and forwards run under autocast"
        )
    if model.family == "wan22" and model.full_finetune:
        raise ConfigError(
            "model.full_finetune is not supported for wan22: two 14B experts plus their frozen "
            "reference do not fit the GPUs it would run on; train LoRA (model.full_finetune: false)"
        )


def _check_refiner(cfg) -> None:
    """PromptRL's refiner rewrites each independent sample's prompt: what it cannot pair with."""
    r = cfg.refiner
    if r.model is None:
        if not (r.train_flow and r.keep_original == 0):
            raise ConfigError(
                "refiner.train_flow and refiner.keep_original need a refiner: set refiner.model"
            )
        return
    if cfg.rollout.strategy != "independent" or cfg.solrl.enabled:
        raise ConfigError(
            "refiner.model rewrites the prompt of each independent sample; a tree (rollout.strategy: tree) "
            "shares one prompt among its leaves and Sol-RL (solrl.enabled) regenerates a subset of its pool: "
            "use rollout.strategy: independent without Sol-RL, or drop the refiner"
        )
    if r.keep_original >= cfg.rollout.group_size:
        raise ConfigError(
            f"refiner.keep_original is {r.keep_original} but rollout.group_size is {cfg.rollout.group_size}: "
            "keep fewer originals than the group has members, so some rewrites are sampled"
        )
    if not (r.train or r.train_flow):
        raise ConfigError("refiner.train and refiner.train_flow are both false: nothing would train")


def _masked_attention_unsupported(backend: str) -> bool:
    """diffusers backends that raise on an attention mask (flash-attn 2/3/4 and native flash,
    Sage, AITER, XLA; the varlen flash kernels take masks as sequence lengths)."""
    return ("flash" in backend and "varlen" not in backend) or any(
        k in backend for k in ("sage", "aiter", "xla")
    )


def _check_attention_mask_support(cfg) -> None:
    """A family whose text tokens are padded and masked (Qwen-Image) cannot run on a
    mask-less attention backend: diffusers would raise inside the first rollout."""
    backend = cfg.perf.attention_backend
    if not backend or not _masked_attention_unsupported(backend):
        return
    from diffrl.models import adapter_class

    if adapter_class(cfg.model.family).masks_text_tokens:
        raise ConfigError(
            f"perf.attention_backend '{backend}' takes no attention mask, and model family "
            f"'{cfg.model.family}' masks its padded text tokens; use _native_cudnn, flash_varlen or null"
        )

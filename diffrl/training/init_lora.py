"""``model.init_lora``: the run's LoRA starts from weights trained elsewhere.

The file (diffusers or PEFT format, or a hub id: :mod:`diffrl.evaluation.outside_lora`
finds it) is loaded into the policy's own adapter, so it trains on from there with the
run's optimizer; its shape must be the config's (``model.lora.rank``, its targets), and
its alpha, where the file records it, must be ``model.lora.alpha``: a LoRA scaled by
another alpha would silently be another model.
"""

from __future__ import annotations

import json

from diffrl.config import ConfigError

PEFT_PREFIX = "base_model.model."


def read_lora(spec: str) -> tuple[dict, dict]:
    """(state dict with the transformer's module names, the adapter config if recorded)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from diffrl.evaluation.outside_lora import local_path

    path = local_path(spec)
    folder = path if path.is_dir() else path.parent
    if (folder / "adapter_config.json").is_file():
        state = load_file(folder / "adapter_model.safetensors")
        config = json.loads((folder / "adapter_config.json").read_text())
        return {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}, config
    file = path if path.is_file() else folder / "pytorch_lora_weights.safetensors"
    if not file.is_file():
        raise ConfigError(
            f"model.init_lora '{spec}': neither a PEFT adapter (adapter_config.json) nor diffusers LoRA "
            "weights (pytorch_lora_weights.safetensors) there"
        )
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata() or {}
    # diffusers' save_lora_weights records the adapter's LoraConfig as "transformer.<field>"
    recorded = json.loads(metadata.get("lora_adapter_metadata", "{}") or "{}")
    config = {k.removeprefix("transformer."): v for k, v in recorded.items() if k.startswith("transformer.")}
    return {k.removeprefix("transformer."): v for k, v in load_file(str(file)).items()}, config


def load_init_lora(transformer, spec: str, lora_cfg, log=print) -> None:
    """Load ``spec`` into the transformer's trained adapter (``default``)."""
    from peft.utils import set_peft_model_state_dict

    state, config = read_lora(spec)
    alpha, rank = config.get("lora_alpha"), config.get("r")
    if alpha is not None and float(alpha) != float(lora_cfg.alpha):
        raise ConfigError(
            f"model.init_lora '{spec}' was trained with lora_alpha {alpha} (rank {rank}), this config's "
            f"is {lora_cfg.alpha}: set model.lora.alpha={alpha} and model.lora.rank={rank}"
        )
    result = set_peft_model_state_dict(transformer, state)
    ours = {n for n, p in transformer.named_parameters() if p.requires_grad}
    loaded = {_adapter_name(k) for k in state}
    missing = sorted(ours - loaded)
    unexpected = list(getattr(result, "unexpected_keys", []))
    if missing or unexpected:
        raise ConfigError(
            f"model.init_lora '{spec}' does not fit this config's LoRA (model.lora rank / target_modules): "
            f"{len(missing)} of its layers missing (e.g. {missing[:2]}), {len(unexpected)} unknown "
            f"(e.g. {unexpected[:2]})"
        )
    log(f"model.init_lora: the LoRA starts from {spec} ({len(state) // 2} layers)")


def _adapter_name(key: str) -> str:
    """A saved LoRA key as the trained adapter's parameter name (``lora_A.default.weight``)."""
    return key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
        ".lora_B.weight", ".lora_B.default.weight"
    )

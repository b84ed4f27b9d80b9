"""Evaluating a LoRA trained elsewhere: a local folder or file, or a hub id.

Two formats, told apart by what the folder holds:

* PEFT's (``adapter_config.json`` + ``adapter_model.safetensors``): what flow_grpo saves and
  releases (its ``train_sd3.py`` saves the PEFT-wrapped transformer, its README loads it
  with ``PeftModel.from_pretrained``); keys start ``base_model.model.``.
* diffusers' (``pytorch_lora_weights.safetensors``, keys ``transformer.<module>.lora_A``...):
  what ``save_lora_weights`` writes, and what diffrl's checkpoints hold.

The LoRA becomes an adapter of its own on the transformer and the only active one; the
config's own LoRA (the one a run would train) is switched off, so the base model plus that
LoRA is what is scored.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffrl.config import ConfigError

ADAPTER = "outside"
PEFT_PREFIX = "base_model.model."


def local_path(spec: str) -> Path:
    """A local folder or file as it is; anything else is a hub id, downloaded (LoRA files only)."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as err:  # offline, no such repository, no access: one line either way
        raise ConfigError(
            f"--lora '{spec}': no such file or folder, and the hub could not provide it "
            f"({type(err).__name__}); download it with `hf download {spec} --local-dir DIR` and pass DIR"
        ) from None


def load_outside_lora(transformer, spec: str, log=print) -> str:
    """Load the LoRA at ``spec`` into ``transformer`` as the one active adapter."""
    path = local_path(spec)
    folder = path if path.is_dir() else path.parent
    if (folder / "adapter_config.json").is_file():
        layers = _load_peft(transformer, folder)
        kind = "PEFT"
    else:
        weights = path if path.is_file() else folder / "pytorch_lora_weights.safetensors"
        if not weights.is_file():
            raise ConfigError(
                f"--lora '{spec}': neither a PEFT adapter (adapter_config.json) nor diffusers LoRA "
                "weights (pytorch_lora_weights.safetensors) there"
            )
        transformer.load_lora_adapter(str(weights), adapter_name=ADAPTER, prefix="transformer")
        layers, kind = _count_layers(transformer), "diffusers"
    transformer.set_adapter(ADAPTER)
    log(f"lora: {spec} ({kind} format, {layers} layers) is the active adapter; the config's own LoRA is off")
    return ADAPTER


def _load_peft(transformer, folder: Path) -> int:
    from peft import LoraConfig, set_peft_model_state_dict
    from safetensors.torch import load_file

    config = LoraConfig(**_lora_fields(json.loads((folder / "adapter_config.json").read_text())))
    transformer.add_adapter(config, adapter_name=ADAPTER)
    state = {
        k.removeprefix(PEFT_PREFIX): v for k, v in load_file(folder / "adapter_model.safetensors").items()
    }
    result = set_peft_model_state_dict(transformer, state, adapter_name=ADAPTER)
    missing = [k for k in getattr(result, "missing_keys", []) if f".{ADAPTER}." in k]
    if missing:
        raise ConfigError(f"--lora {folder}: {len(missing)} LoRA weights missing, e.g. {missing[:2]}")
    return _count_layers(transformer)


def _lora_fields(config: dict) -> dict:
    """The LoraConfig fields of a saved adapter config (saved configs carry PEFT's
    bookkeeping too: peft_type, base model, revision...)."""
    import dataclasses

    from peft import LoraConfig

    known = {f.name for f in dataclasses.fields(LoraConfig)}
    skip = {"peft_type", "base_model_name_or_path", "revision", "task_type", "auto_mapping", "inference_mode"}
    return {k: v for k, v in config.items() if k in known and k not in skip}


def _count_layers(transformer) -> int:
    return sum(1 for _, m in transformer.named_modules() if ADAPTER in getattr(m, "lora_A", {}))

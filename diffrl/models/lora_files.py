"""LoRA files trained elsewhere: a local folder or file, or a hub id, in either format.

* PEFT's (``adapter_config.json`` + ``adapter_model.safetensors``): what flow_grpo saves and
  releases (its ``train_sd3.py`` saves the PEFT-wrapped transformer, its README loads it
  with ``PeftModel.from_pretrained``); keys start ``base_model.model.``.
* diffusers' (``pytorch_lora_weights.safetensors``, keys ``transformer.<module>.lora_A``...):
  what ``save_lora_weights`` writes, and what diffrl's checkpoints hold; diffusers records
  the adapter's LoraConfig in the file's metadata (``lora_adapter_metadata``).

Two uses, each with its setting's name in its errors:

* ``model.init_lora`` (:func:`load_init_lora`): a run (or an evaluation) starts the
  policy's own LoRA from the file, which then trains on with the run's optimizer; its
  shape must be the config's (``model.lora.rank``, its targets), and its alpha, where the
  file records it, must be ``model.lora.alpha``: a LoRA scaled by another alpha would
  silently be another model.
* ``--lora`` of an evaluation (:func:`load_outside_lora`): the file becomes an adapter of
  its own and the only active one; the config's own LoRA is switched off, so the base
  model plus that LoRA is what is scored.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from diffrl.schema import ConfigError

ADAPTER = "outside"  # the adapter name an outside LoRA is loaded under
PEFT_PREFIX = "base_model.model."


def local_path(spec: str, setting: str = "--lora") -> Path:
    """A local folder or file as it is; anything else is a hub id, downloaded (LoRA files
    only). ``setting`` names what the user set, for the one-line error."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as err:  # offline, no such repository, no access: one line either way
        raise ConfigError(
            f"{setting} '{spec}': no such file or folder, and the hub could not provide it "
            f"({type(err).__name__}); download it with `hf download {spec} --local-dir DIR` and pass DIR"
        ) from None


def is_peft_folder(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file()


def diffusers_file(spec: str, path: Path, setting: str) -> Path:
    """The diffusers weights file at ``path`` (the file itself, or the one in the folder)."""
    file = path if path.is_file() else path / "pytorch_lora_weights.safetensors"
    if not file.is_file():
        raise ConfigError(
            f"{setting} '{spec}': neither a PEFT adapter (adapter_config.json) nor diffusers LoRA "
            "weights (pytorch_lora_weights.safetensors) there"
        )
    return file


def read_lora(spec: str, setting: str = "model.init_lora") -> tuple[dict, dict]:
    """(state dict with the transformer's module names, the adapter config if recorded)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = local_path(spec, setting)
    folder = path if path.is_dir() else path.parent
    if is_peft_folder(folder):
        state = load_file(folder / "adapter_model.safetensors")
        config = json.loads((folder / "adapter_config.json").read_text())
        return {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}, config
    file = diffusers_file(spec, path, setting)
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata() or {}
    # diffusers' save_lora_weights records the adapter's LoraConfig as "transformer.<field>"
    recorded = json.loads(metadata.get("lora_adapter_metadata", "{}") or "{}")
    config = {k.removeprefix("transformer."): v for k, v in recorded.items() if k.startswith("transformer.")}
    return {k.removeprefix("transformer."): v for k, v in load_file(str(file)).items()}, config


# -- model.init_lora: the policy's own adapter starts from the file ---------------------------
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
    _check_shapes(transformer, state, spec, lora_cfg)
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


def _check_shapes(transformer, state: dict, spec: str, lora_cfg) -> None:
    """One line where a saved factor's shape is not this config's (a rank mismatch used to
    end in peft's size-mismatch traceback)."""
    ours = dict(transformer.named_parameters())
    for key, value in state.items():
        param = ours.get(_adapter_name(key))
        if param is None or tuple(param.shape) == tuple(value.shape):
            continue
        saved_rank = value.shape[0] if ".lora_A" in key else value.shape[1]
        raise ConfigError(
            f"model.init_lora '{spec}' has rank {saved_rank} ({key}: {tuple(value.shape)}), this config's "
            f"model.lora.rank is {lora_cfg.rank} ({tuple(param.shape)}): set model.lora.rank={saved_rank}"
        )


def looks_local(spec: str) -> bool:
    """Whether ``spec`` is meant as a local path rather than a hub id ("owner/name"): it
    exists, is absolute or home-relative, starts with "." or has more than one "/"."""
    path = Path(spec).expanduser()
    return path.exists() or spec.startswith(("/", "~", ".")) or spec.count("/") > 1


def check_lora_spec(spec: str | None, setting: str = "model.init_lora") -> None:
    """Before anything loads (``--dry-run``, ``--preflight``, every start): a local path that
    is not there is one line; a hub id is left to the preflight and the download."""
    if spec and looks_local(spec) and not Path(spec).expanduser().exists():
        raise ConfigError(
            f"{setting} '{spec}': no such file or folder; point it at a PEFT adapter folder "
            "(adapter_config.json) or diffusers LoRA weights (pytorch_lora_weights.safetensors), or a hub id"
        )


def _adapter_name(key: str) -> str:
    """A saved LoRA key as the trained adapter's parameter name (``lora_A.default.weight``)."""
    return key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
        ".lora_B.weight", ".lora_B.default.weight"
    )


# -- --lora: an adapter of its own, the only active one -----------------------------------
def load_outside_lora(transformer, spec: str, log=print) -> str:
    """Load the LoRA at ``spec`` into ``transformer`` as the one active adapter."""
    path = local_path(spec)
    folder = path if path.is_dir() else path.parent
    if is_peft_folder(folder):
        layers = _load_peft(transformer, folder)
        kind = "PEFT"
    else:
        weights = diffusers_file(spec, path if path.is_file() else folder, "--lora")
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
    from peft import LoraConfig

    known = {f.name for f in dataclasses.fields(LoraConfig)}
    skip = {"peft_type", "base_model_name_or_path", "revision", "task_type", "auto_mapping", "inference_mode"}
    return {k: v for k, v in config.items() if k in known and k not in skip}


def _count_layers(transformer) -> int:
    return sum(1 for _, m in transformer.named_modules() if ADAPTER in getattr(m, "lora_A", {}))

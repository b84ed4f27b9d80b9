"""The data section's own check, called when a config loads (:func:`diffrl.config.validate`):
a real model on the shipped toy prompts is no experiment."""

from __future__ import annotations

from pathlib import Path

from diffrl.data.prompts import PROJECT_ROOT, prompt_keys, resolve_prompt_path
from diffrl.data.registry import is_set_name
from diffrl.schema import ConfigError

# models that are not real: the tiny twins, the ShapeWorld toys, random weights at a
# published architecture (a measurement); their runs may use the shipped toy prompts
TOY_MODELS = ("tiny", "shapeworld", "shapeworld_late", "shapeworld_fewstep", "shapeworld_video")


def is_real_model(pretrained: str) -> bool:
    """Whether ``pretrained`` names real weights (a hub id, a directory outside assets/)."""
    if pretrained in TOY_MODELS or pretrained.startswith("random:"):
        return False
    path = Path(pretrained).expanduser()
    shipped = path if path.is_absolute() else PROJECT_ROOT / path
    return not (shipped.is_dir() and (PROJECT_ROOT / "assets") in shipped.resolve().parents)


def check_data(cfg) -> None:
    """A real model on the shipped toy prompts is no experiment: refused, unless the
    config says so (``data.allow_toy_prompts``)."""
    if cfg.data.allow_toy_prompts or not is_real_model(cfg.model.pretrained):
        return
    for key in prompt_keys(cfg):
        value = getattr(cfg.data, key)
        if is_set_name(value):
            continue
        path = resolve_prompt_path(value).resolve()
        if (PROJECT_ROOT / "assets") in path.parents:
            raise ConfigError(
                f"data.{key} '{value}' is a shipped toy prompt file, and model.pretrained "
                f"'{cfg.model.pretrained}' is a real model: name a prompt set (diffrl-data list; e.g. "
                "pickscore/train, geneval/train, hpdv2/train) or your own file, or set "
                "data.allow_toy_prompts: true to run on the toy prompts anyway"
            )

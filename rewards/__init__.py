"""Reward models behind one signature and a registry by name.

A reward is a callable ``reward(images, prompts, metadata) -> dict[str, Tensor]``
(ddpo-pytorch's convention): ``images`` is a float tensor in [0, 1] shaped (B, 3, H, W)
or (B, F, 3, H, W) for video, or a list of PIL images; the dict maps score names to (B,)
tensors, and the entry under the reward's own name is the one that is optimised.

Registration is by factory, so nothing is loaded at import time:
``rewards.build("jpeg_compressibility")`` constructs the reward when a run asks for it.
"""

from __future__ import annotations

import difflib

from rewards.errors import UserError
from rewards.registry import Registry

# name -> "module:factory"; factories take the config's ``args`` as keyword arguments
_FACTORIES: dict[str, str] = {
    "jpeg_compressibility": "rewards.jpeg:JpegCompressibility",
    "jpeg_incompressibility": "rewards.jpeg:JpegIncompressibility",
    "shapeworld": "rewards.shapeworld:ShapeWorldVerifier",
    "shapeworld_edit": "rewards.shapeworld.editing:ShapeWorldEditVerifier",
    "shapeworld_video": "rewards.shapeworld.video:ShapeWorldVideoVerifier",
    "shapeworld_colour_coverage": "rewards.shapeworld.proxies:ColourCoverage",  # hackable, on purpose
    "remote": "rewards.remote:RemoteReward",
    "reward_server": "rewards.reward_server:RewardServerReward",
    "random_control": "rewards.control:RandomControl",
    "hpsv2": "rewards.hps:HPSv2",
    "hpsv21": "rewards.hps:HPSv21",
    "imagereward": "rewards.imagereward:ImageReward",
    "pickscore": "rewards.pickscore:PickScore",
    "clipscore": "rewards.clipscore:CLIPScore",
    "aesthetic": "rewards.aesthetic:LaionAesthetic",
    "ocr": "rewards.ocr:OCRReward",
    "vlm_judge": "rewards.vlm_judge:VLMJudge",
    "geneval": "rewards.geneval:GenEval",
    "video_frames": "rewards.video:FrameReward",
    "temporal_consistency": "rewards.video:TemporalConsistency",
    "videoalign": "rewards.videoalign:VideoAlignReward",
}


class UnknownRewardError(UserError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return self.args[0]


class RewardArgsError(UserError, ValueError):
    """A reward's ``args`` (or the reward list) in the config are wrong; names the fix."""


REWARDS = Registry("reward", _FACTORIES, error=UnknownRewardError)


def register(name: str, target: str) -> None:
    """Register ``"package.module:Factory"`` under ``name`` (imported on first build)."""
    REWARDS.register(name, target)


def unregister(name: str) -> None:
    REWARDS.unregister(name)


def available() -> list[str]:
    return REWARDS.available()


def _factory(name: str):
    return REWARDS.get(name)


def check(name: str, **kwargs) -> None:
    """What ``build`` checks before it constructs (the name and the argument names), with
    no weights loaded: for ``--dry-run``."""
    _check_arg_names(name, _factory(name), kwargs)


def prompt_checker(name: str, **kwargs):
    """The reward's own prompt check, ``check(prompts)`` raising one error for the bad ones,
    made without loading weights or reaching a server: the factory's ``prompt_checker``
    classmethod given the config's ``args``. None when the reward reads any prompt (or, like
    ``remote``, can only ask its server, which the run's start does)."""
    factory = _factory(name)
    _check_arg_names(name, factory, kwargs)
    make = getattr(factory, "prompt_checker", None)
    return _called(name, make, kwargs) if make is not None else None


def build(name: str, **kwargs):
    factory = _factory(name)
    _check_arg_names(name, factory, kwargs)
    return _called(name, factory, kwargs)


def build_from_spec(spec: str):
    """(name, reward) from ``NAME`` or ``NAME={json args}``, the form a command line takes
    (``diffrl-serve --reward``, Ray Serve's ``build_app``)."""
    import json

    name, _, raw = spec.partition("=")
    try:
        args = json.loads(raw) if raw else {}
    except json.JSONDecodeError as err:
        raise RewardArgsError(f"--reward {spec!r}: the args after '=' are not JSON ({err.msg})") from None
    if not isinstance(args, dict):
        raise RewardArgsError(f"--reward {spec!r}: the args after '=' must be a JSON object")
    return name, build(name, **args)


def _called(name: str, make, kwargs: dict):
    """``make(**kwargs)``, a plain TypeError / ValueError turned into one line naming the reward."""
    try:
        return make(**kwargs)
    except (TypeError, ValueError) as err:
        if type(err) not in (TypeError, ValueError):  # a reward's own error type already says it all
            raise
        raise RewardArgsError(f"reward '{name}', args {kwargs}: {err}") from None


def _check_arg_names(name: str, factory, kwargs: dict) -> None:
    """An unknown argument is named with the valid ones (a TypeError would not list them)."""
    import inspect

    params = inspect.signature(factory).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in valid]
    if unknown:
        close = difflib.get_close_matches(unknown[0], valid, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise RewardArgsError(
            f"reward '{name}' has no argument '{unknown[0]}'.{hint} "
            f"Its arguments: {', '.join(valid) or 'none'}"
        )


__all__ = [
    "REWARDS",
    "RewardArgsError",
    "UnknownRewardError",
    "available",
    "build",
    "check",
    "prompt_checker",
    "register",
    "unregister",
]

"""A protocol checks everything it reads before a model loads (issue 62, item 5): DrawBench
took five runs to find five missing rewards, and its hints read as Python arguments."""

from __future__ import annotations

import pytest

from diffrl.evaluation.protocol_run import ProtocolRun, preflight_protocol, protocol_config
from diffrl.inference.preflight import PreflightError, as_reward_arg


@pytest.fixture
def offline_empty(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("DIFFRL_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))


def test_drawbench_lists_every_missing_reward_at_once(offline_empty):
    request = ProtocolRun(protocol="drawbench", config="sd35_diffusionnft")
    cfg = protocol_config(request)
    assert cfg.data.eval_prompts == "drawbench" and len(cfg.rewards) == 6
    with pytest.raises(PreflightError) as err:
        preflight_protocol(request)
    text = str(err.value)
    for reward in ("imagereward", "pickscore", "aesthetic", "vlm_judge", "hpsv21", "clipscore"):
        assert reward in text, reward
    assert "prompt set drawbench" in text and "stabilityai/stable-diffusion-3.5-medium" in text
    assert text.count("MISSING") == 10 and "lists this again" in text


def test_fixes_are_phrased_as_the_reward_arg_a_protocol_takes():
    fix = "hf download KwaiVGI/VideoReward   (or --local-dir DIR, then rewards.N.args.checkpoint: DIR)"
    assert as_reward_arg(fix, "videoalign checkpoint").endswith(
        "then --reward-arg videoalign.checkpoint=DIR)"
    )
    assert as_reward_arg(None, "x") is None

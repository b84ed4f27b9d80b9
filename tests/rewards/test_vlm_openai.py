"""``vlm_judge`` with ``backend: openai`` against a fake OpenAI-compatible judge on 127.0.0.1
(tests/fake_openai.py): each request's shape, the score against the formula on the
server's own logits, retries, start-up checks, the bound on requests in flight, and the
overlap with the rollout. Expected values come from the fake judge's logits, never from
the reward's code."""

from __future__ import annotations

import math
import re
import time

import pytest
import torch

import rewards
from rewards.remote import RemoteRewardError
from rewards.vlm_answers import VLMAnswerError
from tests.fake_openai import FakeJudge, image_logits

PROMPTS = ["a red circle", "two blue squares", "a cat", "a house by the sea"]


def images(n=4):
    """Flat images of distinct means (plus a little texture), so every answer differs."""
    x = torch.linspace(0.1, 0.9, n).view(n, 1, 1, 1).expand(n, 3, 16, 16).clone()
    x[:, :, ::2] += 0.05
    return x


def means(x: torch.Tensor) -> list[float]:
    """What the judge sees: the uint8 PNG's mean / 255."""
    return [float(m) for m in ((x.clamp(0, 1) * 255).round().double().mean(dim=(1, 2, 3)) / 255)]


def softmax(logits: dict[str, float]) -> dict[str, float]:
    z = sum(math.exp(v) for v in logits.values())
    return {t: math.exp(v) / z for t, v in logits.items()}


def judge(server: FakeJudge, **args):
    args = {"backend": "openai", "base_url": server.base_url, "model": server.model, "backoff": 0.01, **args}
    return rewards.build("vlm_judge", **args)


def test_yes_no_is_p_yes_over_p_yes_plus_p_no_of_the_listed_logprobs():
    x = images()
    with FakeJudge() as server:
        out = judge(server, template='Is this "{prompt}"? Yes or No.')(x, PROMPTS)
    p = [softmax(image_logits(m)) for m in means(x)]
    expected = torch.tensor([q["Yes"] / (q["Yes"] + q["No"]) for q in p])
    torch.testing.assert_close(out["vlm_judge"], expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out["vlm_judge_answer_mass"], torch.tensor([q["Yes"] + q["No"] for q in p]))
    assert server.problems == [] and len(server.requests) == 4 and server.model_calls == 1
    texts = sorted(r["messages"][0]["content"][1]["text"] for r in server.requests)
    assert texts == sorted(f'Is this "{p}"? Yes or No.' for p in PROMPTS)
    assert {(r["max_tokens"], r["top_logprobs"], r["temperature"]) for r in server.requests} == {(1, 20, 0)}


def test_score_mode_is_the_normalised_expected_digit():
    x = images()
    with FakeJudge() as server:
        out = judge(server, mode="score")(x, PROMPTS)
    raw, mass = [], []
    for m in means(x):
        q = softmax(image_logits(m))
        digits = {d: q[str(d)] for d in range(1, 6)}
        raw.append(sum(d * p for d, p in digits.items()) / sum(digits.values()))
        mass.append(sum(digits.values()))
    torch.testing.assert_close(out["vlm_judge_raw"], torch.tensor(raw))
    torch.testing.assert_close(out["vlm_judge"], (torch.tensor(raw) - 1) / 4)
    torch.testing.assert_close(out["vlm_judge_answer_mass"], torch.tensor(mass))
    assert 'How well does this image show "a cat"? Answer with one digit from 1 (not at all) to 5' in str(
        server.requests
    )


def test_text_mode_parses_the_written_score():
    x = images()
    with FakeJudge(text=lambda m: f"Fine.\nFinal Score: {1 + 4 * m:.3f}") as server:
        out = judge(server, mode="text")(x, PROMPTS)
    stated = torch.tensor([float(f"{1 + 4 * m:.3f}") for m in means(x)])
    torch.testing.assert_close(out["vlm_judge_raw"], stated)
    torch.testing.assert_close(out["vlm_judge"], (stated - 1) / 4)
    assert server.problems == [] and {r["max_tokens"] for r in server.requests} == {512}
    assert not any("logprobs" in r for r in server.requests)


def test_an_unparseable_or_cut_answer_is_an_error_quoting_it():
    with FakeJudge(text=lambda m: "I would rather not rate this picture.") as server:
        with pytest.raises(VLMAnswerError, match=r"does not match pattern.*rather not rate.*template"):
            judge(server, mode="text")(images(2), PROMPTS[:2])
    with FakeJudge(text=lambda m: "Let me think step by step about", finish="length") as server:
        with pytest.raises(VLMAnswerError, match="cut at max_tokens, raise max_tokens"):
            judge(server, mode="text", max_tokens=8)(images(1), PROMPTS[:1])
        assert {r["max_tokens"] for r in server.requests} == {8}


def test_unparsed_zero_reads_an_answer_without_a_score_as_0_and_counts_it():
    """flow_grpo's and DiffusionNFT's UnifiedReward client score such an answer 0."""
    x = images(2)
    text = lambda m: "Final Score: 4" if m > 0.5 else "I would rather not rate this picture."  # noqa: E731
    with FakeJudge(text=text) as server:
        out = judge(server, mode="text", unparsed="zero")(x, PROMPTS[:2])
    assert out["vlm_judge_raw"].tolist() == [0.0, 4.0] and out["vlm_judge_unparsed"].tolist() == [1.0, 0.0]
    with pytest.raises(rewards.RewardArgsError, match="applies to mode 'text'"):
        rewards.build(
            "vlm_judge", backend="openai", base_url="http://127.0.0.1:9/v1", model="m", unparsed="zero"
        )


REFERENCE_FILE = """
import asyncio

def unifiedreward_score_sglang(device):
    async def evaluate_image(prompt, image):
        question = f"<image>\\nRate it {{1-5}}.\\nCaption: [{prompt}]"
        return question
"""


def test_the_unifiedreward_question_is_read_from_the_reference_file(tmp_path, monkeypatch):
    """The preset's question comes from the file's syntax tree (never run), the caption's
    place becoming {prompt}; a pinned default is checked against its sha256."""
    import hashlib
    import http.server
    import threading

    from rewards import vlm_templates

    path = tmp_path / "rewards.py"
    path.write_text(REFERENCE_FILE)
    expected = "<image>\nRate it {1-5}.\nCaption: [{prompt}]"  # the f-string's {{ }} read as braces
    assert vlm_templates.preset_template("unifiedreward", str(path)) == expected
    with FakeJudge(text=lambda m: "Final Score: 3") as server:
        judge(server, mode="text", template="unifiedreward", template_source=str(path))(images(1), ["a cat"])
    (request,) = server.requests
    assert request["messages"][0]["content"][1]["text"] == expected.replace("{prompt}", "a cat")
    # the pinned default: fetched once from a URL, refused when its sha256 differs
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/rewards.py"
    try:
        pinned = (url, hashlib.sha256(path.read_bytes()).hexdigest(), "evaluate_image", "question")
        monkeypatch.setitem(vlm_templates.PRESETS, "unifiedreward", pinned)
        assert vlm_templates.preset_template("unifiedreward") == expected
        monkeypatch.setitem(vlm_templates.PRESETS, "unifiedreward", (url + "?x", "0" * 64, *pinned[2:]))
        with pytest.raises(vlm_templates.TemplateSourceError, match="not the pinned file"):
            vlm_templates.preset_template("unifiedreward")
    finally:
        httpd.shutdown()
    (tmp_path / "other.py").write_text("def evaluate_image(prompt):\n    question = 'plain'\n")
    with pytest.raises(vlm_templates.TemplateSourceError, match="no f-string 'question'"):
        vlm_templates.preset_template("unifiedreward", str(tmp_path / "other.py"))


def test_answers_missing_from_the_top_k():
    """None listed: an error naming what was listed. One listed: the other counts 0."""
    x = images(2)
    with FakeJudge(hide=("Yes", "No")) as server:
        with pytest.raises(VLMAnswerError, match=r"none of the answers \['Yes', 'No'\].*top 20.*'1'"):
            judge(server)(x, PROMPTS[:2])
    with FakeJudge(hide=("No",)) as server:
        out = judge(server)(x, PROMPTS[:2])
    assert out["vlm_judge"].tolist() == [1.0, 1.0]
    expected = torch.tensor([softmax(image_logits(m))["Yes"] for m in means(x)])
    torch.testing.assert_close(out["vlm_judge_answer_mass"], expected)


def test_overload_is_retried_then_one_clear_error():
    x = images(1)
    with FakeJudge(failures=[429, 503]) as server:
        out = judge(server, retries=2)(x, PROMPTS[:1])
        assert server.chat_calls == 3 and torch.isfinite(out["vlm_judge"]).all()
    with FakeJudge(failures=[503] * 10) as server:
        start = time.perf_counter()
        with pytest.raises(
            RemoteRewardError, match=r"completions failed 3 times \(last: HTTP 503.*vllm serve"
        ):
            judge(server, retries=2)(x, PROMPTS[:1])
        assert server.chat_calls == 3 and time.perf_counter() - start < 5


def test_a_refused_request_is_not_retried():
    x = images(1)
    with FakeJudge(failures=[400]) as server:
        with pytest.raises(RemoteRewardError, match="answered HTTP 400: .*injected HTTP 400"):
            judge(server, retries=3)(x, PROMPTS[:1])
        assert server.chat_calls == 1
    with FakeJudge() as server:  # vLLM's cap on top_logprobs: the fix is named
        with pytest.raises(RemoteRewardError, match=r"greater than max allowed: 20.*--max-logprobs"):
            judge(server, top_logprobs=25)(x, PROMPTS[:1])
        assert server.chat_calls == 1


def test_start_up_checks_the_model_name_and_the_server():
    with FakeJudge(model="Qwen/Qwen2.5-VL-7B-Instruct") as server:
        with pytest.raises(
            rewards.RewardArgsError, match=r"serves \['Qwen/Qwen2.5-VL-7B-Instruct'\], not 'qw"
        ):
            rewards.build("vlm_judge", backend="openai", base_url=server.base_url, model="qwen")
        assert server.chat_calls == 0
        with pytest.raises(RemoteRewardError, match=r"HTTP 404.*usually ending in /v1"):
            rewards.build("vlm_judge", backend="openai", base_url=server.base_url[:-3], model="x")
    with pytest.raises(RemoteRewardError, match=r"GET .*/models failed 2 times.*vllm serve"):
        judge(server, model="x", retries=1, backoff=0)


def test_requests_in_flight_stay_within_max_concurrent():
    with FakeJudge(delay=0.05) as server:
        reward = judge(server, max_concurrent=3)
        reward(images(12), PROMPTS * 3)
    assert server.max_in_flight == 3 and len(server.requests) == 12  # the bound, and reached


def test_overlap_on_and_off_give_the_same_scores():
    """The trainer's path with overlap (each chunk submitted as decoded, gathered after the
    rollout) and without (the whole batch after the rollout) score alike."""
    from diffrl.config import RewardSpec
    from rewards.combine import MultiReward

    x, prompts = images(6), PROMPTS + PROMPTS[:2]
    with FakeJudge(delay=0.01) as server:
        args = {"backend": "openai", "base_url": server.base_url, "model": server.model}
        on = MultiReward([RewardSpec(name="vlm_judge", weight=1.0, args=args)])
        off = MultiReward([RewardSpec(name="vlm_judge", weight=1.0, args={**args, "overlap": False})])
        assert on.scores_elsewhere and not off.scores_elsewhere
        pending = [on.submit(x[i : i + 2], prompts[i : i + 2]) for i in range(0, 6, 2)]
        total_on, _, logs_on = on(x, prompts, pending=pending)
        total_off, _, logs_off = off(x, prompts)
    torch.testing.assert_close(total_on, total_off, rtol=0, atol=0)
    assert logs_on.keys() == logs_off.keys() == {"vlm_judge", "vlm_judge_answer_mass"}
    assert len(server.requests) == 12


def test_pil_images_of_different_sizes_are_each_their_own_request():
    from PIL import Image

    pil = [Image.new("RGB", (8, 8), (200, 200, 200)), Image.new("RGB", (12, 6), (20, 20, 20))]
    with FakeJudge() as server:
        out = judge(server)(pil, PROMPTS[:2])
    expected = [softmax(image_logits(v / 255)) for v in (200, 20)]
    expected = torch.tensor([q["Yes"] / (q["Yes"] + q["No"]) for q in expected])
    torch.testing.assert_close(out["vlm_judge"], expected)


def test_an_api_key_comes_from_the_named_environment_variable(monkeypatch):
    with FakeJudge(api_key="s3cret") as server:
        with pytest.raises(RemoteRewardError, match="HTTP 401.*api_key_env"):
            judge(server)(images(1), PROMPTS[:1])
        with pytest.raises(rewards.RewardArgsError, match="'JUDGE_KEY', which is not set"):
            judge(server, api_key_env="JUDGE_KEY")
        monkeypatch.setenv("JUDGE_KEY", "s3cret")
        assert judge(server, api_key_env="JUDGE_KEY")(images(1), PROMPTS[:1])["vlm_judge"].shape == (1,)


URL = {"base_url": "http://127.0.0.1:9/v1"}  # nothing listens: every case must fail before a request
OPENAI = {"backend": "openai", "model": "m", **URL}


@pytest.mark.parametrize(
    "args, message",
    [
        ({"backend": "vllm"}, "backend must be one of transformers, openai, got 'vllm'"),
        ({"backend": "openai", "model": "m"}, "backend openai needs base_url"),
        ({"backend": "openai", **URL}, "backend openai needs model"),
        (URL, "base_url belongs to backend 'openai', not 'transformers'; set backend: openai"),
        ({**OPENAI, "pretrained": "x"}, "pretrained belongs to backend 'transformers'"),
        ({**OPENAI, "max_tokens": 4}, "max_tokens must be 1"),
        ({**OPENAI, "mode": "text", "max_tokens": 1}, "max_tokens must be >= 2"),
        ({**OPENAI, "mode": "score", "pattern": "axes"}, "pattern is read in mode 'text' only"),
        ({**OPENAI, "mode": "text", "pattern": r"\d+"}, "has 0 groups"),
        ({**OPENAI, "mode": "text", "low": 5, "high": 1}, "needs low < high"),
        ({**OPENAI, "mode": "score", "top_logprobs": 3}, "cannot list all 5 answers"),
        ({**OPENAI, "template": "Rate it."}, "template must contain '{prompt}'"),
    ],
)
def test_bad_arguments_are_one_clear_error_before_any_request(args, message):
    with pytest.raises(rewards.RewardArgsError, match=re.escape(message)):
        rewards.build("vlm_judge", **args)

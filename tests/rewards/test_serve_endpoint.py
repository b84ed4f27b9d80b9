"""The reward service's protocol without its engine (rewards/serve_endpoint.py): batches
split by image size and scored as each image alone, deadlines answered 504 and never a
zero, the reward's own error marked so the client does not retry it, and a retried id
answered from the ledger instead of scored twice."""

from __future__ import annotations

import asyncio
import json
import math
import time

import torch

from rewards import build
from rewards.remote import encode_request
from rewards.request_ledger import RequestLedger
from rewards.serve_endpoint import Job, RewardEndpoint, images_in, score_jobs


def test_score_jobs_groups_sizes_and_each_job_scores_as_it_would_alone():
    reward = build("jpeg_compressibility")
    jobs = [
        Job(torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)), ["a", "b"]),
        Job(torch.rand(1, 3, 24, 24, generator=torch.Generator().manual_seed(1)), ["c"]),
        Job(torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(2)), ["d", "e", "f"]),
        Job(torch.rand(1, 3, 16, 16), ["late"], deadline=time.monotonic() - 1),
    ]
    calls = []

    def counting(images, prompts, meta):
        calls.append(len(images))
        return reward(images, prompts, meta)

    out = score_jobs(counting, jobs)
    assert sorted(calls) == [1, 5] and images_in(jobs) == 7  # one call per image size; the late job none
    assert out[3] is None
    for job, scores in zip(jobs[:3], out[:3], strict=True):
        alone = reward(job.images, job.prompts, {})
        assert scores.keys() == alone.keys()
        for key in alone:
            assert scores[key] == alone[key].float().tolist()


def _endpoint(reward=None, name="jpeg_compressibility"):
    reward = reward or build(name)
    calls = []

    async def score(job):
        calls.append(len(job.images))
        await asyncio.sleep(0.05)
        return score_jobs(reward, [job])[0]

    return RewardEndpoint(reward, name, RequestLedger(), "replica-0", score), calls


def test_score_answers_the_rewards_scores_and_a_retry_is_answered_once_scored():
    endpoint, calls = _endpoint()
    images = torch.rand(3, 3, 16, 16)
    body = encode_request(images, ["a", "b", "c"])
    headers = {"X-Request-Id": "id-1", "X-Request-Timeout": "30"}

    async def story():
        first, retry = await asyncio.gather(
            endpoint.answer("POST", "/score", body, headers), endpoint.answer("POST", "/score", body, headers)
        )
        later = await endpoint.answer("POST", "/score", body, headers)
        return first, retry, later

    first, retry, later = asyncio.run(story())
    assert first.status == retry.status == later.status == 200
    assert first.payload == retry.payload == later.payload
    expected = build("jpeg_compressibility")(images, ["a", "b", "c"], {})["jpeg_compressibility"]
    assert json.loads(first.payload)["scores"]["jpeg_compressibility"] == expected.tolist()
    assert calls == [3]  # scored once: the concurrent retry waited, the late one was cached


def test_an_expired_request_is_a_504_never_a_score_and_errors_are_marked():
    endpoint, calls = _endpoint()
    body = encode_request(torch.rand(1, 3, 8, 8), ["a"])

    async def slow(job):
        await asyncio.sleep(0.2)
        return score_jobs(endpoint.reward, [job])[0]  # the deadline passed while it waited

    endpoint.score = slow
    expired = asyncio.run(endpoint.answer("POST", "/score", body, {"X-Request-Timeout": "0.1"}))
    assert expired.status == 504 and expired.headers["x-diffrl-error"] == "expired"
    assert "scores" not in json.loads(expired.payload)

    def broken(images, prompts, meta):
        raise RuntimeError("CUDA out of memory")

    failing, _ = _endpoint(reward=broken, name="broken")
    error = asyncio.run(failing.answer("POST", "/score", body, {}))
    assert error.status == 500 and error.headers["x-diffrl-error"] == "reward"
    assert "CUDA out of memory" in json.loads(error.payload)["error"]
    bad = asyncio.run(failing.answer("POST", "/score", body, {"X-Request-Timeout": "-1"}))
    assert bad.status == 400 and "X-Request-Timeout" in json.loads(bad.payload)["error"]
    conflict = RewardEndpoint(None, "x", RequestLedger(), "r", None)
    asyncio.run(conflict.ledger.claim("id", 1, "r"))
    clash = asyncio.run(conflict.answer("POST", "/score", body, {"X-Request-Id": "id"}))
    assert clash.status == 409
    # the failed and expired claims were released: nothing is left running
    assert asyncio.run(endpoint.ledger.stats())["running"] == 0
    assert asyncio.run(failing.ledger.stats())["running"] == 0


def test_info_check_and_health():
    endpoint, _ = _endpoint(build("shapeworld"), "shapeworld")
    assert json.loads(asyncio.run(endpoint.answer("POST", "/info", b"{}", {})).payload) == {
        "reward": "shapeworld"
    }
    good = asyncio.run(endpoint.answer("POST", "/check", json.dumps([["a red circle", None]]).encode(), {}))
    assert json.loads(good.payload) == {"ok": True}
    refused = asyncio.run(
        endpoint.answer("POST", "/check", json.dumps([["a purple dragon", None]]).encode(), {})
    )
    assert json.loads(refused.payload)["ok"] is False
    health = json.loads(asyncio.run(endpoint.answer("GET", "/health", b"", {})).payload)
    assert health["ok"] and health["ledger"]["finished"] == 0 and isinstance(health["pid"], int)
    missing = asyncio.run(endpoint.answer("POST", "/nope", b"", {}))
    assert missing.status == 404 and not math.isnan(missing.status)


def test_a_request_whose_client_hangs_up_is_still_recorded_and_its_retry_not_scored_again():
    endpoint, calls = _endpoint()
    body = encode_request(torch.rand(2, 3, 8, 8), ["a", "b"])
    headers = {"X-Request-Id": "hung-up", "X-Request-Timeout": "30"}

    async def story():
        first = asyncio.ensure_future(endpoint.answer("POST", "/score", body, headers))
        await asyncio.sleep(0.01)  # it is being scored (the stand-in takes 0.05 s)
        first.cancel()
        try:
            await first
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.2)  # the shielded scoring finishes and is recorded
        return await endpoint.answer("POST", "/score", body, headers), await endpoint.ledger.stats()

    retry, stats = asyncio.run(story())
    assert retry.status == 200 and calls == [2]
    assert stats["finished"] == 1 and stats["cached"] == 1 and stats["running"] == 0

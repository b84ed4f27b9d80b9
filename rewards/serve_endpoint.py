"""The reward service's protocol, apart from the engine that runs it (Ray Serve,
:mod:`rewards.serve_ray`): what each request gets, and how a batch of jobs is scored.

Endpoints (the ``remote`` client, :mod:`rewards.remote`, speaks them over HTTP or through a
Ray Serve handle, which carries the same bytes without the HTTP hop):

* ``POST /info`` -> ``{"reward": name}``.
* ``POST /check`` with a JSON list of wire prompts -> ``{"ok": bool, "error": str}`` (the
  reward's own ``check_prompts``).
* ``POST /score`` with :func:`rewards.remote.encode_request`'s bytes -> ``{"reward": name,
  "scores": {key: [floats]}}``. Headers: ``X-Request-Id``, the same on every try, so a
  retried batch is scored once across replicas (:mod:`rewards.request_ledger`);
  ``X-Request-Timeout``, the seconds the client waits, after which the job is dropped
  unscored and answered 504 ("expired"): an error the client retries or raises, never a
  zero.
* ``GET /health`` -> this replica's counts and the ledger's (JSON).

Errors this code answers carry ``X-Diffrl-Error`` (``request``, ``reward``, ``conflict``,
``expired``): a 500 without it comes from the engine (a replica lost mid-request) and is
worth a retry, a 500 with it is the reward's own error and is not. Back-pressure (503 with
``Retry-After``) is the engine's: Ray Serve's ``max_queued_requests``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rewards.remote import decode_request, prompt_from_wire
from rewards.request_ledger import IdConflict

WAIT_SLICE_S = 1.0  # a request waiting on another replica's claim re-checks it this often


class Answer(NamedTuple):
    status: int
    payload: bytes
    headers: dict


@dataclass
class Job:
    """One request's images and prompts, and the time.monotonic() after which nobody waits."""

    images: torch.Tensor
    prompts: list
    deadline: float = math.inf


def images_in(jobs: list[Job]) -> int:
    """A batch's size for ``@serve.batch``: images, not requests."""
    return sum(len(job.images) for job in jobs)


def score_jobs(reward, jobs: list[Job], latency_s_per_image: float = 0.0) -> list[dict | None]:
    """Each job's scores (None for one whose deadline passed before scoring). Jobs with the
    same image size are scored in one call; rewards here score each image on its own, so a
    job's scores do not depend on what it was batched with (tested)."""
    now = time.monotonic()
    out: list[dict | None] = [None] * len(jobs)
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        if job.deadline > now:
            groups.setdefault(tuple(job.images.shape[1:]), []).append(i)
    for members in groups.values():
        images = torch.cat([jobs[i].images for i in members])
        with torch.no_grad():
            scores = reward(images, [p for i in members for p in jobs[i].prompts], {})
        # benchmarks only: a reward model on another device costs wall time, not CPU here
        time.sleep(latency_s_per_image * len(images))
        start = 0
        for i in members:
            end = start + len(jobs[i].images)
            out[i] = {
                k: [float(x) for x in v[start:end].detach().float().cpu().tolist()] for k, v in scores.items()
            }
            start = end
    return out


def budget_from_header(header: str | None) -> float | None:
    if header is None:
        return None
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise ValueError(f"X-Request-Timeout must be a number of seconds > 0, got {header!r}")
    return value


class RewardEndpoint:
    """Answers the endpoints (module docstring) for one replica.

    ``ledger``: async ``claim / wait / finish / release / stats`` (a
    :class:`~rewards.request_ledger.RequestLedger` or the Ray actor's proxy); ``owner``: this
    replica's name in it; ``score(job)``: async, the job's scores or None if it expired
    (Ray Serve's ``@serve.batch`` around :func:`score_jobs`)."""

    def __init__(self, reward, name: str, ledger, owner: str, score):
        self.reward, self.name, self.ledger, self.owner, self.score = reward, name, ledger, owner, score
        self.counts = dict(requests=0, scored_jobs=0, batches=0, expired=0, errors=0)

    async def answer(self, method: str, path: str, body: bytes, headers: dict) -> Answer:
        headers = {k.lower(): v for k, v in headers.items()}
        if method == "GET" and path == "/health":
            ledger = await self.ledger.stats()
            replica = dict(reward=self.name, ok=True, replica=self.owner, pid=os.getpid(), **self.counts)
            return _json(200, {**replica, "ledger": ledger})
        if method != "POST":
            return _error(
                404, "request", f"no {method} endpoint {path}; GET /health, POST /info, /check, /score"
            )
        if path == "/info":
            return _json(200, {"reward": self.name})
        if path == "/check":
            return self._check(body)
        if path == "/score":
            return await self._score(body, headers)
        return _error(404, "request", f"no endpoint {path}; use /info, /check or /score")

    def _check(self, body: bytes) -> Answer:
        check = getattr(self.reward, "check_prompts", None)
        try:
            prompts = [prompt_from_wire(entry) for entry in json.loads(body)]
            if check is not None:
                check(prompts)
        except ValueError as err:
            return _json(200, {"ok": False, "error": str(err)})
        return _json(200, {"ok": True})

    async def _score(self, body: bytes, headers: dict) -> Answer:
        self.counts["requests"] += 1
        try:
            budget = budget_from_header(headers.get("x-request-timeout"))
        except ValueError as err:
            return _error(400, "request", str(err))
        deadline = math.inf if budget is None else time.monotonic() + budget
        rid = headers.get("x-request-id") or f"anonymous-{uuid.uuid4().hex}"
        try:
            scores = await self._claimed_or_done(rid, len(body), deadline)
        except IdConflict as err:
            return _error(409, "conflict", str(err))
        if scores is None:
            return self._expired()
        if scores is not _CLAIMED:
            return self._scores(scores)
        return await self._score_claimed(rid, body, deadline)

    async def _claimed_or_done(self, rid: str, size: int, deadline: float):
        """The cached scores, None once the deadline passed, or _CLAIMED: score it here."""
        while True:
            state, scores = await self.ledger.claim(rid, size, self.owner)
            if state == "done":
                return scores
            if state == "claimed":
                return _CLAIMED
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await self.ledger.wait(rid, min(WAIT_SLICE_S, left))

    async def _score_claimed(self, rid: str, body: bytes, deadline: float) -> Answer:
        """Score a claimed request and record it in the ledger, shielded from the request's
        cancellation: a client that hangs up while its job waits in a batch or is being
        scored leaves it to finish (or expire) and be recorded, so its retry is answered
        from the ledger instead of scored again, and the claim is never left behind."""
        return await asyncio.shield(asyncio.ensure_future(self._score_and_record(rid, body, deadline)))

    async def _score_and_record(self, rid: str, body: bytes, deadline: float) -> Answer:
        scored = False
        try:
            try:
                images, prompts = decode_request(body)
                if len(prompts) != len(images):
                    raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
            except ValueError as err:
                return _error(400, "request", f"ValueError: {err}")
            try:
                scores = await self.score(Job(images, prompts, deadline))
            except Exception as err:  # the reward's own error: every waiting request gets it
                self.counts["errors"] += 1
                return _error(500, "reward", f"{type(err).__name__}: {err}")
            if scores is None:
                return self._expired()
            await self.ledger.finish(rid, len(body), scores, len(images))
            scored = True
            self.counts["scored_jobs"] += 1
            return self._scores(scores)
        finally:
            if not scored:
                await self.ledger.release(rid, self.owner)

    def _scores(self, scores: dict) -> Answer:
        return _json(200, {"reward": self.name, "scores": scores})

    def _expired(self) -> Answer:
        self.counts["expired"] += 1
        return _error(504, "expired", "the request's X-Request-Timeout passed before it was scored")


_CLAIMED = object()


def _json(status: int, payload: dict, headers: dict | None = None) -> Answer:
    return Answer(
        status, json.dumps(payload).encode(), {"content-type": "application/json", **(headers or {})}
    )


def _error(status: int, kind: str, message: str) -> Answer:
    return _json(status, {"error": message, "kind": kind}, {"x-diffrl-error": kind})

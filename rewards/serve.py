"""A reward served over HTTP, with batching across requests (``scripts/serve_rewards.py``).

Endpoints (all POST): ``/info`` -> ``{"reward": name}``; ``/check`` with a JSON list of
``[text, image path or null]`` -> ``{"ok": bool, "error": str}`` (the reward's own
``check_prompts``); ``/score`` with :func:`rewards.remote.encode_request`'s bytes ->
``{"reward": name, "scores": {key: [floats]}}``.

Batching: request threads put their batch on a queue; one scoring thread takes the first
waiting request, then any others that arrive within ``max_wait_ms`` while the images stay
within ``max_batch`` and share a size, scores them as one batch, and hands each its slice.
Scores are therefore those of the reward on the concatenated batch; rewards here score each
image on its own, so a request's scores do not depend on what it was batched with (tested).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from rewards.prompts import EditPrompt
from rewards.remote import decode_request, encode_scores


@dataclass
class _Job:
    images: torch.Tensor
    prompts: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    scores: dict | None = None
    error: str | None = None


class BatchingScorer:
    """Scores jobs from many threads in batches on one thread (the reward is not assumed
    to be thread-safe)."""

    def __init__(
        self, reward, max_batch: int = 64, max_wait_ms: float = 5.0, latency_ms_per_image: float = 0.0
    ):
        self.reward, self.max_batch, self.max_wait = reward, int(max_batch), max_wait_ms / 1000
        # benchmarks only: a reward model on another device, which costs wall time, not CPU here
        self.latency = latency_ms_per_image / 1000
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.batches = 0  # scoring calls made (a test reads it to see batching happen)
        threading.Thread(target=self._loop, daemon=True, name="reward-scorer").start()

    def score(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        job = _Job(images, prompts)
        self.jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise RuntimeError(job.error)
        return job.scores

    def _take_batch(self) -> list[_Job]:
        jobs = [self.jobs.get()]
        count, shape = len(jobs[0].images), jobs[0].images.shape[1:]
        while count < self.max_batch:
            try:
                job = self.jobs.get(timeout=self.max_wait)
            except queue.Empty:
                break
            if job.images.shape[1:] != shape or count + len(job.images) > self.max_batch:
                self.jobs.put(job)  # scored in a later batch
                break
            jobs.append(job)
            count += len(job.images)
        return jobs

    def _loop(self) -> None:
        while True:
            jobs = self._take_batch()
            try:
                images = torch.cat([j.images for j in jobs])
                prompts = [p for j in jobs for p in j.prompts]
                with torch.no_grad():
                    out = self.reward(images, prompts, {})
                time.sleep(self.latency * len(images))
                self.batches += 1
                start = 0
                for job in jobs:
                    end = start + len(job.images)
                    job.scores = {k: v[start:end] for k, v in out.items()}
                    start = end
            except Exception as err:  # every waiting request gets the reward's error, none hangs
                for job in jobs:
                    job.error = f"{type(err).__name__}: {err}"
            for job in jobs:
                job.done.set()


def make_handler(scorer: BatchingScorer, name: str):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                if self.path == "/info":
                    self._send(200, json.dumps({"reward": name}).encode())
                elif self.path == "/check":
                    self._send(200, self._check(body))
                elif self.path == "/score":
                    images, prompts = decode_request(body)
                    self._send(200, encode_scores(scorer.score(images, prompts), name))
                else:
                    self._send(404, f"no endpoint {self.path}; use /info, /check or /score".encode())
            except Exception as err:
                self._send(500, f"{type(err).__name__}: {err}".encode())

        def _check(self, body: bytes) -> bytes:
            check = getattr(scorer.reward, "check_prompts", None)
            prompts = [EditPrompt(text, image) if image else text for text, image in json.loads(body)]
            try:
                if check is not None:
                    check(prompts)
            except ValueError as err:
                return json.dumps({"ok": False, "error": str(err)}).encode()
            return json.dumps({"ok": True}).encode()

        def _send(self, status: int, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):  # one line per request would flood a training log
            pass

    return Handler


def serve(reward, name: str, host: str = "127.0.0.1", port: int = 0, **batching) -> ThreadingHTTPServer:
    """A started server (port 0: a free one, read it from ``server.server_address``);
    ``server.shutdown()`` stops it."""
    scorer = BatchingScorer(reward, **batching)
    server = ThreadingHTTPServer((host, port), make_handler(scorer, name))
    server.scorer = scorer
    threading.Thread(target=server.serve_forever, daemon=True, name="reward-server").start()
    return server

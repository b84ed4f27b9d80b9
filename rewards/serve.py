"""A reward served over HTTP, with batching across requests (``scripts/serve_rewards.py``).

Endpoints: ``POST /info`` -> ``{"reward": name}``; ``POST /check`` with a JSON list of
``[text, image path or null]`` -> ``{"ok": bool, "error": str}`` (the reward's own
``check_prompts``); ``POST /score`` with :func:`rewards.remote.encode_request`'s bytes ->
``{"reward": name, "scores": {key: [floats]}}``; ``GET /health`` -> queue and counters (JSON;
503 once stopping).

Overload protocol of ``/score`` (every header optional, so an old client still works):

* ``X-Request-Id``: the client's id for the batch, the same on every retry. A retry whose
  job is queued or being scored attaches to it (no second copy); one whose job is done gets
  the cached scores (the last ``cache_size`` ids). The id with another body length: 409.
* ``X-Request-Timeout``: seconds the client waits for this answer. A job that every one of
  its requests has stopped waiting for is dropped unscored when the scorer reaches it (504);
  a retry that attaches before then revives it in its place.
* A queue holding ``max_queue`` images answers 503 ``{"error": "busy"}`` with ``Retry-After``
  (whole seconds, for any client) and ``X-Retry-After-Ms`` (the estimate); nothing is queued.
  A request larger than ``max_queue`` is still taken when the queue is empty.
* Stopping (:meth:`RewardServer.stop`) answers 503 ``{"error": "stopping"}`` to everything
  queued or new, so clients score it elsewhere, and waits until the batch being scored is
  answered.
* Every answer carries ``X-Queue-Images``, from which the client picks the least-loaded server.

Batching: one scoring thread takes the oldest waiting job, then, for up to ``max_wait_ms``,
every waiting job (in arrival order) that shares its image size and keeps the batch within
``max_batch`` images. A job that does not fit keeps its place and heads the next batch, rather
than going to the back of the queue. Scores are those of the reward on the concatenated
batch; rewards here score each image on its own, so a request's scores do not depend on what
it was batched with (tested).
"""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rewards.remote import decode_request, encode_scores, prompt_from_wire
from rewards.serve_queue import BatchingScorer, Busy, IdConflict, Stopping, budget_from_header

GRACE_S = 1.0  # a handler waits this long past its client's timeout, then gives up on it


class _Handler(BaseHTTPRequestHandler):
    """The endpoints (module docstring); :func:`make_handler` sets the scorer and name."""

    scorer: BatchingScorer
    reward_name: str

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/health":
            health = self.scorer.health()
            self._send(
                200 if health["ok"] else 503, json.dumps({"reward": self.reward_name, **health}).encode()
            )
        else:
            self._send(404, f"no GET endpoint {self.path}; use GET /health".encode())

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        try:
            if self.path == "/info":
                self._send(200, json.dumps({"reward": self.reward_name}).encode())
            elif self.path == "/check":
                self._send(200, self._check(body))
            elif self.path == "/score":
                with self.scorer.answering_one():
                    self._score(body)
            else:
                self._send(404, f"no endpoint {self.path}; use /info, /check or /score".encode())
        except Exception as err:
            self._send(500, f"{type(err).__name__}: {err}".encode())

    def _score(self, body: bytes) -> None:
        rid = self.headers.get("X-Request-Id") or None
        try:
            budget = budget_from_header(self.headers.get("X-Request-Timeout"))
            job = self.scorer.attach(rid, len(body), budget) if rid else None
            if job is None:
                images, prompts = decode_request(body)
                job = self.scorer.submit(images, prompts, rid, len(body), budget)
        except Busy as busy:
            return self._refuse("busy", busy.retry_after)
        except Stopping:
            return self._refuse("stopping", 0.0)
        except IdConflict as err:
            return self._send(409, str(err).encode())
        except ValueError as err:
            return self._send(400, f"ValueError: {err}".encode())
        if not job.done.wait(None if budget is None else budget + GRACE_S):
            self.close_connection = True  # the client gave up long ago: nobody to answer
            return None
        if job.status == 503:
            return self._refuse("stopping", 0.0)
        if job.error is not None:
            return self._send(job.status, job.error.encode())
        return self._send(200, encode_scores(job.scores, self.reward_name))

    def _refuse(self, why: str, retry_after: float) -> None:
        payload = {"error": why, "retry_after": retry_after, "queued_images": self.scorer.queued_images}
        headers = {"Retry-After": str(max(1, math.ceil(retry_after))), "Connection": "close"}
        headers["X-Retry-After-Ms"] = str(round(retry_after * 1000))
        self._send(503, json.dumps(payload).encode(), headers)

    def _check(self, body: bytes) -> bytes:
        check = getattr(self.scorer.reward, "check_prompts", None)
        prompts = [prompt_from_wire(entry) for entry in json.loads(body)]
        try:
            if check is not None:
                check(prompts)
        except ValueError as err:
            return json.dumps({"ok": False, "error": str(err)}).encode()
        return json.dumps({"ok": True}).encode()

    def _send(self, status: int, payload: bytes, headers: dict | None = None) -> None:
        try:
            self.send_response(status)
            for key, value in {"X-Queue-Images": str(self.scorer.queued_images), **(headers or {})}.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up; it will retry
            self.close_connection = True

    def log_message(self, *args):  # one line per request would flood a training log
        pass


def make_handler(scorer: BatchingScorer, name: str) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_Handler,), {"scorer": scorer, "reward_name": name})


class RewardServer(ThreadingHTTPServer):
    """The HTTP server; ``stop()`` shuts it down for good (``shutdown()`` only stops
    accepting connections, as in http.server)."""

    daemon_threads = True
    # the listen backlog (socketserver's default is 5): a burst of clients beyond it has its
    # connections dropped and retried by TCP a second later; the bounded job queue, which
    # answers 503, is the overload control, not the kernel
    request_queue_size = 128
    scorer: BatchingScorer

    def stop(self, timeout: float = 120.0) -> None:
        """Refuse new work, hand queued work back (503 'stopping') and return once the batch
        being scored has been answered (at most ``timeout`` s): a process that exited
        before that would lose scores its clients would then have scored again elsewhere."""
        self.scorer.stop()
        self.shutdown()
        self.server_close()  # new connections are refused, which clients read as a dead server
        self.scorer.drain(timeout)


def serve(reward, name: str, host: str = "127.0.0.1", port: int = 0, **batching) -> RewardServer:
    """A started server (port 0: a free one, read it from ``server.server_address``);
    ``server.stop()`` stops it. ``batching``: :class:`BatchingScorer`'s arguments."""
    scorer = BatchingScorer(reward, **batching)
    server = RewardServer((host, port), make_handler(scorer, name))
    server.scorer = scorer
    thread = threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True, name="reward-server")
    thread.start()
    return server

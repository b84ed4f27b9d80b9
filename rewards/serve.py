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
import time
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from rewards.prompts import EditPrompt
from rewards.remote import decode_request, encode_scores

GRACE_S = 1.0  # a handler waits this long past its client's timeout, then gives up on it


class Busy(Exception):
    """The queue is full; ``retry_after`` is the estimated wait in seconds."""

    def __init__(self, retry_after: float):
        super().__init__(f"queue full, retry in {retry_after:.2f} s")
        self.retry_after = retry_after


class Stopping(Exception):  # the server is shutting down and takes no more work
    pass


class IdConflict(Exception):  # a request id already used for a different body
    pass


@dataclass
class _Job:
    images: torch.Tensor
    prompts: list
    rid: str | None = None
    size: int = 0  # body length: a cheap check that a retry carries the same batch
    deadline: float = math.inf  # time.monotonic() after which nobody waits for it
    done: threading.Event = field(default_factory=threading.Event)
    scores: dict | None = None
    status: int = 200  # the HTTP status its waiting requests answer with
    error: str | None = None


class BatchingScorer:
    """Scores jobs from many threads in batches on one thread (the reward is not assumed
    to be thread-safe); the queue is bounded, deadlines drop abandoned jobs, and request
    ids make retries idempotent (see the module docstring)."""

    def __init__(
        self,
        reward,
        max_batch: int = 64,
        max_wait_ms: float = 5.0,
        latency_ms_per_image: float = 0.0,
        max_queue: int | None = None,
        cache_size: int = 1024,
    ):
        if int(max_batch) < 1 or (max_queue is not None and int(max_queue) < 1) or max_wait_ms < 0:
            raise ValueError("reward server: max_batch and max_queue must be >= 1, max_wait_ms >= 0")
        self.reward, self.max_batch, self.max_wait = reward, int(max_batch), max_wait_ms / 1000
        self.max_queue = int(max_queue) if max_queue is not None else 4 * self.max_batch
        # benchmarks only: a reward model on another device, which costs wall time, not CPU here
        self.latency = latency_ms_per_image / 1000
        self.cache_size = int(cache_size)
        self.cv = threading.Condition()
        self.waiting: deque[_Job] = deque()
        self.active: dict[str, _Job] = {}  # request id -> its queued or running job
        self.finished: OrderedDict[str, _Job] = OrderedDict()  # request id -> scored job, oldest first
        self.queued_images = self.running_images = 0
        self.seconds_per_image = 0.0  # moving average of scoring time, for Retry-After
        self.stopping = False
        self.answering = 0  # /score requests not yet answered: stop() waits for them
        self.stats = dict(jobs=0, batches=0, scored_images=0, rejected=0, expired=0, attached=0, cached=0)
        self.thread = threading.Thread(target=self._loop, daemon=True, name="reward-scorer")
        self.thread.start()

    @property
    def batches(self) -> int:  # scoring calls made (a test reads it to see batching happen)
        return self.stats["batches"]

    def attach(self, rid: str, size: int, budget: float | None = None) -> _Job | None:
        """The job (queued, running or finished) a retry with this id belongs to, else None."""
        with self.cv:
            return self._attach_locked(rid, size, budget)

    def _attach_locked(self, rid, size, budget) -> _Job | None:
        job = self.active.get(rid) or self.finished.get(rid)
        if job is None:
            return None
        if job.size != size:
            raise IdConflict(f"request id {rid!r} was used for another batch ({job.size} bytes, not {size})")
        if rid in self.finished:
            self.stats["cached"] += 1
        else:
            self.stats["attached"] += 1
            job.deadline = max(job.deadline, _deadline(budget))
        return job

    def submit(self, images, prompts, rid=None, size=0, budget=None) -> _Job:
        """Queue a job (or attach to the one with this id); raises Busy or Stopping."""
        with self.cv:
            if self.stopping:
                raise Stopping("the reward server is shutting down")
            if rid is not None and (job := self._attach_locked(rid, size, budget)) is not None:
                return job  # another attempt queued it while this one decoded its body
            if self.queued_images + len(images) > self.max_queue and self.queued_images:
                self._drop_expired_locked()
            if self.queued_images + len(images) > self.max_queue and self.queued_images:
                self.stats["rejected"] += 1
                raise Busy(self.retry_after())
            job = _Job(images, list(prompts), rid, size, _deadline(budget))
            self.waiting.append(job)
            self.queued_images += len(images)
            self.stats["jobs"] += 1
            if rid is not None:
                self.active[rid] = job
            self.cv.notify_all()
            return job

    def retry_after(self) -> float:
        """Seconds until about one batch's worth of room frees up (0.05 to 30)."""
        images = min(self.queued_images, self.max_batch) + self.running_images
        return min(30.0, max(0.05, images * self.seconds_per_image))

    def health(self) -> dict:
        with self.cv:
            load = dict(queued_jobs=len(self.waiting), queued_images=self.queued_images)
            load.update(
                running_images=self.running_images, max_queue=self.max_queue, max_batch=self.max_batch
            )
            return dict(ok=not self.stopping, **load, **self.stats)

    def stop(self) -> None:
        """Take no more work: every queued job answers 503 'stopping' unscored (the client
        sends it elsewhere); a batch being scored finishes and answers as usual."""
        with self.cv:
            self.stopping = True
            for job in self.waiting:
                self._fail_locked(job, 503, "the reward server is shutting down")
            self.waiting.clear()
            self.queued_images = 0
            self.cv.notify_all()

    @contextmanager
    def answering_one(self):
        """Counts a /score request from its arrival until its answer is written."""
        with self.cv:
            self.answering += 1
        try:
            yield
        finally:
            with self.cv:
                self.answering -= 1
                self.cv.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until the batch being scored is answered; False if
        it was not. After :meth:`stop` nothing else can be waiting."""
        with self.cv:
            return self.cv.wait_for(lambda: not self.answering and not self.running_images, timeout)

    def _fail_locked(self, job: _Job, status: int, error: str) -> None:
        job.status, job.error = status, error
        if job.rid is not None:
            self.active.pop(job.rid, None)
        job.done.set()

    def _drop_expired_locked(self) -> None:
        now = time.monotonic()
        for job in [j for j in self.waiting if j.deadline < now]:
            self.waiting.remove(job)
            self.queued_images -= len(job.images)
            self.stats["expired"] += 1
            self._fail_locked(job, 504, "every request for this batch timed out before it was scored")

    def _take_batch(self) -> list[_Job]:
        """The next batch (empty once stopping). Jobs that do not fit stay where they are."""
        with self.cv:
            while True:
                if self.stopping:
                    return []
                self._drop_expired_locked()
                if self.waiting:
                    break
                self.cv.wait()
            first = self.waiting.popleft()
            jobs, count, shape = [first], len(first.images), first.images.shape[1:]
            seen: set[int] = set()  # jobs already found not to fit (they only fit less later)
            end = time.monotonic() + self.max_wait
            while count < self.max_batch:
                for job in [j for j in self.waiting if id(j) not in seen]:
                    if job.images.shape[1:] == shape and count + len(job.images) <= self.max_batch:
                        self.waiting.remove(job)
                        jobs.append(job)
                        count += len(job.images)
                    else:
                        seen.add(id(job))
                left = end - time.monotonic()
                if count >= self.max_batch or left <= 0 or self.stopping:
                    break
                self.cv.wait(left)  # woken by each new job
            self.queued_images -= count
            self.running_images = count
            return jobs

    def _loop(self) -> None:
        while jobs := self._take_batch():
            start = time.monotonic()
            try:
                images = torch.cat([j.images for j in jobs])
                prompts = [p for j in jobs for p in j.prompts]
                with torch.no_grad():
                    out = self.reward(images, prompts, {})
                time.sleep(self.latency * len(images))
                self._finish(jobs, out, None, time.monotonic() - start)
            except Exception as err:  # every waiting request gets the reward's error, none hangs
                self._finish(jobs, None, f"{type(err).__name__}: {err}", 0.0)

    def _finish(self, jobs: list[_Job], out: dict | None, error: str | None, seconds: float) -> None:
        with self.cv:
            count, self.running_images = self.running_images, 0
            if out is None:
                for job in jobs:
                    self._fail_locked(job, 500, error)
                return
            self.stats["batches"] += 1
            self.stats["scored_images"] += count
            per_image = seconds / max(count, 1)
            self.seconds_per_image = (
                per_image if not self.seconds_per_image else (0.8 * self.seconds_per_image + 0.2 * per_image)
            )
            start = 0
            for job in jobs:
                end = start + len(job.images)
                job.scores = {k: v[start:end] for k, v in out.items()}
                start = end
                if job.rid is not None:
                    self.active.pop(job.rid, None)
                    self.finished[job.rid] = job
                job.images = None  # the cache keeps scores, not pixels
                job.done.set()
            while len(self.finished) > self.cache_size:
                self.finished.popitem(last=False)


def _deadline(budget: float | None) -> float:
    return math.inf if budget is None else time.monotonic() + budget


def _budget(header: str | None) -> float | None:
    if header is None:
        return None
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not value > 0:  # answered 400
        raise ValueError(f"X-Request-Timeout must be a number of seconds > 0, got {header!r}")
    return value


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
            budget = _budget(self.headers.get("X-Request-Timeout"))
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
        prompts = [EditPrompt(text, image) if image else text for text, image in json.loads(body)]
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

"""The reward server's batching queue (:mod:`rewards.serve` is its HTTP side): jobs with
request ids and deadlines, a bound on the images waiting, batches taken in arrival order
without sending a job that does not fit to the back, and scores cached by request id. The
protocol is in :mod:`rewards.serve`'s docstring."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


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
            job.deadline = max(job.deadline, deadline_after(budget))
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
            job = _Job(images, list(prompts), rid, size, deadline_after(budget))
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


def deadline_after(budget: float | None) -> float:
    return math.inf if budget is None else time.monotonic() + budget


def budget_from_header(header: str | None) -> float | None:
    if header is None:
        return None
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not value > 0:  # answered 400
        raise ValueError(f"X-Request-Timeout must be a number of seconds > 0, got {header!r}")
    return value

"""Which scoring replica owns each request id: a retried batch is scored once across replicas.

Ray Serve (:mod:`rewards.serve_ray`) balances a reward's requests over replicas and retries
nothing once a replica has started on a request, so idempotency is ours: the ``remote``
client sends the same ``X-Request-Id`` on every try, and every replica asks this ledger
before scoring it.

* ``claim`` answers ``done`` (scored before: the scores come back, nothing is scored again),
  ``running`` (a live replica is scoring it: wait for it, do not queue a second copy) or
  ``claimed`` (this replica scores it). A claim held by a replica that no longer answers a
  ping (killed under load, its node lost) is taken over, so a lost replica's requests are
  scored by the survivors and never wait forever.
* ``finish`` records the scores (the last ``cache_size`` ids) and wakes the waiters;
  ``release`` gives up a claim unscored (the request expired or the reward raised).
* ``stats`` counts what the load tests and the benchmark check: ``finished`` scorings,
  ``scored_images``, ``rescored`` (an id finished twice: must stay 0), ``cached`` answers,
  ``attached`` waits and ``taken_over`` claims.

The ledger is plain asyncio, tested without Ray; :mod:`rewards.serve_ray` runs it as a
deployment-scoped actor, one per deployment, shared by its replicas. The older
hand-written server kept the same ids in one process (flow_grpo's reward server keeps none).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field


class IdConflict(ValueError):
    """A request id already used for a batch of another size (answered 409)."""


@dataclass
class _Claim:
    owner: object  # whatever the caller identifies itself with; `alive` pings it
    size: int
    done: asyncio.Event = field(default_factory=asyncio.Event)


class RequestLedger:
    """Request id -> the replica scoring it, then its scores (see the module docstring).

    ``alive(owner)`` is an async callable telling whether a claim's owner still answers;
    the Ray actor pings the replica's actor handle, the tests pass a function."""

    def __init__(self, alive=None, cache_size: int = 4096):
        self._alive = alive
        self.cache_size = int(cache_size)
        self.running: dict[str, _Claim] = {}
        self.finished: OrderedDict[str, tuple[int, dict]] = OrderedDict()  # id -> (size, scores)
        self.counts = dict(
            claimed=0, finished=0, scored_images=0, rescored=0, cached=0, attached=0, taken_over=0
        )

    async def claim(self, rid: str, size: int, owner) -> tuple[str, dict | None]:
        """('done', scores), ('running', None) or ('claimed', None); raises IdConflict."""
        if rid in self.finished:
            self._same_size(rid, self.finished[rid][0], size)
            self.counts["cached"] += 1
            return "done", self.finished[rid][1]
        held = self.running.get(rid)
        if held is not None:
            self._same_size(rid, held.size, size)
            alive = held.owner == owner or await self._owner_alive(held.owner)
            if self.running.get(rid) is not held:  # finished or taken over during the ping
                return await self.claim(rid, size, owner)
            if alive:
                self.counts["attached"] += 1
                return "running", None
            self.counts["taken_over"] += 1
            held.done.set()  # wake its waiters: they claim again and find the new owner
        self.running[rid] = _Claim(owner, size)
        self.counts["claimed"] += 1
        return "claimed", None

    async def wait(self, rid: str, timeout: float) -> None:
        """Return once ``rid``'s claim ends (finished, released or taken over) or after
        ``timeout`` seconds; the caller claims again to learn which."""
        held = self.running.get(rid)
        if held is not None:
            try:
                await asyncio.wait_for(held.done.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    async def finish(self, rid: str, size: int, scores: dict, images: int) -> None:
        if rid in self.finished:
            self.counts["rescored"] += 1
        self.counts["finished"] += 1
        self.counts["scored_images"] += int(images)
        self.finished[rid] = (size, scores)
        while len(self.finished) > self.cache_size:
            self.finished.popitem(last=False)
        self._end(rid)

    async def release(self, rid: str, owner) -> None:
        held = self.running.get(rid)
        if held is not None and held.owner == owner:
            self._end(rid)

    async def stats(self) -> dict:
        return dict(self.counts, running=len(self.running))

    def _end(self, rid: str) -> None:
        held = self.running.pop(rid, None)
        if held is not None:
            held.done.set()

    async def _owner_alive(self, owner) -> bool:
        return True if self._alive is None else bool(await self._alive(owner))

    @staticmethod
    def _same_size(rid: str, known: int, size: int) -> None:
        if known != size:
            raise IdConflict(f"request id {rid!r} was used for another batch ({known} bytes, not {size})")

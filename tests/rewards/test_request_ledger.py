"""The request ledger that makes a retried batch score once across replicas: cached
answers, waiting on a live replica's claim, taking over a lost replica's claim, and the
counts the Ray tests and the benchmark read (rewards/request_ledger.py)."""

from __future__ import annotations

import asyncio

import pytest

from rewards.request_ledger import IdConflict, RequestLedger


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_finished_id_is_answered_from_the_cache_and_never_claimed_again():
    async def story():
        ledger = RequestLedger()
        assert await ledger.claim("a", 10, "r1") == ("claimed", None)
        await ledger.finish("a", 10, {"s": [1.0]}, 1)
        assert await ledger.claim("a", 10, "r2") == ("done", {"s": [1.0]})
        with pytest.raises(IdConflict, match="another batch"):
            await ledger.claim("a", 11, "r2")
        return await ledger.stats()

    stats = run(story())
    assert stats["finished"] == 1 and stats["cached"] == 1 and stats["rescored"] == 0
    assert stats["claimed"] == 1 and stats["running"] == 0


def test_a_claim_held_by_a_live_replica_makes_the_retry_wait_for_its_scores():
    async def story():
        ledger = RequestLedger(alive=lambda owner: asyncio.sleep(0, result=True))
        await ledger.claim("a", 4, "r1")
        assert await ledger.claim("a", 4, "r2") == ("running", None)

        async def retry():  # what RewardEndpoint does: wait, then claim again
            while (state := await ledger.claim("a", 4, "r2"))[0] == "running":
                await ledger.wait("a", 5.0)
            return state

        waiting = asyncio.create_task(retry())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await ledger.finish("a", 4, {"s": [2.0]}, 1)
        return await asyncio.wait_for(waiting, 2.0), await ledger.stats()

    state, stats = run(story())
    assert state == ("done", {"s": [2.0]})
    assert stats["finished"] == 1 and stats["attached"] >= 1 and stats["taken_over"] == 0


def test_a_lost_replicas_claim_is_taken_over_and_its_late_finish_counts_as_a_rescore():
    alive = {"r1": True, "r2": True}

    async def is_alive(owner):
        return alive[owner]

    async def story():
        ledger = RequestLedger(alive=is_alive)
        await ledger.claim("a", 4, "r1")
        waiter = asyncio.create_task(ledger.wait("a", 30.0))
        await asyncio.sleep(0)
        alive["r1"] = False
        assert await ledger.claim("a", 4, "r2") == ("claimed", None)
        await asyncio.wait_for(waiter, 1.0)  # the old claim's waiters are woken to claim again
        await ledger.release("a", "r1")  # the lost replica cannot release the new owner's claim
        assert (await ledger.stats())["running"] == 1
        await ledger.finish("a", 4, {"s": [3.0]}, 2)
        await ledger.finish("a", 4, {"s": [3.0]}, 2)  # had the lost replica finished after all
        return await ledger.stats()

    stats = run(story())
    assert stats["taken_over"] == 1 and stats["rescored"] == 1 and stats["scored_images"] == 4


def test_a_released_claim_is_scored_again_and_the_cache_is_bounded():
    async def story():
        ledger = RequestLedger(cache_size=2)
        await ledger.claim("a", 1, "r1")
        await ledger.release("a", "r1")  # expired or the reward raised: nothing cached
        assert await ledger.claim("a", 1, "r2") == ("claimed", None)
        for rid in "abc":
            if rid != "a":
                await ledger.claim(rid, 1, "r2")
            await ledger.finish(rid, 1, {"s": [0.0]}, 1)
        assert list(ledger.finished) == ["b", "c"]  # the oldest id fell out
        return await ledger.claim("a", 1, "r3")

    assert run(story()) == ("claimed", None)

"""Scoring that overlaps the rollout: each decoded chunk goes to the rewards that score in
another process (the ``remote`` reward, :mod:`rewards.remote`; ``vlm_judge`` with
``backend: openai``, :mod:`rewards.vlm_openai`) as soon as it exists, so the reward server
works while this process denoises the next chunk. In-process rewards still score the whole
batch after the rollout, as before; a strategy that does not hand out its chunks
(``on_images``: BranchGRPO trees finish all leaves together) scores after it too."""

from __future__ import annotations

import inspect


def overlap_hook(reward_fn, strategy, prompts: list[str]) -> tuple[dict, list | None]:
    """(extra strategy kwargs, the list the chunks' futures collect in, or None when
    nothing overlaps)."""
    if not reward_fn.scores_elsewhere or "on_images" not in inspect.signature(strategy).parameters:
        return {}, None
    pending: list[dict] = []

    def on_images(indices, images):
        pending.append(reward_fn.submit(images, [prompts[i] for i in indices]))

    return {"on_images": on_images}, pending

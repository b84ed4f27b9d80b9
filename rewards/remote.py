"""Rewards scored by another process: a wire format, a batching HTTP server, and the
``remote`` reward that calls it.

Reward models often want their own GPU, their own environment (GenEval's detector stack,
a VLM judge behind vLLM) or their own machine; flow_grpo, verl-omni and UniRL all serve
rewards from a separate process. ``scripts/serve_rewards.py --reward NAME`` serves any
registered reward; a config entry ``{name: remote, args: {url: http://HOST:PORT}}`` scores
through it. The wire carries the images as a safetensors tensor (``wire_dtype`` float32 by
default, so scores equal the in-process ones; uint8 or float16 to save bandwidth) and the
prompts as JSON; an :class:`~rewards.prompts.EditPrompt` travels as its text and its image
path, which must then be readable on the server's machine.

Failures are never a silent zero: a server that is down, too slow or answers with garbage
(not JSON, wrong keys, wrong length) is retried ``retries`` times with a growing pause,
then raises :class:`RemoteRewardError` naming the URL, what went wrong and the fix.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import torch

from rewards.images import to_tensor_batch
from rewards.prompts import EditPrompt

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "uint8": torch.uint8}


class RemoteRewardError(RuntimeError):
    """The reward server could not score a batch; the message names the URL and the fix."""


# -- the wire format -----------------------------------------------------------------------
def encode_request(images, prompts: list[str], wire_dtype: str = "float32") -> bytes:
    """safetensors bytes: the images as one tensor, the prompts (text, image path) as metadata."""
    from safetensors.torch import save

    batch = to_tensor_batch(images).detach().cpu().float()
    if wire_dtype == "uint8":
        batch = (batch.clamp(0, 1) * 255).round().to(torch.uint8)
    else:
        batch = batch.to(WIRE_DTYPES[wire_dtype])
    wire_prompts = [[str(p), getattr(p, "image", None)] for p in prompts]
    return save({"images": batch.contiguous()}, metadata={"prompts": json.dumps(wire_prompts)})


def decode_request(body: bytes) -> tuple[torch.Tensor, list[str]]:
    """(float images in [0, 1], prompts) from :func:`encode_request`'s bytes."""
    from safetensors.torch import load

    tensors = load(body)
    images = tensors["images"]
    images = images.float() / 255 if images.dtype == torch.uint8 else images.float()
    metadata = _metadata(body)
    prompts = [EditPrompt(text, image) if image else text for text, image in json.loads(metadata["prompts"])]
    return images, prompts


def _metadata(body: bytes) -> dict:
    """The safetensors header's ``__metadata__`` (8-byte little-endian length, then JSON)."""
    length = int.from_bytes(body[:8], "little")
    return json.loads(body[8 : 8 + length]).get("__metadata__", {})


def encode_scores(scores: dict[str, torch.Tensor], name: str) -> bytes:
    out = {k: [float(x) for x in v.detach().float().cpu().tolist()] for k, v in scores.items()}
    return json.dumps({"reward": name, "scores": out}).encode()


# -- the client ----------------------------------------------------------------------------
class RemoteReward:
    """Registered as ``remote``: POSTs each batch to a reward server's ``/score``.

    With ``overlap`` (the default) the trainer sends each rollout chunk as soon as it is
    decoded (:meth:`submit`), so the server scores while the next chunk denoises.

    The optimised score is the served reward's own (its name is fetched from ``/info`` at
    start-up, which also fails fast when nothing listens at ``url``); the served reward's
    other scores are logged under their own names. ``check_prompts`` asks the server, so a
    prompt the served reward cannot score fails at start-up as it would in-process.
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        timeout: float = 120.0,
        retries: int = 2,
        backoff: float = 1.0,
        wire_dtype: str = "float32",
        overlap: bool = True,
    ):
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"remote: wire_dtype must be one of {', '.join(WIRE_DTYPES)}, got '{wire_dtype}'"
            )
        if not (timeout > 0 and retries >= 0 and backoff >= 0):
            raise ValueError("remote: timeout must be > 0, retries and backoff >= 0")
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.wire_dtype = wire_dtype
        self.overlaps_rollout = bool(overlap)  # false: score after the rollout, as in-process rewards
        self.served = self._info()["reward"]

    def _info(self) -> dict:
        return self._json(self._post("/info", b"{}", "application/json"), ("reward",))

    def check_prompts(self, prompts: list[str]) -> None:
        wire = [[str(p), getattr(p, "image", None)] for p in prompts]
        answer = self._json(self._post("/check", json.dumps(wire).encode(), "application/json"), ("ok",))
        if not answer["ok"]:
            raise ValueError(
                f"reward server {self.url} ({self.served}): {answer.get('error', 'prompts refused')}"
            )

    def submit(self, images, prompts: list[str]):
        """Score in a background thread (a Future of ``__call__``'s dict): the request and the
        server's scoring overlap whatever this process does next, e.g. the next rollout chunk."""
        from concurrent.futures import ThreadPoolExecutor

        if getattr(self, "_pool", None) is None:
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="remote-reward")
        return self._pool.submit(self.__call__, to_tensor_batch(images).detach().cpu().clone(), list(prompts))

    def __call__(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        count = to_tensor_batch(images).shape[0]
        if len(prompts) != count:
            raise ValueError(f"remote: {count} images but {len(prompts)} prompts")
        body = encode_request(images, list(prompts), self.wire_dtype)
        answer = self._json(self._post("/score", body, "application/octet-stream"), ("reward", "scores"))
        scores = answer["scores"]
        if not isinstance(scores, dict) or self.served not in scores:
            raise RemoteRewardError(
                f"reward server {self.url} answered without its reward '{self.served}' "
                f"(keys {sorted(scores) if isinstance(scores, dict) else scores})"
            )
        out = {}
        for key, values in scores.items():
            if not isinstance(values, list) or len(values) != count:
                raise RemoteRewardError(
                    f"reward server {self.url} answered {key!r} with "
                    f"{len(values) if isinstance(values, list) else repr(values)} values for {count} images; "
                    "is it serving the reward you configured?"
                )
            out[self.name if key == self.served else key] = torch.tensor(values, dtype=torch.float32)
        if not torch.isfinite(out[self.name]).all():
            raise RemoteRewardError(f"reward server {self.url} returned non-finite '{self.served}' scores")
        return out

    # -- transport ------------------------------------------------------------------------
    def _post(self, path: str, body: bytes, content_type: str) -> bytes:
        """POST with bounded retries; the last failure becomes one RemoteRewardError."""
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(
                self.url + path, data=body, headers={"Content-Type": content_type}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return response.read()
            except (
                urllib.error.HTTPError
            ) as err:  # the server answered: an error of its own, not worth retrying
                detail = err.read().decode(errors="replace")[:300]
                raise RemoteRewardError(
                    f"reward server {self.url}{path} answered HTTP {err.code}: {detail}"
                ) from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
                last = err
        reason = getattr(last, "reason", last)
        raise RemoteRewardError(
            f"reward server {self.url} did not answer {path} after {self.retries + 1} tries ({reason}); "
            "start it with `python scripts/serve_rewards.py --reward NAME --port PORT` or fix the "
            f"reward's args.url (timeout {self.timeout:g} s per try)"
        ) from None

    def _json(self, raw: bytes, keys: tuple[str, ...]) -> dict:
        try:
            answer = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RemoteRewardError(
                f"reward server {self.url} answered something that is not JSON ({raw[:80]!r}); "
                "is the URL a diffrl reward server?"
            ) from None
        if not isinstance(answer, dict) or any(k not in answer for k in keys):
            raise RemoteRewardError(
                f"reward server {self.url} answered without {list(keys)}: {str(answer)[:120]}"
            )
        return answer

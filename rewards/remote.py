"""Rewards scored by another process: a wire format and the ``remote`` reward that sends
batches to a reward service (:mod:`rewards.serve_ray`, Ray Serve).

Reward models often want their own GPU, their own environment (GenEval's detector stack)
or their own machine (a VLM judge behind vLLM or SGLang needs no service of ours:
``vlm_judge`` with ``backend: openai``, :mod:`rewards.vlm_openai`); flow_grpo, verl-omni and
UniRL all serve rewards from a separate process. ``diffrl-serve --reward NAME`` deploys any
registered reward on Ray Serve; a config entry ``{name: remote, args: {url:
http://HOST:PORT}}`` scores through its HTTP proxy, or ``{name: remote, args: {app:
reward-NAME}}`` through a Serve handle from a process inside the same Ray cluster (the same
bytes, without the HTTP hop). The wire carries the images as a safetensors tensor
(``wire_dtype`` float32 by default, so scores equal the in-process ones; uint8 or float16
to save bandwidth) and the prompts as JSON; an :class:`~rewards.prompts.EditPrompt` travels
as its text and its image path, which must then be readable on the service's machine.

Failures are never a silent zero: a service that is down, too slow, or loses the replica a
batch was on (a 500 without the protocol's ``X-Diffrl-Error``) is retried ``retries`` times
with a doubling pause, then raises :class:`RemoteRewardError` naming the URL, what went
wrong and the fix; an answer that is garbage (not JSON, wrong keys, wrong length) or the
reward's own error raises at once.

Every batch carries a request id (``X-Request-Id``, the same on every try) and the seconds
this try waits (``X-Request-Timeout``), so a retry is scored once however many replicas saw
it (:mod:`rewards.request_ledger`), and a job nobody waits for any more is dropped unscored.
Balancing over replicas is Ray Serve's; ``urls: [...]`` lists several entry points (proxies
of one cluster, or separate services of the same reward): batches go to them in turn, one
that refuses or drops a connection is skipped for ``revive_after`` seconds and the batch
goes to another at once (no pause, no try used), and one that answers 503 (back-pressure)
is left alone for its ``Retry-After`` while the others take the work; when every one is
busy the client waits that long and sends again, within the try's ``timeout``.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.error
import urllib.request
import uuid

import torch

from rewards.images import to_tensor_batch
from rewards.prompts import AnnotatedPrompt, EditPrompt

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
    wire_prompts = [wire_prompt(p) for p in prompts]
    return save({"images": batch.contiguous()}, metadata={"prompts": json.dumps(wire_prompts)})


def wire_prompt(prompt: str) -> list:
    """[text, image path or None], and the line's metadata third where the prompt carries it
    (GenEval's include / exclude travel to a served ``geneval``)."""
    meta = getattr(prompt, "metadata", None)
    return [str(prompt), getattr(prompt, "image", None), *([meta] if meta else [])]


def prompt_from_wire(entry: list) -> str:
    """The prompt :func:`wire_prompt` sent: a string, an EditPrompt or an AnnotatedPrompt."""
    text, image, *meta = entry
    if image:
        return EditPrompt(text, image)
    return AnnotatedPrompt(text, meta[0]) if meta else text


def decode_request(body: bytes) -> tuple[torch.Tensor, list[str]]:
    """(float images in [0, 1], prompts) from :func:`encode_request`'s bytes."""
    from safetensors.torch import load

    tensors = load(body)
    images = tensors["images"]
    images = images.float() / 255 if images.dtype == torch.uint8 else images.float()
    metadata = _metadata(body)
    prompts = [prompt_from_wire(entry) for entry in json.loads(metadata["prompts"])]
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
    """Registered as ``remote``: sends each batch to a reward service's ``/score`` over HTTP
    (``url``, or several entry points in turn, ``urls``) or through a Ray Serve handle
    (``app``, from a process in the same Ray cluster: ``ray_address``, default ``auto``).

    With ``overlap`` (the default) the trainer sends each rollout chunk as soon as it is
    decoded (:meth:`submit`), so the service scores while the next chunk denoises.

    The optimised score is the served reward's own (its name is fetched from every entry
    point's ``/info`` at start-up, which also fails fast when nothing listens or two entry
    points serve different rewards); the served reward's other scores are logged under
    their own names. ``check_prompts`` asks the service, so a prompt the served reward cannot
    score fails at start-up as it would in-process. ``stats`` counts requests sent, retries
    (tries after the first), busy (503 answers), failovers, lost (a replica lost mid-request)
    and timeouts.
    """

    name = "remote"

    def __init__(
        self,
        url: str | None = None,
        timeout: float = 120.0,
        retries: int = 2,
        backoff: float = 1.0,
        wire_dtype: str = "float32",
        overlap: bool = True,
        urls: list[str] | None = None,
        revive_after: float = 10.0,
        app: str | None = None,
        ray_address: str = "auto",
    ):
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"remote: wire_dtype must be one of {', '.join(WIRE_DTYPES)}, got '{wire_dtype}'"
            )
        if not (timeout > 0 and retries >= 0 and backoff >= 0 and revive_after >= 0):
            raise ValueError("remote: timeout must be > 0, retries, backoff and revive_after >= 0")
        if app is not None:
            if url is not None or urls is not None:
                raise ValueError(
                    "remote: give args.app (a Ray Serve handle) or args.url / args.urls, not both"
                )
            self.urls = [f"serve-app:{app}"]
            self.handle = _ServeHandle(app, ray_address)
        else:
            self.urls = _server_urls(url, urls)
            self.handle = None
        self.url = self.urls[0]  # the one entry point of a `url` config, and older callers' attribute
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.wire_dtype = wire_dtype
        self.overlaps_rollout = bool(overlap)  # false: score after the rollout, as in-process rewards
        self.servers = _Servers(self.urls, float(revive_after))
        self.stats = self.servers.stats
        self.served = self._info()

    def _info(self) -> str:
        served = {
            u: self._json(self._post("/info", b"{}", "application/json", pin=u), ("reward",), u)["reward"]
            for u in self.urls
        }
        if len(set(served.values())) > 1:
            raise ValueError(
                f"remote: the servers in args.urls serve different rewards ({served}); "
                "give each reward its own `remote` entry with a label"
            )
        return served[self.url]

    def check_prompts(self, prompts: list[str]) -> None:
        wire = [wire_prompt(p) for p in prompts]
        url, raw = self._exchange("/check", json.dumps(wire).encode(), "application/json")
        answer = self._json(raw, ("ok",), url)
        if not answer["ok"]:
            raise ValueError(f"reward server {url} ({self.served}): {answer.get('error', 'prompts refused')}")

    def submit(self, images, prompts: list[str]):
        """Score in a background thread (a Future of ``__call__``'s dict): the request and the
        service's scoring overlap whatever this process does next, e.g. the next rollout chunk."""
        from concurrent.futures import ThreadPoolExecutor

        if getattr(self, "_pool", None) is None:
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="remote-reward")
        return self._pool.submit(self.__call__, to_tensor_batch(images).detach().cpu().clone(), list(prompts))

    def __call__(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        count = to_tensor_batch(images).shape[0]
        if len(prompts) != count:
            raise ValueError(f"remote: {count} images but {len(prompts)} prompts")
        body = encode_request(images, list(prompts), self.wire_dtype)
        url, raw = self._exchange("/score", body, "application/octet-stream", uuid.uuid4().hex)
        scores = self._json(raw, ("reward", "scores"), url)["scores"]
        if not isinstance(scores, dict) or self.served not in scores:
            raise RemoteRewardError(
                f"reward server {url} answered without its reward '{self.served}' "
                f"(keys {sorted(scores) if isinstance(scores, dict) else scores})"
            )
        out = {}
        for key, values in scores.items():
            if not isinstance(values, list) or len(values) != count:
                raise RemoteRewardError(
                    f"reward server {url} answered {key!r} with "
                    f"{len(values) if isinstance(values, list) else repr(values)} values for {count} images; "
                    "is it serving the reward you configured?"
                )
            out[self.name if key == self.served else key] = torch.tensor(values, dtype=torch.float32)
        if not torch.isfinite(out[self.name]).all():
            raise RemoteRewardError(f"reward server {url} returned non-finite '{self.served}' scores")
        return out

    # -- transport ------------------------------------------------------------------------
    def _post(self, path: str, body: bytes, content_type: str, pin: str | None = None) -> bytes:
        """POST with bounded retries (to ``pin`` only, if given); the answer's bytes."""
        return self._exchange(path, body, content_type, pin=pin)[1]

    def _exchange(self, path, body, content_type, request_id=None, pin=None) -> tuple[str, bytes]:
        """(the entry point that answered, its bytes) after up to ``retries + 1`` tries with a
        doubling pause between them; the last failure becomes one RemoteRewardError."""
        last, sticky = None, pin
        for attempt in range(self.retries + 1):
            if attempt:
                self.servers.count("retries")
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                return self._try(path, body, content_type, request_id, sticky, pin)
            except _TryFailed as failed:
                last, sticky = failed, pin or failed.url
        where = pin or (self.url if len(self.urls) == 1 else f"{self.urls}")
        raise RemoteRewardError(
            f"reward server {where} did not answer {path} after {self.retries + 1} tries ({last}); "
            "start it with `diffrl-serve --reward NAME --port PORT` or fix the reward's "
            f"args.url / args.urls / args.app (timeout {self.timeout:g} s per try)"
        ) from None

    def _try(self, path, body, content_type, request_id, url, pin) -> tuple[str, bytes]:
        """One try, at most ``timeout`` seconds: 503 busy is waited out and a dead entry point
        is failed over within it (to ``pin`` only, if given). Raises _TryFailed (worth
        another try) or RemoteRewardError (not)."""
        end, reason = time.monotonic() + self.timeout, "no time left"
        while True:
            wait = 0.0
            if url is None:
                url, wait = self.servers.pick(only=pin)
            left = end - time.monotonic()
            if left <= wait:
                raise _TryFailed(reason, None)
            if url is None:  # every entry point is busy: wait out the shortest Retry-After, then pick
                time.sleep(wait * random.uniform(1.0, 1.25))  # spread out the clients coming back
                continue
            headers = {"Content-Type": content_type}
            if request_id is not None:
                headers.update({"X-Request-Id": request_id, "X-Request-Timeout": f"{max(left, 0.001):.3f}"})
            self.servers.count("requests")
            try:
                status, answer_headers, payload = self._send(url, path, body, headers, left)
            except TimeoutError:
                self.servers.count("timeouts")
                raise _TryFailed(f"{url}: no answer within {left:.3g} s", url) from None
            except _Unreachable as err:
                self._failover(url, f"{url}: {err}", pin)
                url = None
                continue
            if status == 200:
                return url, payload
            reason = self._refused(url, path, status, answer_headers, payload)  # raises unless busy
            url = None

    def _send(self, url, path, body, headers, timeout) -> tuple[int, dict, bytes]:
        """(status, lower-case headers, payload) from one entry point; raises TimeoutError
        or _Unreachable."""
        if self.handle is not None:
            return self.handle.send(path, body, headers, timeout)
        request = urllib.request.Request(url + path, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, _lower(response.headers), response.read()
        except urllib.error.HTTPError as err:
            with err:
                return err.code, _lower(err.headers), err.read()
        except TimeoutError:
            raise
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            if isinstance(getattr(err, "reason", None), TimeoutError):
                raise TimeoutError from None
            raise _Unreachable(getattr(err, "reason", None) or type(err).__name__) from None

    def _failover(self, url: str, reason: str, pin: str | None) -> None:
        """An entry point that refused or dropped the connection: skip it; raise when none is left."""
        self.servers.dead(url)
        if pin is not None or not self.servers.any_alive():
            raise _TryFailed(reason, None)
        self.servers.count("failovers")  # the batch goes to another entry point with the same id

    def _refused(self, url: str, path: str, status: int, headers: dict, payload: bytes) -> str:
        """The reason of a 503 (back-pressure: that entry point is left alone for its
        Retry-After); raises _TryFailed for what is worth another try (504: expired before
        it was scored; a 500 from the engine, not the protocol: the replica was lost) and
        RemoteRewardError for the rest (the reward's own error, a bad request)."""
        detail = payload.decode(errors="replace")[:300]
        if status == 504 or (status in (500, 502) and "x-diffrl-error" not in headers):
            self.servers.count("lost" if status != 504 else "timeouts")
            raise _TryFailed(f"{url}: HTTP {status}: {detail}", url)
        if status != 503:
            raise RemoteRewardError(f"reward server {url}{path} answered HTTP {status}: {detail}")
        self.servers.count("busy")
        wait = headers.get("x-retry-after-ms")
        wait = float(wait) / 1000 if wait else float(headers.get("retry-after") or 1)
        self.servers.busy(url, wait)
        return f"{url}: 503 busy (queue full) until the try's {self.timeout:g} s ran out"

    def _json(self, raw: bytes, keys: tuple[str, ...], url: str | None = None) -> dict:
        url = url or self.url
        try:
            answer = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RemoteRewardError(
                f"reward server {url} answered something that is not JSON ({raw[:80]!r}); "
                "is the URL a diffrl reward server?"
            ) from None
        if not isinstance(answer, dict) or any(k not in answer for k in keys):
            raise RemoteRewardError(f"reward server {url} answered without {list(keys)}: {str(answer)[:120]}")
        return answer


class _TryFailed(Exception):
    """A try that is worth another: ``url`` is where the retry must go (its job may still be
    queued there), None for any entry point."""

    def __init__(self, reason: str, url: str | None):
        super().__init__(reason)
        self.url = url


class _Unreachable(Exception):
    """The connection was refused or dropped: the entry point is down (fail over)."""


def _lower(headers) -> dict:
    return {k.lower(): v for k, v in (headers or {}).items()}


class _ServeHandle:
    """The handle path: the same request bytes to the deployment's ``answer``, through Ray
    (``ray.init(address=ray_address)`` unless this process is already connected)."""

    def __init__(self, app: str, ray_address: str):
        try:
            import ray
            from ray import serve
        except ImportError:
            raise ValueError("remote: args.app needs Ray Serve: pip install 'diffrl[serve]'") from None
        if not ray.is_initialized():
            ray.init(address=ray_address, log_to_driver=False)
        try:
            self.handle = serve.get_app_handle(app)
        except Exception as err:  # Ray raises RayServeException for an unknown app
            raise ValueError(
                f"remote: no Ray Serve app {app!r} in this cluster ({err}); deploy it "
                "with `diffrl-serve --reward NAME --address auto`"
            ) from None

    def send(self, path: str, body: bytes, headers: dict, timeout: float) -> tuple[int, dict, bytes]:
        from ray import exceptions as ray_errors
        from ray.serve.exceptions import BackPressureError

        response = self.handle.answer.remote("POST", path, body, headers)
        try:
            out = response.result(timeout_s=timeout)
        except BackPressureError:
            return 503, {}, b"busy: max_queued_requests reached"
        except (ray_errors.GetTimeoutError, TimeoutError):
            response.cancel()  # as an HTTP client hanging up: Serve drops it if still queued
            raise TimeoutError from None
        except ray_errors.RayActorError as err:  # the replica died mid-request
            return 500, {}, f"replica lost: {type(err).__name__}".encode()
        return out.status, _lower(out.headers), out.payload


def _server_urls(url, urls) -> list[str]:
    if (url is None) == (urls is None):
        raise ValueError(
            "remote: give args.url (one server), args.urls (a list of servers) or args.app "
            f"(a Ray Serve handle), exactly one of them (got url={url!r}, urls={urls!r})"
        )
    if urls is None:
        urls = [url]
    if isinstance(urls, str) or not urls or not all(isinstance(u, str) and u for u in urls):
        raise ValueError(f"remote: args.urls must be a non-empty list of server URLs, got {urls!r}")
    out = [u.rstrip("/") for u in urls]
    if len(set(out)) != len(out):
        raise ValueError(f"remote: args.urls names a server twice: {urls}")
    return out


class _Servers:
    """Where the next batch goes: the entry points in turn, skipping one that refused or
    dropped a connection for ``revive_after`` s (tried anyway when all have) and one that
    answered 503 until its Retry-After. Thread-safe: ``submit`` sends chunks from several
    threads. Balancing over replicas is Ray Serve's, behind each entry point."""

    def __init__(self, urls: list[str], revive_after: float):
        self.urls, self.revive_after, self.lock = urls, revive_after, threading.Lock()
        self.dead_until = dict.fromkeys(urls, 0.0)
        self.busy_until = dict.fromkeys(urls, 0.0)
        self.turn = 0
        self.stats = dict(requests=0, retries=0, busy=0, failovers=0, lost=0, timeouts=0)

    def pick(self, only: str | None = None) -> tuple[str | None, float]:
        """(an entry point, 0), or (None, seconds until the first busy one takes work again)."""
        now, urls = time.monotonic(), [only] if only else self.urls
        with self.lock:
            alive = [u for u in urls if self.dead_until[u] <= now]
            if not alive:  # all failed recently: try the one that failed longest ago
                return min(urls, key=self.dead_until.get), 0.0
            free = [u for u in alive if self.busy_until[u] <= now]
            if not free:
                return None, min(self.busy_until[u] for u in alive) - now
            self.turn += 1
            return free[self.turn % len(free)], 0.0

    def any_alive(self) -> bool:
        now = time.monotonic()
        with self.lock:
            return any(self.dead_until[u] <= now for u in self.urls)

    def dead(self, url: str) -> None:
        with self.lock:
            self.dead_until[url] = time.monotonic() + self.revive_after

    def busy(self, url: str, seconds: float) -> None:
        with self.lock:
            self.busy_until[url] = time.monotonic() + max(0.0, seconds)

    def count(self, key: str) -> None:
        with self.lock:
            self.stats[key] += 1

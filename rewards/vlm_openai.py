"""``vlm_judge`` with ``backend: openai``: the judge runs behind an OpenAI-compatible server
(vLLM's ``vllm serve``, SGLang's ``python -m sglang.launch_server``, or a hosted API) and is
asked through ``POST {base_url}/chat/completions``, one request per image, with the
standard library only (urllib and a thread pool; no ``openai`` package needed).

Each request carries the image as a PNG data URI, then the question (the layout of
Flow-Factory's ``vllm_evaluate``, X-GenGroup/Flow-Factory a0b2bc5a,
``src/flow_factory/rewards/vllm_evaluate.py``, and of flow_grpo's and verl-omni's
UnifiedReward clients), at temperature 0. The ``yes_no`` and ``score`` modes ask for one
token with ``logprobs`` and ``top_logprobs`` and apply the in-process backend's maths
(:class:`rewards.vlm_answers.AnswerFormat`) to the returned top-k: an answer outside the
top-k counts 0 (its probability is below the smallest one listed), and an image whose
top-k holds none of the answers is an error, not a 0 as in Flow-Factory. vLLM refuses a
``top_logprobs`` above its ``--max-logprobs`` (20 by default). ``text`` mode asks for up to
``max_tokens`` tokens (512 by default) and parses the written answer.

The model name is checked against ``GET {base_url}/models`` at start-up. At most
``max_concurrent`` requests are in flight (the pool's size); like the ``remote`` reward,
the trainer hands each decoded rollout chunk to :meth:`OpenAIVLMJudge.submit` (with
``overlap``), so the server judges while the next chunk denoises. Overload and passing
faults (HTTP 408, 429, 5xx, refused or timed-out connections) are retried ``retries``
times with a doubling pause; any other HTTP error is not retried. Every failure is one
:class:`~rewards.remote.RemoteRewardError` naming the URL and the fix, never a 0.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from rewards.clip_common import reward_images, reward_prompts
from rewards.images import to_uint8_hwc
from rewards.remote import RemoteRewardError
from rewards.vlm_answers import AnswerFormat, VLMAnswerError, check_max_tokens, check_template, question

RETRY_STATUS = (408, 429, 500, 502, 503, 504)  # overload or a passing fault: worth another try
SERVE_HINT = (
    "start the judge with e.g. `vllm serve Qwen/Qwen2.5-VL-7B-Instruct --port 8000` "
    "(base_url http://127.0.0.1:8000/v1) or `python -m sglang.launch_server --model-path "
    "Qwen/Qwen2.5-VL-7B-Instruct --port 30000` (base_url http://127.0.0.1:30000/v1)"
)


class OpenAIVLMJudge:
    """``reward(images, prompts) -> {"vlm_judge": score in [0, 1], ...}`` from a served judge.

    Args:
        base_url: the server's OpenAI API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model's name, as ``GET /v1/models`` lists it.
        template, template_source, mode, yes, no, low, high, pattern, unparsed: as the
            transformers backend
            (:class:`rewards.vlm_judge.TransformersVLMJudge`); ``yes`` / ``no`` are matched
            against the server's token strings exactly.
        max_tokens: 1 for ``yes_no`` / ``score``; ``text``'s answer budget (512 by default).
        top_logprobs: how many first tokens the server lists (vLLM: at most ``--max-logprobs``).
        max_concurrent: requests in flight at most.
        timeout, retries, backoff: seconds per try, extra tries, first pause (doubling).
        api_key_env: the name of an environment variable holding the server's API key
            (sent as a bearer token); keys stay out of configs and run directories.
        overlap: score each rollout chunk while the next one denoises.
    """

    name = "vlm_judge"
    differentiable = False

    def __init__(
        self,
        base_url: str | None = None,
        model: str | None = None,
        template: str | None = None,
        mode: str = "yes_no",
        yes=("Yes",),
        no=("No",),
        low: int = 1,
        high: int = 5,
        pattern: str | None = None,
        unparsed: str = "error",
        template_source: str | None = None,
        max_tokens: int | None = None,
        top_logprobs: int = 20,
        max_concurrent: int = 32,
        timeout: float = 120.0,
        retries: int = 3,
        backoff: float = 1.0,
        api_key_env: str | None = None,
        overlap: bool = True,
    ):
        self.format = AnswerFormat.from_args(mode, yes, no, low, high, pattern, unparsed)
        self.template, self.mode = check_template(template, mode, template_source), mode
        self.max_tokens = check_max_tokens(max_tokens, mode)
        self.base_url, self.model = check_url(base_url), check_model_name(model)
        self.top_logprobs = int(top_logprobs)
        if mode != "text" and self.top_logprobs < len(self.format.answers):
            raise ValueError(
                f"vlm_judge: top_logprobs {top_logprobs} cannot list all {len(self.format.answers)} answers "
                f"{list(self.format.answers)}; raise it (vLLM allows up to its --max-logprobs, 20 by default)"
            )
        if not (int(max_concurrent) >= 1 and timeout > 0 and int(retries) >= 0 and backoff >= 0):
            raise ValueError("vlm_judge: max_concurrent must be >= 1, timeout > 0, retries and backoff >= 0")
        self.max_concurrent, self.timeout = int(max_concurrent), float(timeout)
        self.retries, self.backoff = int(retries), float(backoff)
        self.headers = {"Content-Type": "application/json", **auth_header(api_key_env)}
        self.overlaps_rollout = bool(overlap)  # false: score after the rollout, as in-process rewards
        self.served = self._check_served_model()
        self._pool = ThreadPoolExecutor(max_workers=self.max_concurrent, thread_name_prefix="vlm-judge")

    def _check_served_model(self) -> list[str]:
        answer = self._request("GET", "/models")
        data = answer.get("data")
        if not isinstance(data, list):
            raise RemoteRewardError(
                f"{self.base_url}/models answered without a model list ({str(answer)[:120]}); "
                "is base_url an OpenAI-compatible API root (usually ending in /v1)?"
            )
        served = [str(m.get("id")) for m in data if isinstance(m, dict)]
        if self.model not in served:
            raise ValueError(
                f"vlm_judge: the server at {self.base_url} serves {served}, not {self.model!r}; set model to "
                "one of them (vLLM and SGLang name a model by --served-model-name, else by its path)"
            )
        return served

    # -- scoring --------------------------------------------------------------------------
    def submit(self, images, prompts: list[str]) -> PendingScores:
        """Send every image's request now (at most ``max_concurrent`` in flight); the result
        is the batch's scores. The images are copied to the host first, so the caller may
        overwrite them."""
        arrays = uint8_images(images, self.name)
        prompts = reward_prompts(prompts, len(arrays), self.name)
        futures = [self._pool.submit(self._ask, a, p, i) for i, (a, p) in enumerate(zip(arrays, prompts))]
        return PendingScores(futures, self._assemble)

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        return self.submit(images, prompts).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def request_body(self, png: bytes, prompt: str) -> dict:
        image = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
        text = question(self.template, prompt, self.format.low, self.format.high)
        content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }
        if self.mode != "text":
            body.update(logprobs=True, top_logprobs=self.top_logprobs)
        return body

    def _ask(self, array: np.ndarray, prompt: str, index: int):
        """One image: its answers' probabilities, or (text, cut at max_tokens) in text mode."""
        body = json.dumps(self.request_body(png_bytes(array), prompt)).encode()
        choice = first_choice(self._request("POST", "/chat/completions", body), self.base_url)
        if self.mode == "text":
            text = (choice.get("message") or {}).get("content")
            if not isinstance(text, str):
                raise RemoteRewardError(f"{self.base_url} answered image {index} without a message: {choice}")
            return text, choice.get("finish_reason") == "length"
        top = first_top_logprobs(choice, self.base_url)
        probs = answer_probs(top, self.format.answers)
        if not any(probs):
            listed = [e["token"] for e in top[:8]]
            raise VLMAnswerError(
                f"vlm_judge: none of the answers {list(self.format.answers)} is among the server's top "
                f"{len(top)} first tokens for image {index} (it listed {listed}); the judge is not answering "
                "in the asked format: make the template ask for these answers, list the tokens the model "
                "uses (yes / no), or raise top_logprobs (vLLM: up to --max-logprobs, 20 by default)"
            )
        return probs

    def _assemble(self, parts: list) -> dict[str, torch.Tensor]:
        if self.mode == "text":
            return self.format.read_texts([text for text, _ in parts], [cut for _, cut in parts])
        scores = self.format.read_probs(torch.tensor(parts, dtype=torch.float64))
        return {k: v.float() for k, v in scores.items()}

    # -- transport ------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: bytes | None = None) -> dict:
        """One JSON request with bounded retries on overload and passing faults."""
        url, last = self.base_url + path, None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=body, headers=self.headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as err:
                detail = " ".join(err.read().decode(errors="replace").split())[:300]
                if err.code not in RETRY_STATUS:  # the server refused this request: another try won't help
                    raise RemoteRewardError(
                        f"{method} {url} answered HTTP {err.code}: {detail}{http_hint(err.code, detail)}"
                    ) from None
                last = f"HTTP {err.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
                last = str(getattr(err, "reason", err))
            else:
                return parse_json(raw, url)
        raise RemoteRewardError(
            f"{method} {url} failed {self.retries + 1} times (last: {last}); {SERVE_HINT}, or fix base_url "
            f"(timeout {self.timeout:g} s per try)"
        )


class PendingScores:
    """A batch being judged: :meth:`result` waits for every image (the first failure is
    raised, and the requests not yet sent are cancelled)."""

    def __init__(self, futures: list, assemble):
        self.futures, self.assemble = futures, assemble

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self, timeout: float | None = None) -> dict[str, torch.Tensor]:
        try:
            parts = [f.result(timeout) for f in self.futures]
        except BaseException:
            for f in self.futures:
                f.cancel()
            raise
        return self.assemble(parts)


# -- request and answer helpers ------------------------------------------------------------
def check_url(base_url) -> str:
    if not base_url or not str(base_url).startswith(("http://", "https://")):
        raise ValueError(
            f"vlm_judge: backend openai needs base_url, the server's OpenAI API root, got {base_url!r}; "
            "e.g. http://127.0.0.1:8000/v1 for `vllm serve`, http://127.0.0.1:30000/v1 for SGLang"
        )
    return str(base_url).rstrip("/")


def check_model_name(model) -> str:
    if not model:
        raise ValueError(
            "vlm_judge: backend openai needs model, the served model's name as GET {base_url}/models lists "
            "it (e.g. Qwen/Qwen2.5-VL-7B-Instruct, or vLLM's --served-model-name)"
        )
    return str(model)


def auth_header(api_key_env: str | None) -> dict[str, str]:
    if not api_key_env:
        return {}
    key = os.environ.get(str(api_key_env))
    if not key:
        raise ValueError(
            f"vlm_judge: api_key_env names the environment variable {api_key_env!r}, which is not set; "
            "export it with the server's API key, or drop api_key_env for a server without one"
        )
    return {"Authorization": f"Bearer {key}"}


def http_hint(code: int, detail: str) -> str:
    if code == 404:
        return "; base_url is the OpenAI API root, usually ending in /v1"
    if code in (401, 403):
        return "; the server wants an API key: set api_key_env to the variable that holds it"
    if "logprob" in detail.lower():
        return (
            "; vLLM caps top_logprobs at its --max-logprobs (20 by default): lower top_logprobs or "
            "restart the server with a larger --max-logprobs"
        )
    return ""


def parse_json(raw: bytes, url: str) -> dict:
    try:
        answer = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RemoteRewardError(f"{url} answered something that is not JSON ({raw[:80]!r})") from None
    if not isinstance(answer, dict):
        raise RemoteRewardError(f"{url} answered {str(answer)[:120]}, not a JSON object")
    return answer


def first_choice(answer: dict, base_url: str) -> dict:
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RemoteRewardError(f"{base_url}/chat/completions answered without choices: {str(answer)[:160]}")
    return choices[0]


def first_top_logprobs(choice: dict, base_url: str) -> list[dict]:
    """``choices[0].logprobs.content[0].top_logprobs``: the first answer token's top-k."""
    try:
        top = choice["logprobs"]["content"][0]["top_logprobs"]
        if not top or not all(isinstance(e["token"], str) and not math.isnan(e["logprob"]) for e in top):
            raise ValueError
    except (KeyError, IndexError, TypeError, ValueError):
        raise RemoteRewardError(
            f"{base_url}/chat/completions answered without the first token's top_logprobs "
            f"({str(choice.get('logprobs'))[:160]}); the server must support logprobs and top_logprobs"
        ) from None
    return top


def answer_probs(top: list[dict], answers) -> list[float]:
    """P(answer) for each answer string, from the listed tokens (a string listed twice, as two
    token ids can decode alike, adds up); an answer not listed gets 0."""
    probs: dict[str, float] = {}
    for entry in top:
        probs[entry["token"]] = probs.get(entry["token"], 0.0) + math.exp(float(entry["logprob"]))
    return [probs.get(a, 0.0) for a in answers]


def uint8_images(images, reward: str) -> list[np.ndarray]:
    """(H, W, 3) uint8 arrays; PIL images of any sizes each keep theirs (one request each)."""
    if isinstance(images, (list, tuple)) and images and all(hasattr(im, "convert") for im in images):
        return [np.asarray(im.convert("RGB")) for im in images]
    return list(to_uint8_hwc(reward_images(images, reward)))


def png_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")  # lossless: the judge sees the reward's pixels
    return buffer.getvalue()

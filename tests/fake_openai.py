"""A fake OpenAI-compatible judge on 127.0.0.1 (stdlib ``http.server``, port 0) for the
``vlm_judge`` openai backend: it serves ``GET /v1/models`` and ``POST /v1/chat/completions``,
checks each request's shape as vLLM would see it, and answers from the image itself, so a
test can compute the expected reward from the formula on its own.

The fake judge's first-token logits for an image of mean pixel value ``m`` (the decoded
PNG's uint8 mean / 255) are :func:`image_logits`: "Yes" and "No" move with ``m``, the digit
``d`` peaks at ``1 + 4 m``, and 40 filler tokens sit far below; the listed logprobs are the
log-softmax over that vocabulary, the ``top_logprobs`` largest first. In text mode it
writes :func:`answer_text`.
"""

from __future__ import annotations

import base64
import io
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image

FILLERS = [f"w{i}" for i in range(40)]
PNG_URI = "data:image/png;base64,"


def image_logits(mean: float) -> dict[str, float]:
    logits = {"Yes": 6.0 * (mean - 0.5), "No": -6.0 * (mean - 0.5)}
    logits.update({str(d): -((d - (1.0 + 4.0 * mean)) ** 2) for d in range(1, 6)})
    logits.update({t: -20.0 - 0.5 * i for i, t in enumerate(FILLERS)})
    return logits


def answer_text(mean: float) -> str:
    return f"Looks about right to me.\nFinal Score: {1.0 + 4.0 * mean:.3f}"


def image_mean(uri: str) -> float:
    png = base64.b64decode(uri[len(PNG_URI) :])
    return float(np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64).mean() / 255.0)


class FakeJudge:
    """``with FakeJudge(...) as judge:`` serves at ``judge.base_url`` (ending in /v1).

    Args:
        model: the served model name.
        text: answer in text (``text(mean) -> str``) instead of one token with logprobs.
        finish: the text answer's finish_reason ("length": cut at max_tokens).
        failures: HTTP statuses the first chat requests get, in order, before real answers.
        hide: tokens left out of the listed top-k (an answer the server did not list).
        delay: seconds each chat request takes (to see how many are in flight).
        max_logprobs: the largest top_logprobs accepted (vLLM's --max-logprobs default).
        api_key: the bearer token required, if any.
    """

    def __init__(
        self,
        model="judge-vl",
        text=None,
        finish="stop",
        failures=(),
        hide=(),
        delay=0.0,
        max_logprobs=20,
        api_key=None,
    ):
        self.model, self.text, self.finish, self.hide, self.delay = model, text, finish, set(hide), delay
        self.failures, self.max_logprobs, self.api_key = list(failures), max_logprobs, api_key
        self.requests: list[dict] = []  # every chat request body that was well formed
        self.problems: list[str] = []  # why a malformed request was refused
        self.chat_calls = self.model_calls = self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()

    def __enter__(self) -> FakeJudge:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        serve = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        serve.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- answers --------------------------------------------------------------------------
    def chat(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.chat_calls += 1
            failure = self.failures.pop(0) if self.failures else None
        if failure is not None:
            return failure, {"error": {"message": f"injected HTTP {failure}"}}
        if body.get("model") != self.model:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}}
        problem = self.problem(body)
        if problem:
            with self.lock:
                self.problems.append(problem)
            return 400, {"error": {"message": problem}}
        with self.lock:
            self.requests.append(body)
        mean = image_mean(body["messages"][0]["content"][0]["image_url"]["url"])
        if self.text is not None:
            return 200, completion(self.model, self.text(mean), None, self.finish)
        return 200, completion(self.model, None, self.top(mean, body["top_logprobs"]), "length")

    def problem(self, body: dict) -> str | None:
        """What vLLM would refuse, or what the judge must never send."""
        messages = body.get("messages")
        if not (isinstance(messages, list) and len(messages) == 1 and messages[0].get("role") == "user"):
            return f"expected one user message, got {messages}"
        content = messages[0].get("content")
        if not (isinstance(content, list) and [c.get("type") for c in content] == ["image_url", "text"]):
            return f"expected [image_url, text] content, got {content}"
        if not content[0]["image_url"]["url"].startswith(PNG_URI) or not content[1]["text"]:
            return "expected a PNG data URI and a question"
        if body.get("temperature") != 0:
            return f"temperature must be 0, got {body.get('temperature')}"
        if self.text is not None:
            ok = body.get("max_tokens", 0) >= 2 and not body.get("logprobs")
            return None if ok else f"text answers need max_tokens >= 2 and no logprobs, got {body}"
        if body.get("max_tokens") != 1 or body.get("logprobs") is not True:
            return f"expected max_tokens 1 and logprobs true, got {body}"
        k = body.get("top_logprobs")
        if not isinstance(k, int) or k < 1 or k > self.max_logprobs:
            return f"Requested top logprobs of {k}, which is greater than max allowed: {self.max_logprobs}"
        return None

    def top(self, mean: float, k: int) -> list[dict]:
        logits = image_logits(mean)
        log_z = math.log(sum(math.exp(v) for v in logits.values()))
        ranked = sorted(((v - log_z, t) for t, v in logits.items() if t not in self.hide), reverse=True)
        return [{"token": t, "logprob": lp, "bytes": list(t.encode())} for lp, t in ranked[:k]]


def completion(model: str, text: str | None, top: list[dict] | None, finish: str) -> dict:
    logprobs = None
    if top is not None:
        text = top[0]["token"]
        logprobs = {"content": [{**top[0], "top_logprobs": top}]}
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
    return {"id": "chatcmpl-fake", "object": "chat.completion", "model": model, "choices": [choice]}


def _handler(judge: FakeJudge):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path != "/v1/models":
                return self.reply(404, {"error": {"message": f"no route {self.path}"}})
            with judge.lock:
                judge.model_calls += 1
            self.reply(200, {"object": "list", "data": [{"id": judge.model, "object": "model"}]})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path != "/v1/chat/completions":
                return self.reply(404, {"error": {"message": f"no route {self.path}"}})
            if judge.api_key and self.headers.get("Authorization") != f"Bearer {judge.api_key}":
                return self.reply(401, {"error": {"message": "Unauthorized"}})
            with judge.lock:
                judge.in_flight += 1
                judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
            try:
                time.sleep(judge.delay)
                status, payload = judge.chat(body)
            finally:
                with judge.lock:
                    judge.in_flight -= 1
            self.reply(status, payload)

        def reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    return Handler

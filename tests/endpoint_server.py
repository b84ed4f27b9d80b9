"""A loopback stand-in for the Ray Serve deployment in quick-tier tests: the protocol's own
:class:`~rewards.serve_endpoint.RewardEndpoint` and :class:`~rewards.request_ledger.RequestLedger`
behind a stdlib HTTP server, one job per scoring call (batching is Ray Serve's and is tested
on a real local Ray in tests/rewards/test_serve_ray.py, the slow tier)."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rewards.request_ledger import RequestLedger
from rewards.serve_endpoint import RewardEndpoint, score_jobs


class EndpointServer:
    """``url``; ``endpoint`` and ``ledger`` for their counts; ``calls`` counts scoring calls;
    ``stop()``. ``before_score`` (a function of the job) runs on the scoring thread first."""

    def __init__(self, reward, name: str, before_score=None):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.ledger, self.calls, self.before_score = RequestLedger(), 0, before_score
        self.endpoint = RewardEndpoint(reward, name, self.ledger, "replica-0", self._score)
        self.reward = reward
        handler = type("Handler", (_Handler,), {"server_side": self})
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    async def _score(self, job):
        return await self.loop.run_in_executor(None, self._score_now, job)

    def _score_now(self, job):
        self.calls += 1
        if self.before_score is not None:
            self.before_score(job)
        return score_jobs(self.reward, [job])[0]

    def answer(self, method: str, path: str, body: bytes, headers: dict):
        coroutine = self.endpoint.answer(method, path, body, headers)
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.loop.call_soon_threadsafe(self.loop.stop)


class _Handler(BaseHTTPRequestHandler):
    server_side: EndpointServer

    def do_GET(self):  # noqa: N802 (http.server's name)
        self._reply(self.server_side.answer("GET", self.path, b"", dict(self.headers)))

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._reply(self.server_side.answer("POST", self.path, body, dict(self.headers)))

    def _reply(self, answer) -> None:
        try:
            self.send_response(answer.status)
            for key, value in answer.headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(answer.payload)))
            self.end_headers()
            self.wfile.write(answer.payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up; it retries
            pass

    def log_message(self, *args):
        pass

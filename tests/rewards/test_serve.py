"""The reward server under overload, on 127.0.0.1 (loopback, bounded in count and time): a
full queue answers 503 with Retry-After and the request succeeds once it drains; an expired
job is not scored; a retry after a read timeout attaches to its queued job; a job that does
not fit the batch heads the next one; two servers share the load and the run survives one
being stopped or dropping connections. A fake reward counts every prompt it scores, so
"nothing scored twice, nothing lost" is checked, not assumed."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rewards.remote import RemoteReward, RemoteRewardError, encode_request
from rewards.serve import serve


class Counting:
    """Scores an image by its mean, counts each prompt scored and records the batches;
    ``gate.clear()`` holds the scorer inside a batch so that a queue builds up behind it."""

    def __init__(self, seconds_per_image: float = 0.0):
        self.lock, self.scored, self.batches = threading.Lock(), Counter(), []
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        self.seconds_per_image = seconds_per_image

    def __call__(self, images, prompts, metadata=None):
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        time.sleep(self.seconds_per_image * len(images))
        with self.lock:
            self.scored.update(prompts)
            self.batches.append(list(prompts))
        return {"fake": images.flatten(1).mean(1)}


def _batch(tag: str, n: int, value: float = 0.5, size: int = 8):
    return torch.full((n, 3, size, size), value), [f"{tag}{i}" for i in range(n)]


def _until(condition, seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.005)


def _post(url, images, prompts, rid=None, budget=None, timeout=5.0):
    """A raw /score request: (status, headers, body)."""
    headers = {"Content-Type": "application/octet-stream"}
    if rid is not None:
        headers["X-Request-Id"] = rid
    if budget is not None:
        headers["X-Request-Timeout"] = str(budget)
    request = urllib.request.Request(url + "/score", encode_request(images, prompts), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def _background(fn, *args, **kwargs):
    """Run fn in a thread; returns (thread, a dict that gets 'result' or 'error')."""
    out = {}

    def run():
        try:
            out["result"] = fn(*args, **kwargs)
        except Exception as err:  # the test asserts on it
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.fixture
def servers():
    """serve(...) that stops every server it started at the end of the test."""
    started = []

    def start(reward, **kwargs):
        server = serve(reward, "fake", **kwargs)
        started.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in started:
        server.stop(timeout=5)


def _hold(fake, url, n=1):
    """Put a batch in the scorer and keep it there (gate closed): what follows queues."""
    fake.gate.clear()
    thread, out = _background(_post, url, *_batch("held", n))
    assert fake.entered.wait(5)
    return thread, out


def test_a_full_queue_answers_503_with_retry_after_and_the_request_succeeds_once_it_drains(servers):
    fake = Counting()
    server, url = servers(fake, max_batch=2, max_queue=2, max_wait_ms=1)
    held, _ = _hold(fake, url, 2)
    queued, queued_out = _background(_post, url, *_batch("queued", 2))
    _until(lambda: server.scorer.queued_images == 2)

    status, headers, body = _post(url, *_batch("refused", 1), timeout=2)
    assert status == 503 and json.loads(body)["error"] == "busy"
    assert int(headers["Retry-After"]) >= 1 and int(headers["X-Retry-After-Ms"]) >= 50
    assert headers["X-Queue-Images"] == "2"

    client = RemoteReward(url, timeout=5, retries=0)
    waiting, out = _background(client, *_batch("patient", 2, value=0.25))
    _until(lambda: client.stats["busy"] >= 1)  # refused at least once, and still waiting
    assert waiting.is_alive()
    fake.gate.set()
    for thread in (held, queued, waiting):
        thread.join(10)
    torch.testing.assert_close(out["result"]["remote"], torch.full((2,), 0.25))
    assert queued_out["result"][0] == 200
    assert fake.scored == Counter(["held0", "held1", "queued0", "queued1", "patient0", "patient1"])
    assert server.scorer.stats["rejected"] >= 2


def test_an_expired_job_is_dropped_before_scoring(servers):
    fake = Counting()
    server, url = servers(fake, max_batch=4, max_wait_ms=1)
    held, _ = _hold(fake, url)
    with pytest.raises(TimeoutError):  # the client gives up after 0.3 s; its job had 0.2 s
        _post(url, *_batch("expired", 2), rid="late", budget=0.2, timeout=0.3)
    patient, out = _background(_post, url, *_batch("patient", 1))  # no deadline: always scored
    _until(lambda: server.scorer.queued_images == 3)
    fake.gate.set()
    patient.join(5)
    held.join(5)
    assert out["result"][0] == 200
    assert fake.scored == Counter(["held0", "patient0"])
    assert server.scorer.stats["expired"] == 1 and server.scorer.queued_images == 0


def test_a_retry_after_a_read_timeout_attaches_to_the_queued_job_not_a_second_copy(servers):
    """Two servers, both busy: the retry must go back to the server that has the job (the
    other one would score a second copy) and attach to it there."""
    fakes = [Counting(), Counting()]
    started = [servers(f, max_batch=4, max_wait_ms=1) for f in fakes]
    holds = [_hold(f, u)[0] for f, (_, u) in zip(fakes, started, strict=True)]
    client = RemoteReward(urls=[u for _, u in started], timeout=0.3, retries=4, backoff=0.05)
    waiting, out = _background(client, *_batch("slow", 2, value=0.75))
    _until(lambda: sum(s.scorer.stats["attached"] for s, _ in started) >= 2)  # two timeouts, two retries
    assert client.stats["timeouts"] >= 2
    for fake in fakes:
        fake.gate.set()
    for thread in [waiting, *holds]:
        thread.join(5)
    torch.testing.assert_close(out["result"]["remote"], torch.full((2,), 0.75))
    assert fakes[0].scored + fakes[1].scored == Counter(["held0", "held0", "slow0", "slow1"])
    assert [s.scorer.stats["jobs"] for s, _ in started] in ([2, 1], [1, 2])  # one copy, ever
    (server, url), fake = started[0], fakes[0]
    # a retry that comes after the job finished gets its cached scores, not a new scoring
    first = _post(url, *_batch("once", 2), rid="r1")
    again = _post(url, *_batch("once", 2), rid="r1")
    assert first[0] == again[0] == 200 and first[2] == again[2]
    assert fake.scored["once0"] == 1 and server.scorer.stats["cached"] == 1
    status, _, body = _post(url, *_batch("other", 3), rid="r1")  # the same id for other work
    assert status == 409 and b"request id 'r1' was used for another batch" in body
    status, _, body = _post(url, *_batch("bad", 1), rid="r2", budget="soon")
    assert status == 400 and b"X-Request-Timeout must be a number of seconds > 0, got 'soon'" in body


def test_a_job_that_does_not_fit_the_batch_heads_the_next_one(servers):
    fake = Counting()
    server, url = servers(fake, max_batch=4, max_wait_ms=20)
    held, _ = _hold(fake, url)
    threads = []
    for tag, n in (("b", 3), ("c", 2), ("d", 2), ("e", 2)):
        before = server.scorer.queued_images
        threads.append(_background(_post, url, *_batch(tag, n))[0])
        _until(lambda before=before: server.scorer.queued_images > before)  # queued in this order
    fake.gate.set()
    for thread in [held, *threads]:
        thread.join(5)
    # c does not fit beside b (3 + 2 > 4): it heads the next batch, ahead of e that came
    # after it (sent back to the tail, it would be scored last, after d and e)
    assert fake.batches == [["held0"], ["b0", "b1", "b2"], ["c0", "c1", "d0", "d1"], ["e0", "e1"]]


def test_a_stopping_server_hands_queued_work_back_and_health_reports(servers):
    fake = Counting()
    server, url = servers(fake, max_batch=4, max_wait_ms=1)
    with urllib.request.urlopen(url + "/health", timeout=5) as response:
        health = json.loads(response.read())
    assert health["ok"] and health["reward"] == "fake" and health["max_queue"] == 16
    assert health["queued_images"] == 0 and health["scored_images"] == 0

    held, held_out = _hold(fake, url)
    queued, out = _background(_post, url, *_batch("queued", 2))
    _until(lambda: server.scorer.queued_images == 2)
    server.scorer.stop()
    queued.join(5)
    status, _, body = out["result"]
    assert status == 503 and json.loads(body)["error"] == "stopping"
    assert _post(url, *_batch("late", 1))[0] == 503
    # stop() returns only once the batch being scored is answered: a server process that
    # exited sooner would lose scores that its clients would then have scored elsewhere
    stopper, _ = _background(server.stop)
    time.sleep(0.3)
    assert stopper.is_alive() and held.is_alive()
    fake.gate.set()
    stopper.join(5)
    held.join(5)
    assert held_out["result"][0] == 200
    assert fake.scored == Counter(["held0"]) and not server.scorer.health()["ok"]


def test_two_servers_share_the_load_and_the_run_survives_one_being_stopped(servers):
    """The load test: 40 requests of 2 images from 8 threads over two servers with small
    queues; one server stops halfway. Every request gets its own scores and every image is
    scored exactly once."""
    fakes = [Counting(seconds_per_image=0.002), Counting(seconds_per_image=0.002)]
    started = [servers(f, max_batch=4, max_queue=4, max_wait_ms=2) for f in fakes]
    client = RemoteReward(urls=[u for _, u in started], timeout=5, retries=2, backoff=0.05)
    requests = [_batch(f"r{i}-", 2, value=i / 40) for i in range(40)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(client, images, prompts) for images, prompts in requests]
        _until(lambda: sum(f.done() for f in futures) >= 16, seconds=20)
        started[0][0].stop()
        results = [f.result(timeout=20) for f in futures]
    for i, result in enumerate(results):
        torch.testing.assert_close(result["remote"], torch.full((2,), i / 40))
    scored = fakes[0].scored + fakes[1].scored
    assert scored == Counter(p for _, prompts in requests for p in prompts)  # once each, none lost
    assert fakes[0].scored and fakes[1].scored  # both took a share
    assert client.stats["failovers"] >= 1


def test_batches_go_to_the_least_loaded_server_in_turn(servers):
    """Idle servers take batches in turn; the client then prefers the one with fewer images
    in flight from it plus the queue that server last reported (X-Queue-Images)."""
    fakes = [Counting(), Counting()]
    client = RemoteReward(urls=[servers(f, max_wait_ms=1)[1] for f in fakes])
    for i in range(4):
        client(*_batch(f"s{i}-", 1))
    assert sum(fakes[0].scored.values()) == sum(fakes[1].scored.values()) == 2
    a, b = client.urls
    client.servers.sent(a, 8)  # 8 images in flight to a
    assert {client.servers.pick()[0] for _ in range(4)} == {b}
    client.servers.answered(a, 8, "0")
    client.servers.answered(b, 0, "5")  # b reported 5 images queued
    assert {client.servers.pick()[0] for _ in range(4)} == {a}
    client.servers.busy(a, 60)  # a answered 503: b takes the work, even though it is longer
    assert client.servers.pick() == (b, 0.0)


def _dropping_server():
    """Answers /info, then closes every /score connection without a word (a crash)."""
    calls = Counter()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            calls[self.path] += 1
            if self.path == "/info":
                payload = b'{"reward": "fake"}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", calls


def test_a_server_that_drops_connections_is_failed_over_and_left_alone(servers):
    fake = Counting()
    _, good = servers(fake, max_wait_ms=1)
    stub, bad, calls = _dropping_server()
    try:
        client = RemoteReward(urls=[bad, good], retries=0, revive_after=60)
        for i in range(4):
            torch.testing.assert_close(client(*_batch(f"x{i}-", 1, 0.5))["remote"], torch.full((1,), 0.5))
    finally:
        stub.shutdown()
    assert calls["/score"] == 1 and client.stats["failovers"] == 1  # tried once, then skipped
    assert sum(fake.scored.values()) == 4


def test_url_and_urls_are_checked(servers):
    _, one = servers(Counting())
    with pytest.raises(ValueError, match="exactly one of them"):
        RemoteReward(one, urls=[one])
    with pytest.raises(ValueError, match="exactly one of them"):
        RemoteReward()
    for bad in ([], one, [one, one + "/"]):
        with pytest.raises(ValueError, match=r"args.urls (must be a non-empty list|names a server twice)"):
            RemoteReward(urls=bad)
    other = serve(Counting(), "other")
    try:
        with pytest.raises(ValueError, match="serve different rewards"):
            RemoteReward(urls=[one, f"http://127.0.0.1:{other.server_address[1]}"])
    finally:
        other.stop()
    with pytest.raises(RemoteRewardError, match=r"reward server http://127.0.0.1:\d+ did not answer /info"):
        RemoteReward(urls=[one, f"http://127.0.0.1:{other.server_address[1]}"], retries=0)
    client = RemoteReward(url=one)
    assert client.url == one and json.loads(client._post("/info", b"{}", "application/json")) == {
        "reward": "fake"
    }

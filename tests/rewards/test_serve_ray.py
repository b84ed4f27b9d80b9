"""The reward service on a real local Ray Serve (CPU, loopback; the slow tier: it starts
Ray's processes): dynamic batching, back-pressure, deadlines that are errors and never
zeros, a replica killed under load (nothing lost, nothing scored twice), the handle path,
and a clean stop of ``diffrl-serve`` (rewards/serve_ray.py, rewards/serve_cli.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra: pip install 'diffrl[serve]'")

from rewards import build  # noqa: E402
from rewards.remote import RemoteReward, RemoteRewardError, encode_request  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
REWARD = "jpeg_compressibility"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _post(url: str, body: bytes, headers: dict | None = None, timeout: float = 60):
    request = urllib.request.Request(url + "/score", data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, dict(err.headers), err.read()


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as answer:
        return json.loads(answer.read())


def _images(seed: int, count: int = 2) -> torch.Tensor:
    return torch.rand(count, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def _in_threads(count: int, work) -> list:
    """``work(i)`` for i < count, each in its own thread, all released at once."""
    out, threads, start = [None] * count, [], threading.Barrier(count)

    def run(i):
        start.wait()
        out[i] = work(i)

    for i in range(count):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
    for thread in threads:
        thread.join(120)
    return out


def test_diffrl_serve_stops_cleanly_answering_what_it_holds():
    """SIGTERM while three batches are being scored: all three are answered, the command
    prints its counts and exits 0 (run first: it starts a Ray of its own)."""
    port = _free_port()
    command = [sys.executable, str(ROOT / "scripts" / "serve_rewards.py"), "--reward", REWARD]
    command += ["--port", str(port), "--num-cpus", "4", "--cpus-per-replica", "0"]
    command += ["--latency-ms-per-image", "400", "--max-wait-ms", "100"]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        line = proc.stdout.readline()
        assert "serving reward 'jpeg_compressibility'" in line, line
        url = line.split(" on ")[1].split()[0]
        started = threading.Event()

        def request(i):
            started.set()
            return _post(url, encode_request(_images(i), ["a", "b"]), {"X-Request-Id": f"stop-{i}"})

        timer = threading.Timer(0.5, lambda: proc.send_signal(signal.SIGTERM))
        timer.start()
        answers = _in_threads(3, request)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert proc.returncode == 0 and "stopped: " in out


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray import serve

    from rewards.serve_ray import reward_app

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    apps = {
        "fast": reward_app(REWARD, cpus_per_replica=0, max_batch=16, max_wait_ms=300),
        "slow": reward_app(
            REWARD,
            cpus_per_replica=0,
            max_ongoing_requests=1,
            max_queued_requests=1,
            retry_after_s=0.2,
            latency_ms_per_image=500,
        ),
        "pair": reward_app(REWARD, replicas=2, cpus_per_replica=0, max_batch=8, latency_ms_per_image=20),
    }
    for name, app in apps.items():
        serve.run(app, name=name, route_prefix=f"/{name}")
    yield {name: f"http://127.0.0.1:{port}/{name}" for name in apps}
    serve.shutdown()
    ray.shutdown()


def test_concurrent_requests_are_batched_and_score_as_in_process(cluster):
    url, reference = cluster["fast"], build(REWARD)
    before = _health(url)["batches"]
    clients = [RemoteReward(url) for _ in range(6)]
    barrier = threading.Barrier(6)

    def request(i):
        barrier.wait()
        return clients[i](_images(i), ["a", "b"])["remote"]

    scores = _in_threads(6, request)
    for i, got in enumerate(scores):
        assert torch.equal(got, reference(_images(i), ["a", "b"], {})[REWARD].float())
    assert _health(url)["batches"] - before <= 2  # 12 images from 6 requests in one or two calls


def test_rays_own_cli_builds_the_same_app_from_string_args(cluster):
    """``serve run rewards.serve_ray:build_app reward=... replicas=1`` passes strings."""
    from ray import serve

    from rewards.serve_ray import build_app

    app = build_app({"reward": REWARD, "replicas": "1", "cpus_per_replica": "0", "max_batch": "8"})
    serve.run(app, name="built", route_prefix="/built")
    try:
        scores = RemoteReward(app="built")(_images(3), ["a", "b"])["remote"]
        assert torch.equal(scores, build(REWARD)(_images(3), ["a", "b"], {})[REWARD].float())
    finally:
        serve.delete("built")


def test_the_handle_path_answers_as_http_does(cluster):
    through_http = RemoteReward(cluster["fast"])(_images(7), ["a", "b"])
    through_handle = RemoteReward(app="fast")(_images(7), ["a", "b"])
    assert through_http.keys() == through_handle.keys()
    for key in through_http:
        assert torch.equal(through_http[key], through_handle[key])


def test_a_full_queue_answers_503_with_retry_after_and_clients_wait_it_out(cluster):
    url = cluster["slow"]
    # one request held by the replica, one queued at the proxy: the rest of 6 are refused
    answers = _in_threads(6, lambda i: _post(url, encode_request(_images(i, 1), ["a"])))
    statuses = [status for status, _, _ in answers]
    refused = [headers for status, headers, _ in answers if status == 503]
    assert refused and all(h.get("retry-after") or h.get("Retry-After") for h in refused), statuses
    assert set(statuses) <= {200, 503} and 200 in statuses, statuses

    clients = [RemoteReward(url, timeout=30) for _ in range(5)]
    scores = _in_threads(5, lambda i: clients[i](_images(i, 1), ["a"])["remote"])
    assert all(s is not None and torch.isfinite(s).all() for s in scores)
    assert sum(c.stats["busy"] for c in clients) >= 1


@pytest.mark.parametrize("path", ["http", "handle"])
def test_a_deadline_is_an_error_never_a_zero_and_an_abandoned_request_is_not_scored(cluster, path):
    """A client whose tries time out while the one replica slot is held raises one error;
    its requests, still queued, are cancelled when it hangs up (HTTP) or cancels (handle)
    and never scored."""
    url = cluster["slow"]
    finished = _health(url)["ledger"]["finished"]
    where = {"url": url} if path == "http" else {"app": "slow"}
    impatient = RemoteReward(**where, timeout=0.15, retries=1, backoff=0.0)
    hold = threading.Thread(target=_post, args=(url, encode_request(_images(0, 1), ["a"])))
    hold.start()  # occupies the one replica slot for 0.5 s
    time.sleep(0.1)
    with pytest.raises(RemoteRewardError, match=r"did not answer /score after 2 tries"):
        impatient(_images(2, 3), ["a", "b", "c"])
    hold.join()
    time.sleep(1.0)
    assert _health(url)["ledger"]["finished"] - finished == 1  # the held request only


def test_a_replica_killed_under_load_loses_no_request_and_scores_none_twice(cluster):
    """SIGKILL one of two replicas a third of the way through 48 requests from 6 clients:
    every request comes back with its own scores, and the ledger recorded each id once."""
    url, reference = cluster["pair"], build(REWARD)
    ledger_before = _health(url)["ledger"]
    per_client, clients_count = 8, 6
    # half over HTTP (Serve's proxy answers a bare 500 for a lost replica), half through handles
    # (Ray raises ActorDiedError): both retry with the same id
    clients = [
        RemoteReward(url, timeout=30, retries=4, backoff=0.2)
        if i % 2
        else RemoteReward(app="pair", timeout=30, retries=4, backoff=0.2)
        for i in range(clients_count)
    ]
    answered = []

    def client(i):
        got = []
        for j in range(per_client):
            images = _images(100 * i + j)
            got.append(
                torch.equal(
                    clients[i](images, ["a", "b"])["remote"], reference(images, ["a", "b"], {})[REWARD]
                )
            )
            answered.append(1)
        return got

    def killer():
        while len(answered) < per_client * clients_count // 3:
            time.sleep(0.01)
        os.kill(_health(url)["pid"], signal.SIGKILL)

    threading.Thread(target=killer).start()
    results = _in_threads(clients_count, client)
    assert all(all(r) for r in results)  # every request answered, with its own scores
    ledger = _health(url)["ledger"]
    sent = per_client * clients_count
    assert ledger["finished"] - ledger_before["finished"] == sent  # each id scored exactly once
    assert ledger["rescored"] == 0
    assert sum(c.stats["lost"] + c.stats["timeouts"] for c in clients) >= 1  # the kill hit requests

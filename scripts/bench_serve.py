"""Load benchmark of the reward service and the `remote` client on loopback: requests per
second and latency percentiles with one replica, two, a queue too small for the load (503 +
Retry-After), and one of two replicas killed (SIGKILL) halfway.

    python scripts/bench_serve.py                  # jpeg_compressibility, 64 px, 4 images a request
    python scripts/bench_serve.py --reward shapeworld --latency-ms-per-image 4 --requests 400

The service is `diffrl-serve` (Ray Serve on a local Ray in its own process: replicas behind
Serve's proxy, its batching and back-pressure, the request ledger). The hand-written threaded
server it replaced was measured side by side with it at commit 217a61b (`--engines ray
threads` there; docs/BENCHMARKS.md, "The reward service under load"). Each client is a
thread with its own `remote` reward (one per training process), sending its share of the
requests one after another. Prints a markdown table. Every request must come back with its
scores (a lost one stops the benchmark with an error); "scored / sent" is the service's own
count of scored images, and "scored twice" the request ledger's count of ids recorded twice.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (name, replicas, queue in requests (None: the default), what happens to one replica once
# half the requests are answered)
SCENARIOS = {
    "one": ("1 replica", 1, None, None),
    "two": ("2 replicas", 2, None, None),
    "full": ("1 replica, queue of 2 requests", 1, 2, None),
    "kill": ("2 replicas, one killed (SIGKILL) halfway", 2, None, "kill"),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", default="jpeg_compressibility", help="a registered reward to serve")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--requests", type=int, default=240, help="requests per scenario")
    parser.add_argument("--clients", type=int, default=8, help="client threads sending at once")
    parser.add_argument("--images", type=int, default=4, help="images per request")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--max-batch", type=int, default=32, help="the servers' --max-batch")
    parser.add_argument(
        "--latency-ms-per-image",
        type=float,
        default=1.0,
        help="the servers' stand-in for a reward model on another device (a wait, no CPU)",
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="the clients' timeout per try")
    args = parser.parse_args(argv)
    if min(args.requests, args.clients, args.images, args.size, args.max_batch) < 1:
        parser.error("--requests, --clients, --images, --size and --max-batch must be >= 1")
    return args


def start_server(args, replicas: int, queue: int | None) -> tuple[subprocess.Popen, str]:
    """The service in its own process, as deployed: (its process, its URL)."""
    command = [sys.executable, str(ROOT / "scripts" / "serve_rewards.py"), "--reward", args.reward]
    command += ["--max-batch", str(args.max_batch), "--latency-ms-per-image", str(args.latency_ms_per_image)]
    command += ["--port", str(free_port()), "--replicas", str(replicas), "--cpus-per-replica", "0"]
    # a small queue: that many requests held by the replica, as many more waiting at the proxy
    command += ["--max-ongoing-requests", str(queue), "--max-queued-requests", str(queue)] if queue else []
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    line = proc.stdout.readline()  # "serving reward 'NAME' on http://HOST:PORT ..."
    if "serving reward" not in line:
        proc.kill()
        raise SystemExit(
            f"error: the reward service did not start (it printed {line!r}); see its error above"
        )
    return proc, line.split(" on ")[1].split()[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> dict | None:
    """SIGTERM; the service's own counts (its last line), None if it printed none."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    lines = [line for line in out.splitlines() if line.startswith("stopped: ")]
    return json.loads(lines[-1][len("stopped: ") :]) if lines else None


def kill_one_replica(url: str) -> None:
    """SIGKILL the process of the replica that answers ``GET /health`` (Ray starts another)."""
    with urllib.request.urlopen(url + "/health", timeout=30) as answer:
        os.kill(json.loads(answer.read())["pid"], signal.SIGKILL)


def run_clients(args, urls: list[str], on_half) -> tuple[list[float], dict, float]:
    """(latencies in s, the clients' summed stats, wall seconds); ``on_half`` runs once half
    the requests are answered."""
    import torch

    from rewards.remote import RemoteReward

    latencies, stats, lock, errors = [], {}, threading.Lock(), []
    half = threading.Event()
    shares = [args.requests // args.clients + (i < args.requests % args.clients) for i in range(args.clients)]

    def client(index: int, reward, count: int) -> None:
        images = torch.rand(
            args.images, 3, args.size, args.size, generator=torch.Generator().manual_seed(index)
        )
        prompts = [f"client {index} image {i}" for i in range(args.images)]
        for _ in range(count):
            start = time.perf_counter()
            try:
                scores = reward(images, prompts)["remote"]
                assert len(scores) == args.images and torch.isfinite(scores).all()
            except Exception as err:  # reported after the run: a lost request fails it
                errors.append(f"client {index}: {type(err).__name__}: {err}")
                return
            with lock:
                latencies.append(time.perf_counter() - start)
                if len(latencies) * 2 >= args.requests:
                    half.set()
        with lock:
            for key, value in reward.stats.items():
                stats[key] = stats.get(key, 0) + value

    # every client connects (POST /info to each server) before the clock starts
    clients = [RemoteReward(urls=urls, timeout=args.timeout, retries=2, backoff=0.5) for _ in shares]
    threads = [
        threading.Thread(target=client, args=(i, c, n))
        for i, (c, n) in enumerate(zip(clients, shares, strict=True))
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    if half.wait(args.timeout * 10) and on_half is not None:
        on_half()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors or len(latencies) != args.requests:
        lost = args.requests - len(latencies)
        raise SystemExit(f"error: {lost} requests were lost:\n" + "\n".join(errors[:5]))
    return latencies, stats, wall


def scenario(args, key: str) -> dict:
    name, replicas, queue, fate = SCENARIOS[key]
    proc, url = start_server(args, replicas, queue)
    try:
        latencies, stats, wall = run_clients(args, [url], (lambda: kill_one_replica(url)) if fate else None)
    finally:
        counts = stop_server(proc)
    scored = None if counts is None else counts["scored_images"]
    rescored = None if counts is None else counts["rescored"]
    return dict(
        name=name, latencies=sorted(latencies), stats=stats, wall=wall, scored=scored, rescored=rescored
    )


def percentile(values: list[float], q: float) -> float:
    """Nearest rank on sorted values."""
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def table(args, rows: list[dict]) -> str:
    sent = args.requests * args.images
    lines = [
        "| scenario | req/s | images/s | p50 ms | p90 ms | p99 ms | max ms | 503s | retries "
        "| scored / sent | scored twice |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ms = [1000 * percentile(row["latencies"], q) for q in (0.5, 0.9, 0.99, 1.0)]
        scored = "n/a" if row["scored"] is None else f"{row['scored']} / {sent}"
        twice = "n/a" if row["rescored"] is None else row["rescored"]
        lines.append(
            f"| {row['name']} | {args.requests / row['wall']:.1f} | {sent / row['wall']:.0f} | "
            + " | ".join(f"{v:.0f}" for v in ms)
            + f" | {row['stats'].get('busy', 0)} | {row['stats'].get('retries', 0)} | {scored} | {twice} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    import torch

    args = parse_args(argv)
    print(
        f"reward {args.reward}; {args.requests} requests of {args.images} images of {args.size} px "
        f"from {args.clients} clients; --max-batch {args.max_batch}, --latency-ms-per-image "
        f"{args.latency_ms_per_image:g}; torch {torch.__version__}, {os.cpu_count()} CPUs",
        flush=True,
    )
    rows = []
    for key in args.scenarios:
        rows.append(scenario(args, key))
        print(
            f"  {rows[-1]['name']}: {rows[-1]['wall']:.1f} s, client counts {rows[-1]['stats']}", flush=True
        )
    print(table(args, rows))


if __name__ == "__main__":
    from diffrl.cli import run_cli

    run_cli(main)

"""Serve a registered reward over HTTP, batching requests, for `{name: remote, args: {url: ...}}`.

    python scripts/serve_rewards.py --reward shapeworld --port 8600
    python scripts/serve_rewards.py --reward 'hpsv21={"checkpoint": "HPS_v2.1_compressed.pt"}' --device cuda:1

Each training process (or machine) then scores through it with
`rewards: [{name: remote, args: {url: "http://HOST:8600"}}]`, or through several such servers
with `args: {urls: ["http://HOST1:8600", "http://HOST2:8600"]}` (least-loaded first, failing
over when one dies). A full queue (`--max-queue` images) answers 503 with Retry-After;
`GET /health` reports the queue and counters; Ctrl-C or SIGTERM stops it, handing queued
batches back to their clients. See rewards/serve.py for the protocol and rewards/remote.py
for the client's retries and errors.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", required=True, help="NAME or 'NAME={json args}' of a registered reward")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every one)")
    parser.add_argument("--port", type=int, default=8600)
    parser.add_argument("--device", default=None, help="move the reward model there (e.g. cuda:1)")
    parser.add_argument("--max-batch", type=int, default=64, help="most images scored in one call")
    parser.add_argument(
        "--max-wait-ms", type=float, default=5.0, help="how long a batch waits for more requests"
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="most images waiting to be scored; more answer 503 with Retry-After (default 4 x --max-batch)",
    )
    parser.add_argument(
        "--latency-ms-per-image",
        type=float,
        default=0.0,
        help="benchmarks only: add this wall time per scored image, standing in for a reward model "
        "on another GPU or machine (sleeps, using no CPU here)",
    )
    args = parser.parse_args(argv)
    if args.max_batch < 1 or (args.max_queue is not None and args.max_queue < 1) or args.max_wait_ms < 0:
        parser.error("--max-batch and --max-queue must be >= 1 and --max-wait-ms >= 0")
    return args


def build_reward(spec: str):
    import rewards

    name, _, raw = spec.partition("=")
    try:
        args = json.loads(raw) if raw else {}
    except json.JSONDecodeError as err:
        raise rewards.RewardArgsError(
            f"--reward {spec!r}: the args after '=' are not JSON ({err.msg})"
        ) from None
    return name, rewards.build(name, **args)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> None:
    from rewards.serve import serve

    args = parse_args(argv)
    name, reward = build_reward(args.reward)
    if args.device and hasattr(reward, "to"):
        reward.to(args.device)
    batching = dict(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, max_queue=args.max_queue)
    server = serve(
        reward, name, args.host, args.port, latency_ms_per_image=args.latency_ms_per_image, **batching
    )
    host, port = server.server_address[:2]
    queue = server.scorer.max_queue
    print(
        f"serving reward '{name}' on http://{host}:{port} (batches of up to {args.max_batch}, "
        f"queue of {queue} images)",
        flush=True,
    )
    # SIGTERM (a job scheduler, `kill`) stops as Ctrl-C does: queued batches go back to
    # their clients as 503 'stopping', which send them to another server
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
        # one line for the log (and scripts/bench_serve.py): what this server did
        print(f"stopped: {json.dumps(server.scorer.health())}", flush=True)


if __name__ == "__main__":
    from diffrl.cli import run_cli

    run_cli(main)

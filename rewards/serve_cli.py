"""``diffrl-serve`` (also ``scripts/serve_rewards.py``): serve a registered reward on Ray Serve.

    diffrl-serve --reward shapeworld --port 8600
    diffrl-serve --reward 'hpsv21={"checkpoint": "HPS_v2.1_compressed.pt"}' --replicas 2 --gpus-per-replica 1
    diffrl-serve --reward geneval --address auto --route-prefix /geneval   # on a running Ray cluster

Training processes score through it with ``{name: remote, args: {url: "http://HOST:8600"}}``
(the route prefix appended, if one is given), or, when they run inside the same Ray
cluster, through a handle with ``{name: remote, args: {app: reward-NAME, ray_address:
auto}}``. Ray Serve places the replicas, batches (``--max-batch`` images, ``--max-wait-ms``)
and answers a full queue with 503 and ``Retry-After``; Ctrl-C or SIGTERM deletes the
application once its replicas have answered what they hold. The protocol is in
:mod:`rewards.serve_endpoint`, the deployment in :mod:`rewards.serve_ray`.
"""

from __future__ import annotations

import argparse
import json
import signal
import time

from rewards import build_from_spec
from rewards.errors import UserError


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward", required=True, help="NAME or 'NAME={json args}' of a registered reward")
    parser.add_argument("--app", default=None, help="the Serve application's name (default reward-NAME)")
    parser.add_argument(
        "--address",
        default=None,
        help="a running Ray cluster (auto, or ray://HEAD:10001); default: start a local Ray",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the HTTP proxy's interface (0.0.0.0: every one)")
    parser.add_argument("--port", type=int, default=8600, help="the HTTP proxy's port (shared by apps)")
    parser.add_argument("--route-prefix", default="/", help="where the app answers under the proxy")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--gpus-per-replica", type=float, default=0.0)
    parser.add_argument("--max-batch", type=int, default=64, help="most images scored in one call")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a batch waits for more")
    parser.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=None,
        help="requests a replica holds at once (default 2 x --max-batch)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests each caller (proxy or handle) queues beyond those; more answer 503 with Retry-After",
    )
    parser.add_argument("--retry-after", type=float, default=1.0, help="seconds a refused client waits")
    parser.add_argument("--num-cpus", type=int, default=None, help="a local Ray's logical CPUs")
    parser.add_argument(
        "--latency-ms-per-image",
        type=float,
        default=0.0,
        help="benchmarks only: add this wall time per scored image, standing in for a reward model "
        "on another GPU or machine (sleeps, using no CPU here)",
    )
    args = parser.parse_args(argv)
    if min(args.replicas, args.max_batch, args.max_queued_requests) < 1 or args.max_wait_ms < 0:
        parser.error("--replicas, --max-batch and --max-queued-requests must be >= 1, --max-wait-ms >= 0")
    if not args.route_prefix.startswith("/"):
        parser.error(f"--route-prefix must start with '/', got {args.route_prefix!r}")
    return args


def start(args) -> tuple[str, str]:
    """Deploy the app (starting a local Ray unless --address): (the reward's name, the app's)."""
    name, _ = build_from_spec(args.reward)  # a wrong name or args fails here, once, not in every replica
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UserError("diffrl-serve needs Ray Serve: pip install 'diffrl[serve]'") from None
    from rewards.serve_ray import reward_app

    app = args.app or f"reward-{name}"
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    application = reward_app(
        args.reward,
        replicas=args.replicas,
        cpus_per_replica=args.cpus_per_replica,
        gpus_per_replica=args.gpus_per_replica,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        retry_after_s=args.retry_after,
        latency_ms_per_image=args.latency_ms_per_image,
    )
    serve.run(application, name=app, route_prefix=args.route_prefix)
    return name, app


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> None:
    args = parse_args(argv)
    name, app = start(args)
    url = f"http://{args.host}:{args.port}{args.route_prefix.rstrip('/')}"
    print(
        f"serving reward '{name}' on {url} as Ray Serve app '{app}' "
        f"({args.replicas} replicas, batches of up to {args.max_batch} images)",
        flush=True,
    )
    # SIGTERM (a job scheduler, `kill`) stops as Ctrl-C does
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        stop(app)


def stop(app: str) -> None:
    """Delete the app (its replicas answer what they hold first) and print the ledger's
    counts, one JSON line for the log and scripts/bench_serve.py."""
    import ray
    from ray import serve

    from rewards.serve_ray import ledger_stats

    counts = ledger_stats(app)
    serve.delete(app)
    print(f"stopped: {json.dumps(counts)}", flush=True)
    ray.shutdown()

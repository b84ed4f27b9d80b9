"""Any registered reward as a Ray Serve deployment (``diffrl-serve``, ``scripts/serve_rewards.py``).

Ray Serve (docs.ray.io/en/latest/serve) runs the replicas: placed on a local Ray or a
cluster's nodes with CPUs and GPUs each, restarted when they die, balanced by its router,
with dynamic batching (``@serve.batch``: up to ``max_batch`` images, waiting ``max_wait_ms``
for more) and back-pressure (``max_ongoing_requests`` per replica, then
``max_queued_requests`` per caller, beyond which HTTP answers 503 with ``Retry-After`` and a
handle raises ``BackPressureError``). What Ray does not do is ours and lives in
:mod:`rewards.serve_endpoint` (the protocol ``remote`` speaks, deadlines) and
:mod:`rewards.request_ledger` (a retried batch scored once across replicas), here run as a
deployment-scoped actor shared by the replicas.

Three ways to run it:

* ``diffrl-serve --reward NAME[=JSON] --replicas 2 --gpus-per-replica 1`` (local Ray, or
  ``--address`` of a cluster);
* Ray's own CLI or a config file: ``serve run rewards.serve_ray:build_app reward=NAME
  replicas=2`` (``build_app``'s arguments are :func:`reward_app`'s);
* from Python: ``serve.run(reward_app("shapeworld"), name=..., route_prefix=...)``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import ray
from ray import serve
from ray.serve.config import DeploymentActorConfig
from starlette.requests import Request
from starlette.responses import Response

from rewards import build_from_spec
from rewards.request_ledger import RequestLedger
from rewards.serve_endpoint import RewardEndpoint, images_in, score_jobs

LEDGER = "request_ledger"
PING_TIMEOUT_S = 5.0  # a claim's replica that does not answer a ping this fast is presumed lost


async def _replica_answers(name: str) -> bool:
    """Whether the replica actor named ``name`` (in Serve's namespace) still answers."""
    try:
        actor = ray.get_actor(name, namespace="serve")
        await asyncio.wait_for(actor.__ray_ready__.remote(), PING_TIMEOUT_S)
        return True
    except (ValueError, ray.exceptions.RayActorError, asyncio.TimeoutError):
        return False


@ray.remote(num_cpus=0)
class LedgerActor(RequestLedger):
    """The ledger as an async actor: its replicas' claims are pinged through Ray."""

    def __init__(self, cache_size: int = 4096):
        super().__init__(alive=_replica_answers, cache_size=cache_size)


class _LedgerProxy:
    """The deployment-scoped ledger's methods as coroutines; its handle is looked up once
    and again whenever Serve has recreated the actor (a stale handle raises RayActorError)."""

    def __init__(self):
        self._actor = None

    def __getattr__(self, method: str):
        async def call(*args):
            for attempt in range(20):
                try:
                    if self._actor is None:
                        self._actor = serve.get_deployment_actor(LEDGER)
                    return await getattr(self._actor, method).remote(*args)
                except (ValueError, ray.exceptions.RayActorError):  # being recreated
                    self._actor = None
                    await asyncio.sleep(0.25 * (attempt + 1))
            raise RuntimeError("the reward deployment's request ledger did not come back within 50 s")

        return call


class RewardDeployment:
    """One replica: builds the reward (``NAME`` or ``NAME={json args}``) on its device,
    answers HTTP through Serve's proxy (``__call__``) and handles (``answer``) alike."""

    def __init__(self, reward: str, max_batch: int = 64, max_wait_ms: float = 5.0, latency_ms_per_image=0.0):
        self.name, self.reward = build_from_spec(reward)
        if ray.get_gpu_ids() and hasattr(self.reward, "to"):
            self.reward.to("cuda")  # Ray set CUDA_VISIBLE_DEVICES to this replica's GPUs
        self.latency = float(latency_ms_per_image) / 1000
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")  # one model call at a time
        self.max_batch = int(max_batch)
        self._score_batch.set_max_batch_size(self.max_batch)
        self._score_batch.set_batch_wait_timeout_s(float(max_wait_ms) / 1000)
        owner = ray.get_runtime_context().get_actor_name()
        self.endpoint = RewardEndpoint(self.reward, self.name, _LedgerProxy(), owner, self._score_one)

    async def __call__(self, request: Request) -> Response:
        prefix = request.scope.get("root_path", "")
        path = request.url.path[len(prefix) :] if request.url.path.startswith(prefix) else request.url.path
        out = await self.answer(request.method, path or "/", await request.body(), dict(request.headers))
        return Response(out.payload, status_code=out.status, headers=out.headers)

    async def answer(self, method: str, path: str, body: bytes, headers: dict):
        """The handle path: the same answer as HTTP, without the proxy hop."""
        return await self.endpoint.answer(method, path, body, headers)

    async def _score_one(self, job):
        if len(job.images) > self.max_batch:  # @serve.batch refuses it: scored on its own
            loop = asyncio.get_running_loop()
            return (await loop.run_in_executor(self.pool, score_jobs, self.reward, [job], self.latency))[0]
        return await self._score_batch(job)

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.005, batch_size_fn=images_in)
    async def _score_batch(self, jobs):
        self.endpoint.counts["batches"] += 1
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, score_jobs, self.reward, jobs, self.latency)


def reward_app(
    reward: str,
    replicas: int = 1,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float = 0.0,
    max_batch: int = 64,
    max_wait_ms: float = 5.0,
    max_ongoing_requests: int | None = None,
    max_queued_requests: int = 256,
    retry_after_s: float = 1.0,
    latency_ms_per_image: float = 0.0,
):
    """The bound application for ``serve.run``. ``max_ongoing_requests`` (requests a replica
    holds at once; default ``2 x max_batch``, so a batch can fill while one is scored) and
    ``max_queued_requests`` (requests each caller queues beyond that; more are refused with
    503 and ``Retry-After: retry_after_s``) are Ray Serve's back-pressure."""
    from ray.serve.config import BackpressureConfig

    if replicas < 1 or max_batch < 1 or max_wait_ms < 0 or max_queued_requests < 1:
        raise ValueError("reward_app: replicas, max_batch and max_queued_requests >= 1, max_wait_ms >= 0")
    deployment = serve.deployment(
        RewardDeployment,
        name="reward",
        num_replicas=int(replicas),
        ray_actor_options={"num_cpus": float(cpus_per_replica), "num_gpus": float(gpus_per_replica)},
        max_ongoing_requests=int(max_ongoing_requests or 2 * max_batch),
        max_queued_requests=int(max_queued_requests),
        backpressure_config=BackpressureConfig(retry_after_s=float(retry_after_s)),
        deployment_actors=[DeploymentActorConfig(name=LEDGER, actor_class=LedgerActor)],
        graceful_shutdown_timeout_s=120.0,  # a batch being scored finishes before its replica goes
    )
    return deployment.bind(reward, int(max_batch), float(max_wait_ms), float(latency_ms_per_image))


def build_app(args: dict):
    """Ray Serve's application builder: ``serve run rewards.serve_ray:build_app reward=NAME
    replicas=2 gpus_per_replica=1`` or an ``import_path`` in a Serve config file."""
    numbers = {"replicas": int, "max_batch": int, "max_ongoing_requests": int, "max_queued_requests": int}
    kwargs = {k: numbers.get(k, float)(v) if k != "reward" else v for k, v in args.items()}
    return reward_app(**kwargs)


def ledger_stats(app: str) -> dict:
    """The app's request-ledger counts (:class:`~rewards.request_ledger.RequestLedger`),
    through a handle: what was scored, cached, taken over and rescored (must stay 0)."""
    import json

    answer = serve.get_app_handle(app).answer.remote("GET", "/health", b"", {}).result(timeout_s=60)
    return json.loads(answer.payload)["ledger"]

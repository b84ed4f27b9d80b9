"""The ``remote`` reward against the service's protocol on 127.0.0.1 (tests/endpoint_server.py;
Ray Serve itself is the slow tier's, tests/rewards/test_serve_ray.py): the same scores as in
process, and one clear error (after bounded retries) for a service that is down, slow or
answers garbage; a replica lost mid-request is retried with the same id, the reward's own
error is not; never a silent zero."""

from __future__ import annotations

import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rewards import build
from rewards.combine import MultiReward, RewardPromptError
from rewards.prompts import AnnotatedPrompt, EditPrompt
from rewards.remote import RemoteReward, RemoteRewardError, decode_request, encode_request
from rewards.shapeworld import grammar
from rewards.shapeworld.render import render
from tests.endpoint_server import EndpointServer

PROMPTS = ["a red circle and a blue square", "two green triangles", "a cyan square above a red circle"]


def _images(prompts, seed=0):
    rnd = random.Random(seed)
    arrays = [torch.from_numpy(render(grammar.parse(p), rnd, 32)).permute(2, 0, 1) for p in prompts]
    images = torch.stack(arrays).float() / 255
    images[1] = images[1].flip(-1) * 0.9  # something imperfect too
    return images


@pytest.fixture
def shapeworld_server():
    server = EndpointServer(build("shapeworld"), "shapeworld")
    yield server.url, server
    server.stop()


def test_remote_scores_equal_in_process_scores(shapeworld_server):
    url, _ = shapeworld_server
    images = _images(PROMPTS)
    local = build("shapeworld")(images, PROMPTS)
    remote = RemoteReward(url)(images, PROMPTS)
    assert remote.keys() == ({"remote"} | local.keys()) - {"shapeworld"}
    torch.testing.assert_close(remote["remote"], local["shapeworld"], rtol=0, atol=0)
    for key in local.keys() - {"shapeworld"}:
        torch.testing.assert_close(remote[key], local[key].float(), rtol=0, atol=0, equal_nan=True)
    # uint8 on the wire: 4x smaller, the same verdicts on flat-coloured shapes
    small = RemoteReward(url, wire_dtype="uint8")(images, PROMPTS)
    torch.testing.assert_close(small["remote"], local["shapeworld"])


def test_the_wire_keeps_edit_prompts_their_images_and_metadata(tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    meta = {"tag": "counting", "include": [{"class": "circle", "count": 2}]}
    prompts = [EditPrompt("make it blue", tmp_path / "a.png"), "a plain prompt", AnnotatedPrompt("two", meta)]
    images, back = decode_request(encode_request(torch.rand(3, 3, 8, 8), prompts))
    assert back == prompts and isinstance(back[0], EditPrompt) and images.shape == (3, 3, 8, 8)
    assert back[2].metadata == meta and not hasattr(back[1], "metadata")  # GenEval lines keep their fields


def test_prompts_the_served_reward_refuses_fail_at_start_up(shapeworld_server):
    from diffrl.config import RewardSpec

    url, _ = shapeworld_server
    multi = MultiReward([RewardSpec(name="remote", weight=1.0, args={"url": url})])
    multi.check_prompts(PROMPTS)
    with pytest.raises(RewardPromptError, match=r"reward server .*\(shapeworld\).*outside the grammar"):
        multi.check_prompts(["a photo of a cat"])


def _stub(handler_body):
    """A server that answers every POST with ``handler_body(handler)``."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, payload, *headers = handler_body(self)
            self.send_response(status)
            for key, value in (headers[0] if headers else {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_server_that_is_down_is_one_clear_error_after_bounded_retries():
    server, url = _stub(lambda h: (200, b"{}"))
    server.shutdown()
    server.server_close()
    start = time.perf_counter()
    with pytest.raises(RemoteRewardError, match=r"did not answer /info after 3 tries.*diffrl-serve --reward"):
        RemoteReward(url, retries=2, backoff=0.05)
    assert time.perf_counter() - start < 5  # 0.05 + 0.1 s of pauses, not an endless wait


def test_a_slow_server_times_out_and_garbage_is_named():
    def slow(h):
        if h.path == "/info":
            return 200, b'{"reward": "slow"}'
        time.sleep(1.0)
        return 200, b"{}"

    server, url = _stub(slow)
    reward = RemoteReward(url, timeout=0.2, retries=1, backoff=0.0)
    with pytest.raises(RemoteRewardError, match=r"did not answer /score after 2 tries"):
        reward(torch.rand(1, 3, 8, 8), ["x"])
    server.shutdown()

    answers = {
        "not json": (200, b"hello"),
        "short": (200, b'{"reward": "r", "scores": {"r": [0.5]}}'),
        "nan": (200, b'{"reward": "r", "scores": {"r": [NaN, 1.0]}}'),
        "http error": (500, b'{"error": "RuntimeError: CUDA out of memory"}', {"X-Diffrl-Error": "reward"}),
    }
    expected = {
        "not json": "not JSON",
        "short": r"answered 'r' with 1 values for 2 images",
        "nan": "non-finite 'r' scores",
        "http error": r'answered HTTP 500: \{"error": "RuntimeError: CUDA out of memory"',
    }
    for case, answer in answers.items():
        server, url = _stub(lambda h, a=answer: (200, b'{"reward": "r"}') if h.path == "/info" else a)
        with pytest.raises(RemoteRewardError, match=expected[case]):
            RemoteReward(url, retries=0)(torch.rand(2, 3, 8, 8), ["x", "y"])
        server.shutdown()


def test_a_lost_replica_is_retried_with_the_same_id_and_back_pressure_is_waited_out():
    """A 500 that is not the protocol's (Ray Serve's proxy when a replica dies) and a 504
    are retried, with the same request id; a 503 is waited out for its Retry-After within
    the try; the reward's own error (marked X-Diffrl-Error) is not retried."""
    answers = [
        (503, b"Request dropped due to backpressure", {"Retry-After": "1"}),
        (500, b"Internal Server Error"),
        (504, b'{"error": "expired"}', {"X-Diffrl-Error": "expired"}),
        (200, b'{"reward": "r", "scores": {"r": [0.5]}}'),
    ]
    seen = []

    def scripted(h):
        if h.path == "/info":
            return 200, b'{"reward": "r"}'
        seen.append((h.headers["X-Request-Id"], time.monotonic()))
        return answers[len(seen) - 1]

    server, url = _stub(scripted)
    reward = RemoteReward(url, timeout=10, retries=2, backoff=0.01)
    out = reward(torch.rand(1, 3, 8, 8), ["x"])
    server.shutdown()
    assert out["remote"].tolist() == [0.5]
    assert len({rid for rid, _ in seen}) == 1 and len(seen) == 4  # one id on every try
    assert seen[1][1] - seen[0][1] >= 0.95  # the 503's Retry-After was honoured
    assert reward.stats["busy"] == 1 and reward.stats["lost"] == 1 and reward.stats["retries"] == 2

    calls = []
    marked = (500, b'{"error": "ValueError: bad prompt"}', {"X-Diffrl-Error": "reward"})
    server, url = _stub(
        lambda h: (200, b'{"reward": "r"}') if h.path == "/info" else calls.append(1) or marked
    )
    with pytest.raises(RemoteRewardError, match="bad prompt"):
        RemoteReward(url, retries=3, backoff=0.01)(torch.rand(1, 3, 8, 8), ["x"])
    server.shutdown()
    assert calls == [1]


def test_a_training_run_through_the_server_equals_the_in_process_run(shapeworld_server, tmp_path):
    """Two iterations of the tiny toy run, scored in process and through the server, whose
    scoring overlaps the rollout chunk by chunk: the same rewards, losses and weights (the
    wire is float32, and chunking does not change a sample)."""
    import json as json_module

    from diffrl.training.trainer import Trainer
    from tests.helpers import quick_config

    url, _ = shapeworld_server
    remote = f"rewards={json_module.dumps([{'name': 'remote', 'weight': 1.0, 'args': {'url': url}}])}"
    local = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path / "local"))
    chunks = "rollout.batch_size=2"  # each decoded chunk of 2 goes to the server during the rollout
    served = Trainer(quick_config("tiny_toy_flowgrpo", tmp_path / "served", remote, chunks))
    submitted = []
    submit = served.reward_fn.submit
    served.reward_fn.submit = lambda images, prompts: (
        submitted.append(len(prompts)) or submit(images, prompts)
    )
    for a, b in zip(local.fit(), served.fit(), strict=True):
        assert a["reward/mean"] == b["reward/mean"] and a["loss"] == b["loss"]
        assert a["reward/shapeworld_strict/mean"] == b["reward/shapeworld_strict/mean"]
    samples = served.cfg.rollout.prompts_per_step * served.cfg.rollout.group_size
    assert submitted == [2] * (2 * samples // 2)  # 2 iterations, every chunk scored as it was decoded
    for (name, p), (_, q) in zip(
        local.policy.trainable_named_parameters(), served.policy.trainable_named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name

"""The reward server and the ``remote`` reward, on 127.0.0.1: the same scores as in
process, batching across concurrent requests, and one clear error (after bounded retries)
for a server that is down, slow or answers garbage; never a silent zero."""

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
from rewards.serve import serve
from rewards.shapeworld import grammar
from rewards.shapeworld.render import render

PROMPTS = ["a red circle and a blue square", "two green triangles", "a cyan square above a red circle"]


def _images(prompts, seed=0):
    rnd = random.Random(seed)
    arrays = [torch.from_numpy(render(grammar.parse(p), rnd, 32)).permute(2, 0, 1) for p in prompts]
    images = torch.stack(arrays).float() / 255
    images[1] = images[1].flip(-1) * 0.9  # something imperfect too
    return images


@pytest.fixture
def shapeworld_server():
    server = serve(build("shapeworld"), "shapeworld", max_wait_ms=200)
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()


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


def test_concurrent_requests_are_scored_in_one_batch(shapeworld_server):
    url, server = shapeworld_server
    reward, images = RemoteReward(url), _images(PROMPTS)
    before = server.scorer.batches
    results = [None, None]
    barrier = threading.Barrier(2)

    def request(i):
        barrier.wait()
        results[i] = reward(images[i : i + 2], PROMPTS[i : i + 2])

    threads = [threading.Thread(target=request, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    local = build("shapeworld")(images, PROMPTS)["shapeworld"]
    torch.testing.assert_close(results[0]["remote"], local[:2])
    torch.testing.assert_close(results[1]["remote"], local[1:3])
    assert server.scorer.batches - before == 1  # both requests in one scoring call (200 ms window)


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
            status, payload = handler_body(self)
            self.send_response(status)
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
    with pytest.raises(
        RemoteRewardError, match=r"did not answer /info after 3 tries.*serve_rewards.py --reward"
    ):
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
        "http error": (500, b"RuntimeError: CUDA out of memory"),
    }
    expected = {
        "not json": "not JSON",
        "short": r"answered 'r' with 1 values for 2 images",
        "nan": "non-finite 'r' scores",
        "http error": "HTTP 500: RuntimeError: CUDA out of memory",
    }
    for case, answer in answers.items():
        server, url = _stub(lambda h, a=answer: (200, b'{"reward": "r"}') if h.path == "/info" else a)
        with pytest.raises(RemoteRewardError, match=expected[case]):
            RemoteReward(url, retries=0)(torch.rand(2, 3, 8, 8), ["x", "y"])
        server.shutdown()


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

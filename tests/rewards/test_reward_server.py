"""The client of flow_grpo's reward server (rewards/reward_server.py, issue 51 item 4),
against a loopback fake that speaks the protocol as yifan123/reward-server@92ac29fb's
app_geneval.py and app_deqa.py do: a pickled request posted to '/', a pickled answer,
HTTP 500 with the traceback text on an error. The fake's scores are a function of the
JPEG it decodes, so the test also checks what travels."""

from __future__ import annotations

import http.server
import io
import json
import os
import pickle
import threading

import pytest
import torch
from PIL import Image

import rewards
from rewards import geneval_rules as rules
from rewards.reward_server import PlainUnpickler, RewardServerError, plain_loads, task_metadata

TASKS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


class FakeRewardServer:
    """``mode``: geneval, deqa, error (500 with a traceback), evil (a pickle that would run
    a command when loaded), short (one score too few)."""

    def __init__(self, mode: str = "geneval"):
        self.mode, self.requests = mode, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                data = pickle.loads(body)  # the reference server's own loading of our request
                outer.requests.append(data)
                images = [Image.open(io.BytesIO(d), formats=["jpeg"]) for d in data["images"]]
                code, answer = outer.answer(images, data)
                self.send_response(code)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, images, data) -> tuple[int, bytes]:
        brightness = [sum(img.convert("L").getdata()) / (255 * img.width * img.height) for img in images]
        if self.mode == "error":
            return 500, b'Traceback (most recent call last):\n  ...\nKeyError: "meta_datas"\n'
        if self.mode == "evil":
            return 200, pickle.dumps(Exploit())
        if self.mode == "deqa":
            return 200, pickle.dumps({"outputs": brightness})
        scores = brightness[:-1] if self.mode == "short" else brightness
        strict = [1.0 if b > 0.5 else 0.0 for b in brightness]
        rewards_ = [0.0] * len(images) if data["only_strict"] else [1.0 - s for s in strict]
        groups = {
            t: [s if m["tag"] == t else -10.0 for s, m in zip(strict, data["meta_datas"])] for t in TASKS
        }
        response = {
            "scores": scores,
            "rewards": rewards_,
            "strict_rewards": strict,
            "group_rewards": groups,
            "group_strict_rewards": groups,
        }
        return 200, pickle.dumps(response)

    def close(self):
        self.httpd.shutdown()


MARKER = "/tmp/diffrl_reward_server_exploit_ran"


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


@pytest.fixture
def server(request):
    s = FakeRewardServer(getattr(request, "param", "geneval"))
    yield s
    s.close()


def _images():
    """A dark and a bright image (brightness 0.2 and 0.8 after JPEG, to within a few %)."""
    return torch.stack([torch.full((3, 32, 32), 0.2), torch.full((3, 32, 32), 0.8)])


PROMPTS = ["a photo of two wine glasses", "a photo of a pink handbag and a black scissors"]


def test_geneval_requests_carry_genevals_own_metadata_and_jpegs(server):
    reward = rewards.build("reward_server", url=server.url, app="geneval")
    out = reward(_images(), PROMPTS)
    (request,) = server.requests
    # the first two lines of flow_grpo's dataset/geneval/test_metadata.jsonl (ac4c86e), the
    # same prompts: the metadata travels exactly as those files hold it
    assert request["meta_datas"] == [
        {
            "tag": "counting",
            "include": [{"class": "wine glass", "count": 2}],
            "exclude": [{"class": "wine glass", "count": 3}],
            "prompt": "a photo of two wine glasses",
        },
        {
            "tag": "color_attr",
            "include": [
                {"class": "handbag", "count": 1, "color": "pink"},
                {"class": "scissors", "count": 1, "color": "black"},
            ],
            "prompt": "a photo of a pink handbag and a black scissors",
        },
    ]
    assert request["only_strict"] is True and all(d[:2] == b"\xff\xd8" for d in request["images"])  # JPEG
    torch.testing.assert_close(out["reward_server"], torch.tensor([0.2, 0.8]), atol=0.02, rtol=0)
    assert out["reward_server_strict"].tolist() == [0.0, 1.0]
    assert set(out) == {"reward_server", "reward_server_score", "reward_server_strict"}


def test_position_metadata_is_genevals():
    """GenEval's evaluation_metadata.jsonl (af4902f) line for this prompt."""
    meta = task_metadata(rules.parse_caption("a photo of a dog right of a teddy bear"))
    assert meta == json.loads(
        '{"tag": "position", "include": [{"class": "teddy bear", "count": 1}, '
        '{"class": "dog", "count": 1, "position": ["right of", 0]}], '
        '"prompt": "a photo of a dog right of a teddy bear"}'
    )


def test_strict_and_correct_scores_and_batches(server):
    reward = rewards.build("reward_server", url=server.url, score="correct", only_strict=False, batch_size=1)
    out = reward(_images(), PROMPTS)
    assert len(server.requests) == 2 and out["reward_server"].tolist() == [1.0, 0.0]
    assert server.requests[0]["only_strict"] is False
    with pytest.raises(ValueError, match="needs only_strict: false"):
        rewards.build("reward_server", url=server.url, score="correct")


@pytest.mark.parametrize("server", ["deqa"], indirect=True)
def test_deqa(server):
    out = rewards.build("reward_server", url=server.url, app="deqa")(_images())
    torch.testing.assert_close(out["reward_server"], torch.tensor([0.2, 0.8]), atol=0.02, rtol=0)
    assert set(server.requests[0]) == {"images"}


@pytest.mark.parametrize("server", ["evil"], indirect=True)
def test_a_response_that_names_code_is_refused_and_nothing_runs(server):
    if os.path.exists(MARKER):
        os.remove(MARKER)
    reward = rewards.build("reward_server", url=server.url)
    with pytest.raises(RewardServerError) as err:
        reward(_images(), PROMPTS)
    assert str(err.value).startswith(f"reward_server: refused {server.url}'s answer: it is not plain data (")
    assert "posix.system" in str(err.value) or "os.system" in str(err.value)
    assert not os.path.exists(MARKER)  # what the pickle would have run did not run


@pytest.mark.parametrize("server", ["error"], indirect=True)
def test_a_server_error_is_retried_then_reported_with_its_message(server):
    reward = rewards.build("reward_server", url=server.url, retries=1, backoff=0.0)
    with pytest.raises(RewardServerError, match=r'failed 2 times \(HTTP 500: KeyError: "meta_datas"\)'):
        reward(_images(), PROMPTS)
    assert len(server.requests) == 2


@pytest.mark.parametrize("server", ["short"], indirect=True)
def test_an_answer_of_the_wrong_length_is_refused(server):
    with pytest.raises(RewardServerError, match="without a list of 2 'scores'"):
        rewards.build("reward_server", url=server.url)(_images(), PROMPTS)


def test_nothing_listening_is_one_error_naming_the_fix():
    reward = rewards.build("reward_server", url="http://127.0.0.1:9", retries=0)
    with pytest.raises(RewardServerError, match="failed 1 times .*start the server"):
        reward(_images(), PROMPTS)


def test_the_plain_unpickler_loads_plain_data_only():
    data = {"scores": [0.5, 1], "name": "x", "raw": b"\x00", "nested": ({"a": None}, True), "s": {1}}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert plain_loads(pickle.dumps(data, protocol=protocol)) == data
    for forbidden in (torch.tensor([1.0]), Image.new("RGB", (2, 2)), range(3), Exploit()):
        with pytest.raises(pickle.UnpicklingError, match="plain data only"):
            PlainUnpickler(io.BytesIO(pickle.dumps(forbidden))).load()


def test_a_caption_that_is_not_genevals_fails_at_start_up():
    reward = rewards.build("reward_server", url="http://127.0.0.1:9")
    with pytest.raises(rules.CaptionError):
        reward.check_prompts(["a beautiful sunset"])


def test_a_metadata_line_travels_as_the_prompt_file_gives_it(server, tmp_path):
    """flow_grpo sends its jsonl lines; a line's caption need not parse (a user's own
    wording), and its extra fields go along as they are."""
    from diffrl.data.prompts import load_prompts

    line = {
        "tag": "counting",
        "include": [{"class": "knife", "count": 4}],
        "exclude": [{"class": "knife", "count": 5}],
        "prompt": "Four knives on a wooden board.",
        "source": "mine",
    }
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps({**line, "prompt": "Knives, four of them"}) + "\n")
    prompts = load_prompts(path)
    reward = rewards.build("reward_server", url=server.url, app="geneval")
    reward.check_prompts(prompts)
    rewards.prompt_checker("reward_server", url=server.url)(prompts)  # the same without a server
    reward(_images(), prompts)
    (request,) = server.requests
    assert request["meta_datas"] == [line, {**line, "prompt": "Knives, four of them"}]

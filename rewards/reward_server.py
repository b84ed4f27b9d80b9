"""A client of flow_grpo's reward server, so a run can score with the official stacks.

flow_grpo scores GenEval (and DeQA) in a separate server, ``yifan123/reward-server``
(commit 92ac29fb: ``app_geneval.py``, ``app_deqa.py``, ``reward_server/gen_eval.py``),
because GenEval's mmdetection Mask2Former does not install beside current training
stacks. Its protocol, as that code and flow_grpo's client (``flow_grpo/rewards.py:
geneval_score``) speak it: one HTTP POST to ``/`` whose body is a pickled dict

* GenEval: ``{"images": [JPEG bytes], "meta_datas": [GenEval metadata dict], "only_strict": bool}``,
  answered by a pickled ``{"scores", "rewards", "strict_rewards", "group_rewards",
  "group_strict_rewards"}``: per image the partial score (the mean of its clauses'
  credits, what flow_grpo trains on), GenEval's own verdict (0 when ``only_strict``) and
  the strict verdict (exact counts), and per task the same with -10 for other tasks;
* DeQA: ``{"images": [JPEG bytes]}``, answered by ``{"outputs": [score / 5]}``;

an error is HTTP 500 with the traceback as text. JPEG as flow_grpo's client makes it
(PIL's default quality, 75).

That server answers with pickles, and unpickling runs whatever a pickle names. The
response is therefore read by :class:`PlainUnpickler`, which refuses every global (any
class or function a pickle would import or call) but the constructors of bytes and sets
in the old protocols: only dicts, lists, tuples, sets, strings, bytes, numbers, booleans
and None load. GenEval's and DeQA's answers are exactly that; a
response carrying anything else is one error naming the server.

Registered as ``reward_server``: ``{name: reward_server, args: {url: http://HOST:18085,
app: geneval}}``. GenEval metadata is the prompt file's line where it has one (flow_grpo
sends its jsonl lines), else the prompt's caption parsed as the ``geneval`` reward parses
it (:func:`rewards.geneval_rules.parse_caption`, which gives GenEval's captions the dicts
their metadata lines hold).
"""

from __future__ import annotations

import io
import pickle
import time
import urllib.error
import urllib.request

import torch
from PIL import Image

from rewards import geneval_rules as rules
from rewards.images import to_tensor_batch, to_uint8_hwc

APPS = {"geneval": ("score", "correct", "strict"), "deqa": ("quality",)}
# GenEval's answer key of each score name
_GENEVAL_KEYS = {"score": "scores", "correct": "rewards", "strict": "strict_rewards"}


class RewardServerError(RuntimeError):
    """The reward server could not score, or answered something that is not its protocol."""


# the globals plain data needs in pickle protocols 0-3: bytes are rebuilt by
# _codecs.encode(str, "latin1"), sets by their constructors; none runs code of its own
PLAIN_GLOBALS = {
    ("_codecs", "encode"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "bytearray"),
}


class PlainUnpickler(pickle.Unpickler):
    """Loads plain data only: every ``find_class`` (a global: a class, a function, a
    module attribute) is refused, so no pickle can run code on load, except the few that
    protocols 0-3 use to rebuild bytes and sets (:data:`PLAIN_GLOBALS`)."""

    def find_class(self, module, name):
        if ("builtins" if module == "__builtin__" else module, name) in PLAIN_GLOBALS:  # protocols 0-2
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a pickle may not name {module}.{name} here (plain data only)")


def plain_loads(data: bytes):
    return PlainUnpickler(io.BytesIO(data)).load()


def jpeg_bytes(images) -> list[bytes]:
    """Each image as the JPEG flow_grpo's client sends (PIL's default quality)."""
    out = []
    for array in to_uint8_hwc(to_tensor_batch(images)):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG")
        out.append(buffer.getvalue())
    return out


def task_metadata(task: rules.Task) -> dict:
    """A :class:`~rewards.geneval_rules.Task` as a line of GenEval's metadata files."""

    def requirement(r: rules.Requirement) -> dict:
        out = {"class": r.cls, "count": r.count}
        if r.colour is not None:
            out["color"] = r.colour
        if r.position is not None:
            out["position"] = list(r.position)
        return out

    meta = {"tag": task.tag, "include": [requirement(r) for r in task.include]}
    if task.exclude:
        meta["exclude"] = [requirement(r) for r in task.exclude]
    meta["prompt"] = task.prompt
    return meta


def request_metadata(prompt: str) -> dict:
    """What the server is sent for one prompt: its metadata line as the prompt file gave it
    (flow_grpo sends its jsonl lines), or the line its caption parses to."""
    meta = getattr(prompt, "metadata", None) or {}
    if "include" in meta:
        rules.task_from_metadata(meta, str(prompt))  # checked: the server would fail mid-run
        return dict(meta)
    return task_metadata(rules.parse_caption(str(prompt)))


class RewardServerReward:
    """Scores through a running ``yifan123/reward-server`` app (``app``: geneval or deqa).

    ``score`` picks the optimised score: GenEval ``score`` (the partial score flow_grpo
    trains on), ``strict`` or ``correct`` (GenEval's own verdict; needs ``only_strict:
    false``); DeQA ``quality``. The others are logged as ``reward_server_<name>``.
    ``only_strict`` (GenEval, default True as flow_grpo trains) skips the server's second
    rule set. A batch is retried ``retries`` times on a refused connection or an HTTP 500,
    then fails with the server's own message."""

    name = "reward_server"

    def __init__(
        self,
        url: str,
        app: str = "geneval",
        score: str | None = None,
        only_strict: bool = True,
        batch_size: int = 64,
        timeout: float = 120.0,
        retries: int = 2,
        backoff: float = 1.0,
    ):
        if app not in APPS:
            raise ValueError(f"reward_server: app must be one of {', '.join(APPS)}, got '{app}'")
        score = score or APPS[app][0]
        if score not in APPS[app]:
            raise ValueError(f"reward_server: app {app} scores {', '.join(APPS[app])}, not '{score}'")
        if score == "correct" and only_strict:
            raise ValueError("reward_server: score 'correct' needs only_strict: false (the server skips it)")
        self.url, self.app, self.score, self.only_strict = url, app, score, bool(only_strict)
        self.batch_size, self.timeout, self.retries, self.backoff = (
            int(batch_size),
            timeout,
            int(retries),
            backoff,
        )

    def check_prompts(self, prompts) -> None:
        if self.app == "geneval":
            rules.check_captions(prompts, who="reward_server (geneval)")

    @classmethod
    def prompt_checker(cls, app: str = "geneval", **_):
        """The prompt check without a server (``--dry-run``, ``--preflight``)."""
        if app == "geneval":
            return lambda prompts: rules.check_captions(prompts, who="reward_server (geneval)")
        return None

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        batch = to_tensor_batch(images)
        prompts = list(prompts or [""] * len(batch))
        parts = [
            self._score_batch(batch[i : i + self.batch_size], prompts[i : i + self.batch_size])
            for i in range(0, len(batch), self.batch_size)
        ]
        scores = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        out = {self.name: scores[self.score]}
        out.update({f"{self.name}_{k}": v for k, v in scores.items()})
        return out

    def _score_batch(self, images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        request = {"images": jpeg_bytes(images)}
        if self.app == "geneval":
            request["meta_datas"] = [request_metadata(p) for p in prompts]
            request["only_strict"] = self.only_strict
        answer = self._post(pickle.dumps(request))
        return self._read(answer, len(images))

    def _read(self, answer: dict, n: int) -> dict[str, torch.Tensor]:
        keys = {"quality": "outputs"} if self.app == "deqa" else _GENEVAL_KEYS
        if self.app == "geneval" and self.only_strict:
            keys = {k: v for k, v in keys.items() if k != "correct"}
        out = {}
        for name, key in keys.items():
            values = answer.get(key) if isinstance(answer, dict) else None
            if not isinstance(values, list) or len(values) != n:
                raise RewardServerError(
                    f"reward_server: {self.url} answered without a list of {n} '{key}' "
                    f"(got {type(values).__name__}); is it a reward-server {self.app} app?"
                )
            out[name] = torch.tensor([float(v) for v in values], dtype=torch.float32)
        return out

    def _post(self, body: bytes):
        request = urllib.request.Request(self.url, data=body, method="POST")
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    data = response.read()
                break
            except urllib.error.HTTPError as err:
                message = err.read().decode("utf-8", "replace").strip().splitlines()
                failure = f"HTTP {err.code}: {message[-1] if message else err.reason}"
                if err.code != 500:
                    raise RewardServerError(f"reward_server: {self.url} answered {failure}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
                failure = str(getattr(err, "reason", err))
            if attempt == self.retries:
                raise RewardServerError(
                    f"reward_server: {self.url} failed {self.retries + 1} times ({failure}); start the "
                    "server (yifan123/reward-server: gunicorn 'app_geneval:create_app()') or fix args.url"
                )
            time.sleep(self.backoff * 2**attempt)
        try:
            return plain_loads(data)
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
            raise RewardServerError(
                f"reward_server: refused {self.url}'s answer: it is not plain data ({err}); only dicts, "
                "lists, strings and numbers are unpickled from a reward server"
            ) from None

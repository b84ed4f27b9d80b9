"""How a VLM judge's answer becomes a reward, shared by both backends of ``vlm_judge``
(transformers in process, :mod:`rewards.vlm_judge`; an OpenAI-compatible server,
:mod:`rewards.vlm_openai`), so that the two compute the same numbers from the same
probabilities.

Three modes, each a score in [0, 1]:

* ``yes_no``: ``P(yes) / (P(yes) + P(no))`` over the first answer token, the VQAScore of
  Lin et al. 2024 (arXiv:2404.01291, Eq. 1) renormalised to the two answers; Flow-Factory's
  ``vllm_evaluate`` reads P(Yes) the same way from an OpenAI-compatible server's top
  logprobs (X-GenGroup/Flow-Factory a0b2bc5a, ``src/flow_factory/rewards/vllm_evaluate.py:
  _get_yes_cond_prob``);
* ``score``: the question asks for one digit from ``low`` to ``high``; the expected digit
  ``E = sum_d d p(d) / sum_d p(d)`` (smooth in the model's belief, where the arg-max would
  jump) is normalised to ``(E - low) / (high - low)``;
* ``text``: the judge writes an answer (UnifiedReward style) and a regex reads the score
  from it, normalised the same way. Presets: ``final_score`` ("Final Score: x", flow_grpo
  ac4c86e8 ``flow_grpo/rewards.py: unifiedreward_score_sglang``), ``score_tag``
  ("<Score>x</Score>", flow_grpo ``flow_grpo/qwenvl.py: extract_scores``), ``axes``
  ("Alignment / Coherence / Style Score (1-5): x", their mean, verl-project/verl-omni
  a1139baf ``verl_omni/utils/reward_score/unified_reward.py``).

Where the references differ from us, on purpose: flow_grpo divides the parsed score by 5
(so 1-5 maps to [0.2, 1]); verl-omni and we map it to ``(x - 1) / 4`` in [0, 1]. The two
differ by an affine map, which group-normalised advantages do not see. flow_grpo and
verl-omni return 0 for an answer they cannot parse, and verl-omni falls back to any three
numbers in the text and clips the mean to [1, 5]; a 0 would be trained on as a verdict, so
here an unparseable or out-of-range answer is a :class:`VLMAnswerError` that quotes it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

MODES = ("yes_no", "score", "text")
DEFAULT_TEMPLATES = {
    "yes_no": 'Does this image show "{prompt}"? Answer Yes or No.',
    "score": 'How well does this image show "{prompt}"? Answer with one digit from {low} (not at all) '
    "to {high} (perfectly).",
    "text": 'How well does this image show "{prompt}", and how good is it as a picture? Explain briefly, '
    'then end with "Final Score: X", where X is a number from {low} to {high}.',
}
NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
# name -> (regex, flags); one group: the first match's number; two groups: (axis, number),
# the last number per axis, averaged over the axes
PATTERNS = {
    "final_score": (rf"Final Score:\s*({NUMBER})", 0),
    "score_tag": (rf"<Score>\s*({NUMBER})\s*</Score>", 0),
    "axes": (rf"(Alignment|Coherence|Style)\s+Score\s*(?:\(1-5\))?\s*:\s*({NUMBER})", re.IGNORECASE),
}
DEFAULT_MAX_TOKENS = 512  # verl-omni's budget for a UnifiedReward answer


class VLMAnswerError(RuntimeError):
    """The judge did not answer in the asked format; the message quotes the answer and the fix."""


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"vlm_judge: mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def check_template(template: str | None, mode: str, source: str | None = None) -> str:
    """The question: the mode's default, a preset read from the reference code
    (:mod:`rewards.vlm_templates`: ``unifiedreward``, from ``source`` or the pinned file),
    or the config's own text."""
    from rewards.vlm_templates import PRESETS, preset_template

    if source is not None and template not in PRESETS:
        raise ValueError(f"vlm_judge: template_source is read for a preset template ({', '.join(PRESETS)})")
    if template in PRESETS:
        return preset_template(template, source)
    template = DEFAULT_TEMPLATES[mode] if template is None else str(template)
    if "{prompt}" not in template:
        raise ValueError(
            f"vlm_judge: template must contain '{{prompt}}' where the image's prompt goes, got {template!r}"
        )
    return template


def question(template: str, prompt: str, low: float, high: float) -> str:
    """The template with the image's prompt and the scale's ends filled in."""
    text = template.replace("{prompt}", str(prompt))
    return text.replace("{low}", f"{low:g}").replace("{high}", f"{high:g}")


def digit_range(low: int, high: int) -> list[int]:
    if not 0 <= int(low) < int(high) <= 9:
        raise ValueError(f"vlm_judge: score mode needs single digits 0 <= low < high <= 9, got {low}..{high}")
    return list(range(int(low), int(high) + 1))


def check_max_tokens(max_tokens: int | None, mode: str) -> int:
    """One token for the logprob modes (only the first answer token is read); a budget for
    a written answer in ``text`` mode, where one token cannot hold "Final Score: 4"."""
    if mode != "text":
        if max_tokens not in (None, 1):
            raise ValueError(
                f"vlm_judge: mode {mode!r} reads the first answer token only, so max_tokens must be 1 "
                f"(or unset), got {max_tokens}; use mode: text for judges that write their answer"
            )
        return 1
    if max_tokens is None:
        return DEFAULT_MAX_TOKENS
    if int(max_tokens) < 2:
        raise ValueError(
            f"vlm_judge: mode 'text' parses a written answer, so max_tokens must be >= 2 "
            f"(default {DEFAULT_MAX_TOKENS}), got {max_tokens}"
        )
    return int(max_tokens)


def compile_pattern(pattern: str | None) -> re.Pattern:
    """A preset name or a regex with one group (the score) or two (an axis name, its score)."""
    pattern = pattern or "final_score"
    regex, flags = PATTERNS.get(pattern, (pattern, 0))
    try:
        compiled = re.compile(regex, flags)
    except re.error as err:
        raise ValueError(f"vlm_judge: pattern {pattern!r} is not a regex ({err})") from None
    if compiled.groups not in (1, 2):
        raise ValueError(
            f"vlm_judge: pattern {pattern!r} has {compiled.groups} groups; give one group around the score "
            f"(two: axis name, score), or a preset: {', '.join(PATTERNS)}"
        )
    return compiled


def strings(value) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


@dataclass(frozen=True)
class AnswerFormat:
    """What the judge is asked to answer and how that becomes the reward.

    ``answers``: the answer strings whose first-token probabilities are read, in the
    column order :meth:`read_probs` expects (the yes answers then the no answers, or the
    digits ``low..high``); empty in ``text`` mode."""

    mode: str
    answers: tuple[str, ...]
    n_yes: int
    low: float
    high: float
    pattern: re.Pattern | None = None
    unparsed_zero: bool = False  # a text answer without a score reads 0 (the references' way)

    @classmethod
    def from_args(cls, mode, yes, no, low, high, pattern, unparsed: str = "error") -> AnswerFormat:
        mode = check_mode(mode)
        if unparsed not in ("error", "zero"):
            raise ValueError(f"vlm_judge: unparsed must be error or zero, got {unparsed!r}")
        if unparsed == "zero" and mode != "text":
            raise ValueError("vlm_judge: unparsed applies to mode 'text' (written answers)")
        if pattern is not None and mode != "text":
            raise ValueError(f"vlm_judge: pattern is read in mode 'text' only; mode is {mode!r}")
        if mode == "yes_no":
            yes, no = strings(yes), strings(no)
            if not yes or not no or not all(yes + no):
                raise ValueError(f"vlm_judge: yes and no need one non-empty string each, got {yes} / {no}")
            return cls(mode, tuple(yes + no), len(yes), 0.0, 1.0)
        if mode == "score":
            digits = digit_range(low, high)
            return cls(mode, tuple(str(d) for d in digits), 0, float(digits[0]), float(digits[-1]))
        if not float(low) < float(high):
            raise ValueError(f"vlm_judge: mode 'text' needs low < high, got {low}..{high}")
        return cls(mode, (), 0, float(low), float(high), compile_pattern(pattern), unparsed == "zero")

    def normalise(self, raw: torch.Tensor) -> torch.Tensor:
        return (raw - self.low) / (self.high - self.low)

    def read_probs(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Scores from the answers' first-token probabilities ``p`` (B, len(answers));
        ``vlm_judge_answer_mass`` is how much probability the allowed answers get at all."""
        mass = p.sum(-1)
        tiny = torch.finfo(p.dtype).tiny  # softmax probabilities can underflow to 0; never divide by it
        if self.mode == "yes_no":
            score = p[:, : self.n_yes].sum(-1) / mass.clamp_min(tiny)
            return {"vlm_judge": score, "vlm_judge_answer_mass": mass}
        digits = torch.tensor([float(a) for a in self.answers], dtype=p.dtype, device=p.device)
        raw = (p * digits).sum(-1) / mass.clamp_min(tiny)
        return {"vlm_judge": self.normalise(raw), "vlm_judge_raw": raw, "vlm_judge_answer_mass": mass}

    def read_texts(self, texts: list[str], truncated: list[bool] | None = None) -> dict[str, torch.Tensor]:
        raw = [self.parse(t, bool(truncated and truncated[i]), i) for i, t in enumerate(texts)]
        unparsed = torch.tensor([math.isnan(r) for r in raw], dtype=torch.float32)
        raw = torch.tensor(raw, dtype=torch.float32).nan_to_num(0.0)  # only unparsed_zero gives NaN
        out = {"vlm_judge": self.normalise(raw), "vlm_judge_raw": raw}
        return {**out, "vlm_judge_unparsed": unparsed} if self.unparsed_zero else out

    def parse(self, text: str, truncated: bool = False, index: int = 0) -> float:
        """The score the answer states (mean over axes for a two-group pattern)."""
        if self.pattern.groups == 1:
            match = self.pattern.search(text)
            values = [float(match.group(1))] if match else []
        else:
            by_axis = {m.group(1).lower(): float(m.group(2)) for m in self.pattern.finditer(text)}
            values = list(by_axis.values())
        shown = " ".join(text.split())
        shown = repr(shown if len(shown) <= 240 else shown[:120] + " ... " + shown[-110:])
        if not values and self.unparsed_zero:
            return math.nan  # read as 0 and counted, as flow_grpo / DiffusionNFT score it
        if not values:
            why = (
                "; it was cut at max_tokens, raise max_tokens"
                if truncated
                else "; make the template ask for that format, or set pattern to a regex whose group "
                "captures the score"
            )
            raise VLMAnswerError(
                f"vlm_judge: answer {index} does not match pattern {self.pattern.pattern!r}: {shown}{why}"
            )
        if not all(self.low <= v <= self.high for v in values):
            raise VLMAnswerError(
                f"vlm_judge: answer {index} states {values}, outside the scale {self.low:g}..{self.high:g}: "
                f"{shown}; make the template name the scale, or set low/high to the judge's"
            )
        return sum(values) / len(values)

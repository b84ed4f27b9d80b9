"""VLM judge: a vision-language model answers a question about the image; the reward is
the probability it gives to the good answer.

Two readings of the first answer token's distribution, both from one forward pass (no
sampling, so the score is deterministic and smooth in the model's belief):

* ``mode: yes_no``: ``P(yes) / (P(yes) + P(no))`` over the answer tokens, the VQAScore of
  Lin et al. 2024 ("Evaluating Text-to-Visual Generation with Image-to-Text Generation",
  arXiv:2404.01291, Eq. 1) renormalised to the two answers, as UnifiedReward-style and
  Qwen-VL judges are read in flow-GRPO follow-ups;
* ``mode: score``: the question asks for one digit from ``low`` to ``high``; the reward is
  the expected digit ``sum_d d * p(d) / sum_d p(d)``, which moves with the model's belief
  where the arg-max digit would only jump.

``vlm_judge_answer_mass`` logs how much probability the allowed answers get at all: when
it is small, the model is not answering in the asked format and the score is noise.

The model is any transformers image-text-to-text checkpoint with a chat template
(Qwen2.5-VL by default), loaded with ``AutoModelForImageTextToText`` and ``AutoProcessor``
from a hub id or a ``save_pretrained`` directory. The question is the config's
``template`` with ``{prompt}`` replaced by the image's prompt.
"""

from __future__ import annotations

import inspect

import torch
from PIL import Image

from rewards.clip_common import ClipReward, hf_pretrained, to_model
from rewards.images import to_uint8_hwc

DEFAULT_TEMPLATE = 'Does this image show "{prompt}"? Answer Yes or No.'
MODES = ("yes_no", "score")


class VLMJudge(ClipReward):
    """``reward(images, prompts) -> {"vlm_judge": score, "vlm_judge_answer_mass": mass}``.

    Args:
        pretrained: hub id or directory of the VLM (``AutoModelForImageTextToText``).
        processor: its processor (with the chat template); None uses ``pretrained``.
        template: the question, with ``{prompt}`` where the image's prompt goes.
        mode: ``yes_no`` (score in [0, 1]) or ``score`` (expected digit in [low, high]).
        yes, no: answer strings for ``yes_no``, each one token of the model's tokenizer
            (several strings are summed, e.g. ``yes: [Yes, yes]``).
        low, high: the digit range for ``score`` (single digits, 0-9).
        device, dtype, batch_size: where and how to run; ``batch_size`` images per forward.
    """

    name = "vlm_judge"
    differentiable = False  # the processor resizes through uint8 PIL images
    default_pretrained = "Qwen/Qwen2.5-VL-7B-Instruct"

    def __init__(
        self,
        pretrained: str | None = None,
        processor: str | None = None,
        template: str = DEFAULT_TEMPLATE,
        mode: str = "yes_no",
        yes=("Yes",),
        no=("No",),
        low: int = 1,
        high: int = 5,
        device=None,
        dtype="float32",
        batch_size: int = 8,
    ):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        self.template, self.mode = check_template(template), check_mode(mode)
        pretrained = pretrained or self.default_pretrained
        self.model = hf_pretrained(
            self.name, AutoModelForImageTextToText, pretrained, output_loading_info=True
        )
        self.processor = hf_pretrained(self.name, AutoProcessor, processor or pretrained, arg="processor")
        self.processor.tokenizer.padding_side = "left"  # the answer slot is the last position of every row
        if not getattr(self.processor, "chat_template", None):
            raise ValueError(f"vlm_judge: the processor of '{processor or pretrained}' has no chat template")
        if mode == "yes_no":
            self.positive = answer_ids(self.processor.tokenizer, _strings(yes), "yes")
            self.negative = answer_ids(self.processor.tokenizer, _strings(no), "no")
        else:
            self.digits = digit_range(low, high)
            self.digit_ids = answer_ids(self.processor.tokenizer, [str(d) for d in self.digits], "digit")
        self._keeps_last_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._freeze()

    def _modules(self):
        return [self.model]

    def questions(self, prompts: list[str]) -> list[str]:
        """The chat-formatted text of each question, ready for the answer's first token."""
        texts = []
        for prompt in prompts:
            question = self.template.replace("{prompt}", prompt)
            message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            texts.append(
                self.processor.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
            )
        return texts

    def inputs(self, pixels: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        pil = [Image.fromarray(a) for a in to_uint8_hwc(pixels)]
        batch = self.processor(text=self.questions(prompts), images=pil, padding=True, return_tensors="pt")
        return to_model(batch, self.device, self.dtype)

    @torch.no_grad()
    def answer_logprobs(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """log p(first answer token) over the vocabulary, (B, V) in fp32."""
        extra = {"logits_to_keep": 1} if self._keeps_last_logits else {}
        logits = self.model(**self.inputs(pixels, prompts), **extra).logits[:, -1]
        return torch.log_softmax(logits.float(), dim=-1)

    def _score(self, pixels, prompts):
        probs = self.answer_logprobs(pixels, prompts).exp()
        if self.mode == "yes_no":
            p_yes, p_no = probs[:, self.positive].sum(-1), probs[:, self.negative].sum(-1)
            mass = p_yes + p_no
            score = p_yes / mass.clamp_min(torch.finfo(mass.dtype).tiny)
        else:
            p = probs[:, self.digit_ids]
            mass = p.sum(-1)
            digits = torch.tensor(self.digits, dtype=p.dtype, device=p.device)
            score = (p * digits).sum(-1) / mass.clamp_min(torch.finfo(mass.dtype).tiny)
        return {self.name: score, "vlm_judge_answer_mass": mass}


def check_template(template: str) -> str:
    if "{prompt}" not in str(template):
        raise ValueError(
            f"vlm_judge: template must contain '{{prompt}}' where the image's prompt goes, got {template!r}"
        )
    return str(template)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"vlm_judge: mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def digit_range(low: int, high: int) -> list[int]:
    if not 0 <= int(low) < int(high) <= 9:
        raise ValueError(f"vlm_judge: score mode needs single digits 0 <= low < high <= 9, got {low}..{high}")
    return list(range(int(low), int(high) + 1))


def _strings(value) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


def answer_ids(tokenizer, answers: list[str], what: str) -> list[int]:
    """The token id of each answer string; an answer the tokenizer splits is an error (its
    first piece alone would be scored, e.g. "Ye" for "Yes")."""
    ids = []
    for answer in answers:
        pieces = tokenizer.encode(answer, add_special_tokens=False)
        if len(pieces) != 1:
            raise ValueError(
                f"vlm_judge: {what} answer {answer!r} is {len(pieces)} tokens for this tokenizer; "
                f"use answers that are one token each (e.g. 'Yes' / 'No' for Qwen2.5-VL)"
            )
        ids.append(pieces[0])
    return ids

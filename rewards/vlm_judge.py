"""VLM judge: a vision-language model answers a question about the image, and the reward
is read from its answer (the modes and their references are in :mod:`rewards.vlm_answers`):

* ``mode: yes_no``: ``P(yes) / (P(yes) + P(no))`` of the first answer token (VQAScore,
  Lin et al. 2024, arXiv:2404.01291), as Flow-Factory's ``vllm_evaluate`` reads a judge;
* ``mode: score``: the expected digit of a ``low``-``high`` answer, normalised to [0, 1];
* ``mode: text``: the judge writes its answer and a regex reads the score, as flow_grpo
  reads UnifiedReward ("Final Score: x" / 5, "<Score>x</Score>" / 5) and verl-omni reads
  UnifiedReward 2.0 (three axis scores, ``(mean - 1) / 4``); an answer that cannot be
  parsed is an error, never a 0.

The first two read one forward pass (no sampling: the score is deterministic and smooth
in the model's belief); ``vlm_judge_answer_mass`` logs how much probability the allowed
answers get at all: when it is small, the model is not answering in the asked format.

Two backends, chosen by ``backend``:

* ``transformers`` (default): any image-text-to-text checkpoint with a chat template
  (Qwen2.5-VL by default), loaded in process with ``AutoModelForImageTextToText`` and
  ``AutoProcessor`` from a hub id or a ``save_pretrained`` directory;
* ``openai``: a judge served by vLLM, SGLang or any OpenAI-compatible server
  (:mod:`rewards.vlm_openai`), one request per image, scored while the rollout runs.

The question is the config's ``template`` with ``{prompt}`` (and ``{low}``, ``{high}``)
filled in.
"""

from __future__ import annotations

import inspect

import torch
from PIL import Image

from rewards.clip_common import ClipReward, hf_pretrained, to_model
from rewards.images import to_uint8_hwc
from rewards.vlm_answers import AnswerFormat, check_max_tokens, check_template, question
from rewards.vlm_openai import OpenAIVLMJudge

BACKENDS = ("transformers", "openai")


class TransformersVLMJudge(ClipReward):
    """``reward(images, prompts) -> {"vlm_judge": score in [0, 1], ...}`` in process.

    Args:
        pretrained: hub id or directory of the VLM (``AutoModelForImageTextToText``).
        processor: its processor (with the chat template); None uses ``pretrained``.
        template: the question, with ``{prompt}`` where the image's prompt goes; None
            asks the mode's default question; ``unifiedreward`` asks DiffusionNFT's
            UnifiedReward question, read from ``template_source`` (default: the pinned
            reference file, :mod:`rewards.vlm_templates`).
        mode: ``yes_no``, ``score`` or ``text``.
        yes, no: answer strings for ``yes_no``, each one token of the model's tokenizer
            (several strings are summed, e.g. ``yes: [Yes, yes]``).
        low, high: the scale (single digits 0-9 for ``score``).
        pattern: ``text`` mode's regex or preset (``final_score``, ``score_tag``, ``axes``).
        max_tokens: ``text`` mode's answer budget (greedy ``generate``), 512 by default.
        unparsed: ``text`` mode: ``error`` (an answer without a score stops the run) or
            ``zero`` (it reads 0 and ``vlm_judge_unparsed`` counts it, the references' way).
        device, dtype, batch_size: where and how to run; ``batch_size`` images per forward.
    """

    name = "vlm_judge"
    differentiable = False  # the processor resizes through uint8 PIL images
    default_pretrained = "Qwen/Qwen2.5-VL-7B-Instruct"

    def __init__(
        self,
        pretrained: str | None = None,
        processor: str | None = None,
        template: str | None = None,
        mode: str = "yes_no",
        yes=("Yes",),
        no=("No",),
        low: int = 1,
        high: int = 5,
        pattern: str | None = None,
        unparsed: str = "error",
        template_source: str | None = None,
        max_tokens: int | None = None,
        device=None,
        dtype="float32",
        batch_size: int = 8,
    ):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        self.format = AnswerFormat.from_args(mode, yes, no, low, high, pattern, unparsed)
        self.template, self.mode = check_template(template, mode, template_source), mode
        self.max_tokens = check_max_tokens(max_tokens, mode)
        pretrained = pretrained or self.default_pretrained
        self.model = hf_pretrained(
            self.name, AutoModelForImageTextToText, pretrained, output_loading_info=True
        )
        self.processor = hf_pretrained(self.name, AutoProcessor, processor or pretrained, arg="processor")
        self.processor.tokenizer.padding_side = "left"  # the answer slot is the last position of every row
        if not getattr(self.processor, "chat_template", None):
            raise ValueError(f"vlm_judge: the processor of '{processor or pretrained}' has no chat template")
        self.answer_ids = answer_ids(self.processor.tokenizer, list(self.format.answers), mode)
        self._keeps_last_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._freeze()

    def _modules(self):
        return [self.model]

    def questions(self, prompts: list[str]) -> list[str]:
        """The chat-formatted text of each question, ready for the answer's first token."""
        texts = []
        for prompt in prompts:
            text = question(self.template, prompt, self.format.low, self.format.high)
            message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
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

    @torch.no_grad()
    def answer_texts(self, pixels: torch.Tensor, prompts: list[str]) -> tuple[list[str], list[bool]]:
        """Greedy answers (and whether each was cut at ``max_tokens``)."""
        inputs = self.inputs(pixels, prompts)
        out = self.model.generate(**inputs, max_new_tokens=self.max_tokens, do_sample=False)
        new = out[:, inputs["input_ids"].shape[1] :]
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        truncated = [new.shape[1] >= self.max_tokens and not eos & set(row.tolist()) for row in new]
        return self.processor.batch_decode(new, skip_special_tokens=True), truncated

    def _score(self, pixels, prompts):
        if self.mode == "text":
            texts, truncated = self.answer_texts(pixels, prompts)
            return self.format.read_texts(texts, truncated)
        probs = self.answer_logprobs(pixels, prompts).exp()
        return self.format.read_probs(probs[:, self.answer_ids])


def answer_ids(tokenizer, answers: list[str], mode: str) -> list[int]:
    """The token id of each answer string; an answer the tokenizer splits is an error (its
    first piece alone would be scored, e.g. "Ye" for "Yes")."""
    ids = []
    for answer in answers:
        pieces = tokenizer.encode(answer, add_special_tokens=False)
        if len(pieces) != 1:
            what = "digit" if mode == "score" else "yes/no answer"
            raise ValueError(
                f"vlm_judge: {what} {answer!r} is {len(pieces)} tokens for this tokenizer; "
                f"use answers that are one token each (e.g. 'Yes' / 'No' for Qwen2.5-VL)"
            )
        ids.append(pieces[0])
    return ids


def VLMJudge(backend: str = "transformers", **args):  # a factory under the name the registry uses
    """The ``vlm_judge`` reward: :class:`TransformersVLMJudge` (``backend: transformers``)
    or :class:`~rewards.vlm_openai.OpenAIVLMJudge` (``backend: openai``). An argument of
    the other backend is one error naming the backend it belongs to."""
    if backend not in BACKENDS:
        raise ValueError(f"vlm_judge: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    cls = TransformersVLMJudge if backend == "transformers" else OpenAIVLMJudge
    unknown = [k for k in args if k not in VLMJudge.__signature__.parameters]
    if unknown:
        raise ValueError(f"vlm_judge has no argument {unknown[0]!r}; its arguments: {_names()}")
    foreign = [k for k in args if k not in inspect.signature(cls).parameters]
    if foreign:
        other = BACKENDS[1 - BACKENDS.index(backend)]
        raise ValueError(
            f"vlm_judge: {', '.join(foreign)} belong{'s' if len(foreign) == 1 else ''} to backend '{other}', "
            f"not '{backend}'; set backend: {other}, or drop {'it' if len(foreign) == 1 else 'them'}"
        )
    return cls(**args)


def _signature() -> inspect.Signature:
    """Both backends' arguments, so the registry names them all (and catches typos) before
    anything is built."""
    params = {"backend": inspect.Parameter("backend", inspect.Parameter.KEYWORD_ONLY, default="transformers")}
    for cls in (TransformersVLMJudge, OpenAIVLMJudge):
        for name, p in inspect.signature(cls).parameters.items():
            params.setdefault(name, p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
    return inspect.Signature(list(params.values()))


def _names() -> str:
    return ", ".join(VLMJudge.__signature__.parameters)


VLMJudge.__signature__ = _signature()

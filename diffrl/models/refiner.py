"""PromptRL's prompt refiner: a causal LM that rewrites each prompt before the flow model
renders it, trained by GRPO on its own tokens (PromptRL, "Prompt Matters in RL for
Flow-Based Image Generation"; G-U-N/UniRL@53c28c9 ``unirl/trainer/geneval_grpo_trainer.py``).

:class:`PromptRefiner` holds the LM (LoRA through peft, or every weight with a frozen
copy, ``refiner.lora_rank: 0``, as UniRL fine-tunes), samples rewrites
(:meth:`PromptRefiner.rewrite`) and scores its tokens (:meth:`PromptRefiner.token_logprobs`).

Rewrites of one prompt are sampled together, so a batch never left-pads a prompt: a
sequence is the prompt's tokens, then the rewrite's, then padding, and the log-probs
recomputed for training see every token where sampling saw it. The draws come from a
generator seeded by the samples' keys (:func:`diffrl.sampling.rng`), so an iteration
resumed from a checkpoint samples the rewrites the uninterrupted run sampled.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models import refiner_template as T
from diffrl.models.base import ModelLoadError
from rewards.prompts import EditPrompt

SHIPPED_REFINER = Path(__file__).resolve().parents[2] / "assets" / "toy_refiner"


@dataclass
class Rewrites:
    """The refiner's rewrites of a batch of prompts (one per sample)."""

    texts: list[str]  # what the flow model renders: the rewrite, or the prompt for kept members
    sequences: torch.Tensor  # (B, L) request + rewrite tokens, right-padded
    completion: torch.Tensor  # (B, L) bool: the rewrite's tokens (through its end token)
    old_logprobs: torch.Tensor  # (B, L) the sampling policy's log-prob of each token (0 off completion)
    formatted: torch.Tensor  # (B,) 1.0 where the answer came in the template's tags
    trained: torch.Tensor  # (B,) bool: a rewrite the LM trains on (False for kept originals)

    def rendered(self, prompts: list[str]) -> list[str]:
        """The texts as the flow model takes them (an editing prompt keeps its input image)."""
        return [rendered_like(p, t) for p, t in zip(prompts, self.texts)]


def rendered_like(prompt: str, text: str) -> str:
    """``text`` in place of ``prompt``'s words, keeping what the flow model reads besides
    them (an :class:`~rewards.prompts.EditPrompt`'s input image)."""
    return EditPrompt(text, prompt.image) if isinstance(prompt, EditPrompt) else str(text)


class PromptRefiner:
    """The LM, its tokenizer and the template it is asked through (see the module docstring)."""

    def __init__(self, lm, tokenizer, settings, reference=None):
        self.lm, self.tokenizer, self.settings = lm, tokenizer, settings
        self.reference = reference  # full fine-tuning's frozen copy; LoRA disables its adapter instead
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token

    # -- building --------------------------------------------------------------------------
    @classmethod
    def build(cls, settings, device="cpu", seed: int = 0) -> PromptRefiner:
        """The LM ``settings.model`` names (``refiner`` section), made trainable; a LoRA's
        initial weights are drawn from ``seed`` (the run's), so two builds are one."""
        from diffrl.models import tiny

        lm, tokenizer = load_lm(settings)
        lm.requires_grad_(False)
        reference = None
        if settings.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(
                r=settings.lora_rank,
                lora_alpha=settings.lora_alpha,
                target_modules="all-linear",
                lora_dropout=0.0,
            )
            # peft draws LoRA's A from the global generator, and asks transformers' deprecated
            # is_gradient_checkpointing (a warning that is not the user's to act on)
            with tiny.seeded(seed), warnings.catch_warnings():
                warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.*", FutureWarning)
                lm = get_peft_model(lm, lora)
            for p in lm.parameters():  # LoRA weights train in fp32 whatever the base's dtype
                if p.requires_grad:
                    p.data = p.data.float()
        else:
            reference = copy.deepcopy(lm).eval()
            lm.requires_grad_(True)
        return cls(
            lm.to(device), tokenizer, settings, reference.to(device) if reference is not None else None
        )

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.lm.parameters() if p.requires_grad]

    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device

    # -- sampling ----------------------------------------------------------------------------
    def rewrite(
        self,
        prompts: list[str],
        keys: list[tuple],
        greedy: bool = False,
        keep=None,
        group_size: int | None = None,
    ) -> Rewrites:
        """One rewrite per prompt; ``greedy`` decodes the most likely one (evaluation, as
        UniRL evaluates), ``keep[i]`` renders prompt i as it is.

        With ``group_size`` (training: keys ``(seed, iteration, group, member)``) each group's
        ``group_size`` rewrites are sampled together from a generator seeded by the group's
        key, and a sample takes its member's row: a process holding part of a group draws
        the rewrites one process holding all of it draws. Without it (evaluation), each run
        of equal consecutive prompts is sampled together, seeded by its first key."""
        keep = keep if keep is not None else [False] * len(prompts)
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # (request ids, completion ids) per sample
        for start, stop in _runs(prompts, keys if group_size else None):
            if group_size:
                request_ids, drawn = self._rewrite_group(prompts[start], keys[start][:-1], group_size, greedy)
                rows += [(request_ids, drawn[key[-1]]) for key in keys[start:stop]]
            else:
                request_ids, drawn = self._rewrite_group(prompts[start], keys[start], stop - start, greedy)
                rows += [(request_ids, ids) for ids in drawn]
        texts, seqs, completion, formatted = [], [], [], []
        for request_ids, ids in rows:
            text, ok = T.read_answer(self.settings.template, self._decode(ids))
            texts.append(text)
            formatted.append(float(ok))
            seqs.append(torch.cat([request_ids, ids]))
            completion.append(torch.cat([torch.zeros(len(request_ids), dtype=torch.bool), ids != -1]))
        texts = [p if k else t for p, t, k in zip(prompts, texts, keep)]
        sequences, mask = self._pad(seqs, completion)
        trained = torch.tensor([not k for k in keep])
        mask &= trained[:, None]
        with torch.no_grad():
            old = self.token_logprobs(sequences, mask) if not greedy else torch.zeros(mask.shape)
        return Rewrites(texts, sequences, mask, old.detach().cpu(), torch.tensor(formatted), trained)

    def _rewrite_group(self, prompt: str, key: tuple, count: int, greedy: bool):
        """(the request's token ids, ``count`` completions' ids through their end token)."""
        text = T.request(self.tokenizer, self.settings.template, str(prompt))
        request_ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        eos = self.tokenizer.eos_token_id
        batch = request_ids.repeat(count, 1).to(self.device)
        sampling = (
            {"do_sample": False} if greedy else {"do_sample": True, "temperature": self.settings.temperature}
        )
        with torch.no_grad(), _seeded(key):
            out = self.lm.generate(
                input_ids=batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=self.settings.max_new_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=eos,
                top_k=None,
                top_p=None,
                **sampling,
            )
        completions = []
        for row in out[:, len(request_ids) :].cpu():
            ends = (row == eos).nonzero()
            completions.append(row[: int(ends[0]) + 1] if len(ends) else row)
        return request_ids, completions

    def _decode(self, ids: torch.Tensor) -> str:
        """The completion's text with the tags kept (they are special tokens of a word-level
        twin; a real LM writes them as plain text) and the end and padding tokens dropped."""
        drop = {self.tokenizer.eos_token_id, self.tokenizer.pad_token_id}
        return self.tokenizer.decode([int(i) for i in ids if int(i) not in drop], skip_special_tokens=False)

    def _pad(self, seqs, completion):
        width = max(len(s) for s in seqs)
        pad = self.tokenizer.pad_token_id
        sequences = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.bool)
        for i, (s, c) in enumerate(zip(seqs, completion)):
            sequences[i, : len(s)], mask[i, : len(c)] = s, c
        return sequences, mask

    # -- scoring -------------------------------------------------------------------------------
    def token_logprobs(self, sequences: torch.Tensor, completion: torch.Tensor, reference: bool = False):
        """(B, L) log-prob of each completion token under the LM's sampling distribution
        (logits / temperature), 0 elsewhere; ``reference``: under the initial weights (the
        KL's reference: LoRA's adapter disabled, or full fine-tuning's frozen copy)."""
        sequences, completion = sequences.to(self.device), completion.to(self.device)
        attention = torch.ones_like(sequences)
        if reference:
            with self._reference() as model:
                logits = model(input_ids=sequences, attention_mask=attention).logits.float()
        else:
            logits = self.lm(input_ids=sequences, attention_mask=attention).logits.float()
        logits = logits[:, :-1] / self.settings.temperature
        picked = torch.log_softmax(logits, -1).gather(-1, sequences[:, 1:, None])[..., 0]
        out = torch.zeros(sequences.shape, device=self.device)
        out[:, 1:] = picked
        return torch.where(completion, out, torch.zeros_like(out))

    @contextlib.contextmanager
    def _reference(self):
        with torch.no_grad():
            if self.reference is not None:
                yield self.reference
                return
            with self.lm.disable_adapter():
                yield self.lm

    # -- saving --------------------------------------------------------------------------------
    def trained_state(self) -> dict[str, torch.Tensor]:
        """The trained weights (LoRA's, or every weight), by name, on the CPU."""
        return {n: p.detach().cpu().clone() for n, p in self.lm.named_parameters() if p.requires_grad}

    def load_trained_state(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.lm.named_parameters())
        missing = [n for n in state if n not in params]
        if missing:
            raise ModelLoadError(
                f"the saved refiner weights do not fit refiner.model '{self.settings.model}' "
                f"(first unknown: {missing[0]}); resume or evaluate with the run's own refiner settings"
            )
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)

    def save_pretrained(self, folder) -> None:
        """The refiner as users load it: a PEFT adapter folder (LoRA) or the whole LM, with
        its tokenizer."""
        self.lm.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)


def _runs(prompts: list[str], keys=None) -> list[tuple[int, int]]:
    """(start, stop) of each run of consecutive samples of one group: equal prompts, and
    with ``keys``, one group key (the key without its member index)."""

    def same(i: int, j: int) -> bool:
        equal = prompts[i] == prompts[j] and type(prompts[i]) is type(prompts[j])
        return equal and (keys is None or keys[i][:-1] == keys[j][:-1])

    runs, start = [], 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or not same(i, start):
            runs.append((start, i))
            start = i
    return runs


@contextlib.contextmanager
def _seeded(key: tuple):
    """Every draw inside from torch's generators seeded by ``key`` (transformers' sampling
    draws from the global generator), the caller's RNG state untouched."""
    from diffrl.sampling import rng

    seed = int(torch.randint(0, 2**62, (1,), generator=rng.generator("refiner", *key)))
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def load_lm(settings):
    """(the LM, its tokenizer): 'tiny' (a random twin), 'shapeworld' (assets/toy_refiner), a
    local folder or a hub id (a causal LM, or an image-text-to-text model such as
    Qwen2.5-VL, PromptRL's refiner, used on text)."""
    name = settings.model
    if name == "tiny":
        return tiny_refiner_lm()
    folder = SHIPPED_REFINER if name == "shapeworld" else name
    dtype = getattr(torch, settings.dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, revision=settings.revision)
    except OSError as err:
        raise ModelLoadError(
            f"refiner.model '{name}' could not be loaded ({str(err).splitlines()[0]}); give a hub id, a "
            "local folder written by save_pretrained, 'tiny' or 'shapeworld' "
            "(python scripts/pretrain_refiner.py rebuilds assets/toy_refiner)"
        ) from None
    try:
        lm = AutoModelForCausalLM.from_pretrained(folder, revision=settings.revision, dtype=dtype)
    except ValueError:  # not a causal LM class: a vision-language model, used on text
        from transformers import AutoModelForImageTextToText

        lm = AutoModelForImageTextToText.from_pretrained(folder, revision=settings.revision, dtype=dtype)
    return lm.eval(), tokenizer


def tiny_refiner_lm(hidden: int = 32, layers: int = 2, seed: int = 0):
    """The refiner's tiny twin: a random :func:`word_refiner_lm` (real transformers and peft
    classes, seconds on a CPU)."""
    return word_refiner_lm(hidden, layers, heads=4, seed=seed)


def word_refiner_lm(hidden: int, layers: int, heads: int, seed: int):
    """(a random Llama-architecture LM, the refiner's word-level tokenizer): the
    architecture of the tiny twin and of the ShapeWorld refiner (``toy/refiner_pretrain.py``),
    its weights drawn from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from diffrl.models import tiny
    from diffrl.models.refiner_words import refiner_tokenizer

    tokenizer = refiner_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    with tiny.seeded(seed):
        lm = LlamaForCausalLM(config)
    return lm.eval(), tokenizer

"""Pretraining the ShapeWorld refiner LM (``scripts/pretrain_refiner.py``, ``assets/toy_refiner``).

PromptRL starts from an instruct LM that already paraphrases (Qwen2.5-VL-3B-Instruct);
this is its miniature: a Llama-architecture causal LM (transformers) over the refiner's
word-level vocabulary (:mod:`diffrl.models.refiner_words`), taught to rewrite a ShapeWorld
prompt phrased one way into the same meaning phrased another way. Each example is

    <bos> INPUT <sep> OUTPUT <eos>

with INPUT and OUTPUT each, independently, the grammar's caption or a paraphrase in one
of the five styles (:mod:`rewards.shapeworld.paraphrase`), drawn uniformly over the six
forms, and the loss on the OUTPUT tokens only. So the LM rewrites, with no preference
among phrasings: its samples are as often a paraphrase as the caption the toy flow model
reads best. Which phrasing renders best is what RL has to find.

Only the **training** prompts' meanings are used (``grammar.split(seed)[0]``): the
held-out combinations, and the shipped held-out paraphrase file, are never seen. The
paraphrase *grammar* is shared with the evaluation, as a real LM knows the language its
evaluation is phrased in.

Everything random is keyed by (seed, step), so a run is reproducible on one torch build.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rewards.shapeworld import grammar
from rewards.shapeworld.paraphrase import CONVERSE, STYLES, paraphrase

FORMS = ("caption",) + STYLES


@dataclass(frozen=True)
class RefinerPretrainConfig:
    out: str = "assets/toy_refiner"
    steps: int = 3000
    batch: int = 128
    lr: float = 1e-3
    warmup: int = 100
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    seed: int = 0
    log_every: int = 250


def phrase(spec: grammar.Spec, form: str, rnd: random.Random) -> str:
    return spec.caption() if form == "caption" else paraphrase(spec, form, rnd)


def example(specs: list[grammar.Spec], rnd: random.Random) -> tuple[str, str]:
    """(input, output): one meaning, two independently drawn phrasings."""
    spec = rnd.choice(specs)
    return phrase(spec, rnd.choice(FORMS), rnd), phrase(spec, rnd.choice(FORMS), rnd)


def encode_batch(tokenizer, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels): ``<bos> input <sep> output <eos>`` right-padded, labels -100 outside
    the output and its end token."""
    rows, labels = [], []
    for source, target in pairs:
        head = tokenizer(f"<bos> {source} <sep>", add_special_tokens=False).input_ids
        tail = tokenizer(f"{target} <eos>", add_special_tokens=False).input_ids
        rows.append(head + tail)
        labels.append([-100] * len(head) + tail)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    return ids, lab


def build_lm(cfg: RefinerPretrainConfig):
    """(the LM, its tokenizer) before pretraining: the refiner's architecture at ``cfg``'s size."""
    from diffrl.models.refiner import word_refiner_lm

    return word_refiner_lm(cfg.hidden, cfg.layers, cfg.heads, cfg.seed)


def pretrain(cfg: RefinerPretrainConfig, log=print) -> dict:
    """Train, check, save to ``cfg.out``; returns the log written beside the weights."""
    lm, tokenizer = build_lm(cfg)
    specs = [grammar.parse(c) for c in grammar.split(cfg.seed)[0]]
    opt = torch.optim.AdamW(lm.parameters(), lr=cfg.lr, weight_decay=0.01)
    history, start = [], time.time()
    lm.train()
    for step in range(cfg.steps):
        rnd = random.Random(f"{cfg.seed}-{step}")
        ids, labels = encode_batch(tokenizer, [example(specs, rnd) for _ in range(cfg.batch)])
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
        loss = lm(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            history.append(
                {"step": step + 1, "loss": round(float(loss), 4), "seconds": round(time.time() - start)}
            )
            log(f"step {step + 1}: loss {float(loss):.4f}")
    lm.eval()
    checks = meaning_kept(lm, tokenizer, grammar.split(cfg.seed)[1])
    log(f"held-out meanings: {json.dumps(checks)}")
    out = Path(cfg.out)
    lm.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {
        "config": asdict(cfg),
        "history": history,
        "held_out_checks": checks,
        "minutes": (time.time() - start) / 60,
        "torch": torch.__version__,
    }
    (out / "pretrain_log.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def meaning_kept(lm, tokenizer, captions: list[str], samples: int = 4, seed: int = 1) -> dict[str, float]:
    """On held-out meanings phrased as paraphrases: the share of greedy rewrites and of
    sampled rewrites (temperature 1) that are a grammar caption of the same meaning, and
    the share of sampled rewrites that parse at all (the rest are paraphrases or broken)."""
    from diffrl.models.refiner import PromptRefiner
    from diffrl.schema.refiner import RefinerConfig

    settings = RefinerConfig(model="shapeworld", lora_rank=0, template="plain", max_new_tokens=32)
    refiner = PromptRefiner(lm, tokenizer, settings)
    rnd = random.Random(seed)
    inputs = [paraphrase(c, STYLES[i % len(STYLES)], rnd) for i, c in enumerate(captions)]
    greedy = refiner.rewrite(inputs, [("check", i) for i in range(len(inputs))], greedy=True).texts
    repeated = [p for p in inputs for _ in range(samples)]
    keys = [("check", i // samples, i % samples) for i in range(len(repeated))]
    sampled = refiner.rewrite(repeated, keys).texts
    targets = [c for c in captions for _ in range(samples)]
    return {
        "greedy_caption_same_meaning": _share(greedy, captions),
        "sampled_caption_same_meaning": _share(sampled, targets),
        "sampled_is_caption": sum(_parses(t) for t in sampled) / len(sampled),
    }


def _parses(text: str) -> bool:
    try:
        grammar.parse(text)
    except grammar.PromptGrammarError:
        return False
    return True


def _share(texts: list[str], captions: list[str]) -> float:
    """The share of ``texts`` that are grammar captions meaning their caption."""
    same = 0
    for text, caption in zip(texts, captions):
        if _parses(text):
            a, b = grammar.parse(text), grammar.parse(caption)
            same += (
                a == b
                or (a.kind == b.kind == "pair" and set(a.groups) == set(b.groups))
                or (
                    a.kind == b.kind == "relation"
                    and a.groups == b.groups[::-1]
                    and a.relation == CONVERSE[b.relation]
                )
            )
    return same / len(texts)

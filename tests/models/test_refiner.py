"""PromptRL's refiner LM (diffrl.models.refiner) on its tiny twin: reproducible rewrites,
log-probs of the distribution it samples from, its reference, its template."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffrl.models import refiner_template as T
from diffrl.models.refiner import PromptRefiner, rendered_like
from diffrl.models.refiner_words import refiner_tokenizer
from diffrl.schema.refiner import RefinerConfig
from rewards.prompts import EditPrompt

PROMPTS = ["a red circle"] * 3 + ["two blue squares"] * 2
KEYS = [(0, 5, 0, i) for i in range(3)] + [(0, 5, 1, i) for i in range(2)]


@pytest.fixture(scope="module")
def refiner():
    return PromptRefiner.build(RefinerConfig(model="tiny", max_new_tokens=10, template="plain"))


def test_rewrites_come_from_their_keys(refiner):
    a, b = refiner.rewrite(PROMPTS, KEYS), refiner.rewrite(PROMPTS, KEYS)
    assert torch.equal(a.sequences, b.sequences) and a.texts == b.texts
    other = refiner.rewrite(PROMPTS, [(0, 6, *k[2:]) for k in KEYS])
    assert not torch.equal(other.sequences, a.sequences)
    # a group's members share their request: its tokens open every row of the group
    request = refiner.tokenizer(
        T.request(refiner.tokenizer, "plain", "a red circle"), add_special_tokens=False
    )
    ids = torch.tensor(request.input_ids)
    assert all(torch.equal(a.sequences[i, : len(ids)], ids) for i in range(3))
    assert not bool(a.completion[:, : len(ids)].any()) and bool(a.completion[:3, len(ids)].all())


def test_the_stored_log_probs_are_the_sampling_distributions(refiner):
    """The log-prob trained on is the temperature-scaled softmax the token was drawn from
    (torch.distributions over the LM's own logits), and the stored one is the recomputed one."""
    settings = dataclasses.replace(refiner.settings, temperature=0.7)
    warm = PromptRefiner(refiner.lm, refiner.tokenizer, settings)
    r = warm.rewrite(PROMPTS, KEYS)
    with torch.no_grad():
        logits = warm.lm(input_ids=r.sequences).logits[:, :-1] / 0.7
        expected = torch.distributions.Categorical(logits=logits).log_prob(r.sequences[:, 1:])
        ours = warm.token_logprobs(r.sequences, r.completion)
    torch.testing.assert_close(
        ours[:, 1:][r.completion[:, 1:]], expected[r.completion[:, 1:]], rtol=1e-5, atol=1e-5
    )
    assert bool((ours[~r.completion] == 0).all())
    torch.testing.assert_close(r.old_logprobs, ours, rtol=0, atol=1e-6)


def test_sampled_first_tokens_follow_the_tempered_softmax(refiner):
    """2,000 one-token rewrites of one prompt: each token's frequency is its probability
    under softmax(logits / T) within sampling error (what the policy gradient assumes)."""
    import copy

    settings = dataclasses.replace(refiner.settings, temperature=1.5, max_new_tokens=1)
    peaked = copy.deepcopy(refiner.lm)
    with torch.no_grad():  # a random twin's logits are near uniform: sharpen them so T matters
        peaked.get_output_embeddings().weight.mul_(8)
    hot = PromptRefiner(peaked, refiner.tokenizer, settings)
    n = 2000
    r = hot.rewrite(["a red circle"] * n, [(1, 0, 0, i) for i in range(n)])
    first = r.sequences[torch.arange(n), r.completion.int().argmax(1)]
    request = r.sequences[0, : int(r.completion[0].int().argmax())]
    with torch.no_grad():
        probs = torch.softmax(hot.lm(input_ids=request[None]).logits[0, -1] / 1.5, -1)
    freq = torch.bincount(first, minlength=len(probs)).float() / n
    assert float((freq - probs).abs().max()) < 4 * float((probs * (1 - probs) / n).sqrt().max()) + 1e-3


def test_the_reference_is_the_initial_lm_and_moves_apart_as_the_lora_trains(refiner):
    r = refiner.rewrite(PROMPTS, KEYS)
    now = refiner.token_logprobs(r.sequences, r.completion)
    ref = refiner.token_logprobs(r.sequences, r.completion, reference=True)
    torch.testing.assert_close(now, ref)  # LoRA's B starts at zero
    saved = refiner.trained_state()
    with torch.no_grad():
        for p in refiner.trainable_parameters():
            p.add_(0.05)
    moved = refiner.token_logprobs(r.sequences, r.completion)
    again = refiner.token_logprobs(r.sequences, r.completion, reference=True)
    assert not torch.allclose(moved, now) and torch.allclose(again, ref)
    refiner.load_trained_state(saved)
    torch.testing.assert_close(refiner.token_logprobs(r.sequences, r.completion), now)


def test_kept_originals_are_rendered_as_written_and_never_trained(refiner):
    keep = [True, False, False, True, False]
    r = refiner.rewrite(PROMPTS, KEYS, keep=keep)
    assert [r.texts[i] for i in (0, 3)] == ["a red circle", "two blue squares"]
    assert r.trained.tolist() == [not k for k in keep]
    assert not bool(r.completion[0].any()) and bool(r.completion[1].any())
    edit = EditPrompt("make it blue", "in/0.png")
    assert rendered_like(edit, "paint it blue").image == "in/0.png"


def test_the_promptrl_template_asks_through_the_chat_template_and_reads_the_last_tagged_answer():
    tokenizer = refiner_tokenizer()
    text = T.request(tokenizer, "promptrl", "a red circle")
    assert text.startswith("<|user|> ") and text.endswith("a red circle <|assistant|>")
    assert "<answer>" in text  # the instruction names the tags
    assert T.read_answer("promptrl", "think <answer> a blue box </answer> <answer>two red dots</answer>") == (
        "two red dots",
        True,
    )
    assert T.read_answer("promptrl", "  a blue   box ") == ("a blue box", False)
    assert T.read_answer("plain", "a blue box <answer>") == ("a blue box <answer>", False)


def test_a_refiner_that_cannot_be_found_is_one_line(tmp_path):
    from diffrl.models.base import ModelLoadError

    with pytest.raises(ModelLoadError, match="refiner.model '.*nowhere' could not be loaded"):
        PromptRefiner.build(RefinerConfig(model=str(tmp_path / "nowhere")))


def test_a_saved_refiner_folder_loads_as_a_local_model(tmp_path):
    """Full fine-tuning's refiner saved as users load it, and read back by refiner.model PATH."""
    full = PromptRefiner.build(RefinerConfig(model="tiny", lora_rank=0, max_new_tokens=6, template="plain"))
    with torch.no_grad():
        for p in full.trainable_parameters():
            p.add_(0.01)
    full.save_pretrained(tmp_path / "lm")
    again = PromptRefiner.build(
        RefinerConfig(model=str(tmp_path / "lm"), lora_rank=0, max_new_tokens=6, template="plain")
    )
    a, b = full.rewrite(PROMPTS, KEYS, greedy=True), again.rewrite(PROMPTS, KEYS, greedy=True)
    assert torch.equal(a.sequences, b.sequences)


def test_two_builds_of_one_seed_are_the_same_refiner_and_another_seed_is_not():
    settings = RefinerConfig(model="tiny", template="plain")
    a, b = PromptRefiner.build(settings, seed=3), PromptRefiner.build(settings, seed=3)
    c = PromptRefiner.build(settings, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.trainable_parameters(), b.trainable_parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.trainable_parameters(), c.trainable_parameters()))


def test_the_shipped_shapeworld_refiner_loads_with_the_code_s_vocabulary_and_rewrites():
    """assets/toy_refiner: its tokenizer is refiner_tokenizer()'s (a vocabulary change
    would need a new pretraining), and a greedy rewrite of a paraphrase is ShapeWorld text."""
    shipped = PromptRefiner.build(RefinerConfig(model="shapeworld", template="plain", max_new_tokens=24))
    assert shipped.tokenizer.get_vocab() == refiner_tokenizer().get_vocab()
    (text,) = shipped.rewrite(["a crimson box"], [("t", 0)], greedy=True).texts
    assert text and set(text.split()) <= set(refiner_tokenizer().get_vocab())


def test_a_process_holding_part_of_a_group_draws_that_part_of_the_whole_group_s_rewrites(refiner):
    """Training keys (seed, iteration, group, member): members 2-3 of a group of 4 rewritten
    alone (the second of two processes) are rows 2-3 of the group rewritten whole."""
    prompts, keys = ["a red circle"] * 4, [(0, 7, 0, i) for i in range(4)]
    whole = refiner.rewrite(prompts, keys, group_size=4)
    part = refiner.rewrite(prompts[2:], keys[2:], group_size=4)
    assert part.texts == whole.texts[2:]
    width = part.sequences.shape[1]
    assert torch.equal(part.sequences, whole.sequences[2:, :width])
    torch.testing.assert_close(part.old_logprobs, whole.old_logprobs[2:, :width], rtol=0, atol=1e-6)

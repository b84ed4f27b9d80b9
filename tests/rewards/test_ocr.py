"""The ``ocr`` reward: flow_grpo's edit-distance accuracy over a transformers TrOCR model.

The tiny checkpoint is written as the real ones are: a ``VisionEncoderDecoderModel``
``save_pretrained`` directory (ViT encoder without its pooler, as TrOCR checkpoints ship)
with a ``TrOCRProcessor`` beside it.
"""

import functools
import random
import re

import pytest
import torch
from PIL import Image

import rewards
from diffrl.models import tiny
from rewards.clip_common import MissingRewardWeightsError
from rewards.images import to_uint8_hwc
from rewards.ocr import OCRPromptError, OCRReward, levenshtein, quoted_text, text_accuracy

START = EOS = 0  # <|endoftext|>, a special token, as TrOCR starts and ends with </s>


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import (
        TrOCRConfig,
        TrOCRForCausalLM,
        TrOCRProcessor,
        VisionEncoderDecoderModel,
        ViTConfig,
        ViTImageProcessor,
        ViTModel,
    )

    root = tmp_path_factory.mktemp("trocr")
    tok = tiny.qwen2_tokenizer()
    vit = ViTConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
    )
    decoder = TrOCRConfig(
        vocab_size=len(tok),
        d_model=32,
        decoder_layers=1,
        decoder_attention_heads=2,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        cross_attention_hidden_size=32,
        pad_token_id=0,
        eos_token_id=EOS,
        decoder_start_token_id=START,
    )
    with tiny.seeded(1):  # a seed whose greedy reading is letters ("inkink..."), not bytes
        model = VisionEncoderDecoderModel(
            encoder=ViTModel(vit, add_pooling_layer=False), decoder=TrOCRForCausalLM(decoder)
        )
    model.config.decoder_start_token_id, model.config.pad_token_id = START, 0
    model.generation_config.decoder_start_token_id = START
    model.save_pretrained(root)
    TrOCRProcessor(
        image_processor=ViTImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok
    ).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def reward(checkpoint):
    return OCRReward(pretrained=str(checkpoint), max_new_tokens=6)


def images(n=4, seed=0):
    return torch.rand(n, 3, 40, 48, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the formula


@functools.cache
def _reference_distance(a: str, b: str) -> int:
    """The recursive definition of edit distance (independent of the DP in rewards.ocr)."""
    if not a or not b:
        return len(a) + len(b)
    return min(
        _reference_distance(a[1:], b) + 1,
        _reference_distance(a, b[1:]) + 1,
        _reference_distance(a[1:], b[1:]) + (a[0] != b[0]),
    )


def test_levenshtein_matches_the_recursive_definition():
    rng = random.Random(0)
    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3
    for _ in range(200):
        a = "".join(rng.choice("abc") for _ in range(rng.randint(0, 7)))
        b = "".join(rng.choice("abc") for _ in range(rng.randint(0, 7)))
        assert levenshtein(a, b) == _reference_distance(a, b), (a, b)


@pytest.mark.parametrize(
    "recognised, target, expected",
    [
        ("OPEN", "open", 1.0),  # case is ignored
        ("Hello World", "helloworld", 1.0),  # spaces are ignored
        ("0PEN", "OPEN", 0.75),  # one substitution in four characters
        ("OPE", "OPEN", 0.75),  # one deletion
        ("completely different text", "OPEN", 0.0),  # distance clamped at the target's length
        ("", "OPEN", 0.0),
        ("anything", "", 0.0),  # nothing to spell: no credit
    ],
)
def test_accuracy_is_one_minus_clamped_distance_over_length(recognised, target, expected):
    assert text_accuracy(recognised, target) == pytest.approx(expected)


def _strict_accuracy(recognised: str, target: str) -> float:
    """The formula with the whole-string distance, from the recursive definition."""
    r, t = recognised.replace(" ", "").lower(), target.replace(" ", "").lower()
    return 1 - min(_reference_distance(r, t), len(t)) / len(t)


@pytest.mark.parametrize(
    "recognised, target",
    [("Cafe OPEN 24h", "OPEN"), ("xxopenxx", "Open"), ("Grand OPENING today", "open ing"), ("OPEN", "OPEN")],
)
def test_a_target_inside_the_recognised_text_is_exact_unless_asked_otherwise(recognised, target):
    # flow_grpo / Flow-Factory / verl-omni: distance 0 when the target is a substring
    assert text_accuracy(recognised, target) == 1.0
    strict = text_accuracy(recognised, target, contained_is_exact=False)
    assert strict == pytest.approx(_strict_accuracy(recognised, target))
    assert strict < 1.0 or recognised.lower() == target.lower()
    assert text_accuracy("Cafe OPEN 24h", "OPEN", contained_is_exact=False) == 0.0  # the example


def test_target_is_the_first_quoted_text():
    assert quoted_text('a neon sign that says "Open 24h", with "more"') == "Open 24h"
    assert quoted_text("a poster reading \u201cSALE\u201d") == "SALE"  # typographic quotes
    assert quoted_text("no quotes here") is None
    assert quoted_text('an unclosed "quote') is None
    assert quoted_text('empty "" quotes') is None


def test_prompts_without_quoted_text_are_one_error_naming_them(reward):
    reward.check_prompts(['a sign "OPEN"'])
    with pytest.raises(OCRPromptError, match=r"2 prompt\(s\).*'a cat'.*'a dog'.*between double quotes"):
        reward.check_prompts(['a sign "OPEN"', "a cat", "a dog"])


# ----------------------------------------------------------------------------- the model


def greedy_by_hand(reward, pixels: torch.Tensor, steps: int) -> list[str]:
    """Greedy decoding with full forwards (no generate, no cache), stopping at EOS."""
    pil = [Image.fromarray(a) for a in to_uint8_hwc(pixels)]
    values = reward.processor(images=pil, return_tensors="pt").pixel_values
    texts = []
    for row in values:
        ids = [START]
        for _ in range(steps):
            logits = reward.model(pixel_values=row[None], decoder_input_ids=torch.tensor([ids])).logits
            ids.append(int(logits[0, -1].argmax()))
            if ids[-1] == EOS:
                break
        texts.append(reward.processor.tokenizer.decode(ids, skip_special_tokens=True))
    return texts


def test_transcription_equals_greedy_decoding_by_hand_and_scores_it(reward):
    x = images()
    by_hand = greedy_by_hand(reward, x, steps=6)
    assert reward.read(x) == by_hand
    # targets: the model's own reading (accuracy 1), a one-character typo of it, and text it never reads
    first = by_hand[0].replace(" ", "")
    assert first.isalpha()
    typo = ("q" if first[0] != "q" else "z") + first[1:]
    prompts = [f'a sign "{first}"', f'a sign "{typo}"', 'a sign "zzzzzzzzzzzz"', 'a sign "zzzzzzzzzzzz"']
    metadata = {}
    out = reward(x, prompts, metadata)
    assert metadata["ocr"] == by_hand
    expected = [text_accuracy(t, quoted_text(p)) for t, p in zip(by_hand, prompts)]
    torch.testing.assert_close(out["ocr"], torch.tensor(expected))
    # the model's own reading beats a typo of it, which beats text it never reads
    assert out["ocr"][0] > out["ocr"][1] > out["ocr"][2] == 0.0
    assert out["ocr"][0] == 1.0 and out["ocr_exact"].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_a_target_inside_the_models_reading_is_exact_by_default_and_not_when_strict(checkpoint, reward):
    x = images(2)
    read = [t.replace(" ", "") for t in reward.read(x)]
    assert all(len(t) >= 4 for t in read)
    prompts = [f'a sign "{read[0][1:4]}"', f'a sign "{read[1][:3]}q"']  # inside it; not inside it
    out = reward(x, prompts)
    assert out["ocr"][0] == 1.0 and out["ocr_exact"].tolist() == [1.0, 0.0]
    assert out["ocr"][1] == pytest.approx(_strict_accuracy(read[1], read[1][:3] + "q"))
    strict = OCRReward(pretrained=str(checkpoint), max_new_tokens=6, contained_is_exact=False)(x, prompts)
    expected = [_strict_accuracy(t, quoted_text(p)) for t, p in zip(read, prompts)]
    torch.testing.assert_close(strict["ocr"], torch.tensor(expected))
    assert strict["ocr"][0] < 1.0 and strict["ocr_exact"].tolist() == [0.0, 0.0]


def test_scores_do_not_depend_on_batching_or_input_type(checkpoint, reward):
    x, prompts = images(), ['"ab"', '"cd"', '"yellow"', '"red"']
    out = reward(x, prompts)
    one_at_a_time = OCRReward(pretrained=str(checkpoint), max_new_tokens=6, batch_size=1)(x, prompts)
    torch.testing.assert_close(one_at_a_time, out)
    pil = [Image.fromarray(a) for a in to_uint8_hwc(x)]
    torch.testing.assert_close(reward(pil, prompts), out)


def test_builds_through_the_registry(checkpoint):
    built = rewards.build("ocr", pretrained=str(checkpoint), max_new_tokens=2)
    assert isinstance(built, OCRReward) and built.max_new_tokens == 2
    with pytest.raises(rewards.RewardArgsError, match="max_new_tokens must be >= 1"):
        rewards.build("ocr", pretrained=str(checkpoint), max_new_tokens=0)
    with pytest.raises(rewards.RewardArgsError, match="contained_is_exact must be true or false"):
        rewards.build("ocr", pretrained=str(checkpoint), contained_is_exact="yes")


def test_missing_weights_name_the_path_or_the_download(tmp_path):
    with pytest.raises(MissingRewardWeightsError, match=re.escape(str(tmp_path / "nope"))):
        OCRReward(pretrained=str(tmp_path / "nope"))
    with pytest.raises(MissingRewardWeightsError, match="hf download microsoft/trocr-base-printed"):
        OCRReward()  # the default hub id, with the hub unreachable

"""The ``vlm_judge`` reward (transformers backend) over a tiny Qwen2.5-VL written as the
real checkpoint is (a ``save_pretrained`` directory with a ``Qwen2VLProcessor`` and its
chat template). The openai backend is tested in test_vlm_openai.py.

The reference is a second code path: the first-token scores of ``model.generate``, whose
cache and M-RoPE position bookkeeping differ from the reward's single forward.
"""

import re

import pytest
import torch
from PIL import Image

import rewards
from diffrl.models import tiny
from diffrl.models.qwenimage import tiny_text_encoder_config
from diffrl.models.qwenimage_edit import QWEN_VL_IMAGE_PROCESSOR
from rewards.clip_common import MissingRewardWeightsError
from rewards.images import to_uint8_hwc
from rewards.vlm_answers import VLMAnswerError
from rewards.vlm_judge import TransformersVLMJudge, VLMJudge

# Qwen2.5-VL's chat layout, reduced to what a one-image user turn needs
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ content['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ("Yes", "No", "Does", "this", "image", "show", "Answer", "or", "Rate", "from")
PROMPTS = [
    "a red circle",
    "two blue squares left of a green triangle",
    "a cat",
    "a house at night by the sea",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    root = tmp_path_factory.mktemp("qwen_vl")
    tok = tiny.qwen2_tokenizer(extra_words=WORDS)
    with tiny.seeded(0):
        model = Qwen2_5_VLForConditionalGeneration(tiny_text_encoder_config(tok))
    model.save_pretrained(root)
    Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**QWEN_VL_IMAGE_PROCESSOR),
        tokenizer=tok,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def judge(checkpoint):
    return VLMJudge(pretrained=str(checkpoint))


def images(n=4, seed=0):
    return torch.rand(n, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


def first_token_probs_by_generate(judge, x, prompts):
    """Softmax of ``generate``'s first-step scores, one image at a time (no padding)."""
    rows = []
    for i in range(len(prompts)):
        out = judge.model.generate(
            **judge.inputs(x[i : i + 1], prompts[i : i + 1]),
            max_new_tokens=1,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        rows.append(torch.softmax(out.scores[0][0].float(), -1))
    return torch.stack(rows)


def test_yes_no_is_p_yes_over_p_yes_plus_p_no_by_generate(judge):
    x = images()
    out = judge(x, PROMPTS)
    probs = first_token_probs_by_generate(judge, x, PROMPTS)
    yes, no = judge.processor.tokenizer.convert_tokens_to_ids(["Yes", "No"])
    torch.testing.assert_close(
        out["vlm_judge"], probs[:, yes] / (probs[:, yes] + probs[:, no]), atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(
        out["vlm_judge_answer_mass"], probs[:, yes] + probs[:, no], atol=1e-6, rtol=1e-4
    )
    assert ((out["vlm_judge"] > 0) & (out["vlm_judge"] < 1)).all()


def test_score_mode_is_the_expected_digit_normalised_to_0_1(checkpoint):
    template = "Rate {prompt} from {low} to {high}."
    judge = VLMJudge(pretrained=str(checkpoint), mode="score", template=template, low=1, high=5)
    assert isinstance(judge, TransformersVLMJudge)
    x = images(seed=1)
    out = judge(x, PROMPTS)
    probs = first_token_probs_by_generate(judge, x, PROMPTS)
    ids = judge.processor.tokenizer.convert_tokens_to_ids([str(d) for d in range(1, 6)])
    p = probs[:, ids]
    expected = (p * torch.arange(1, 6)).sum(-1) / p.sum(-1)
    torch.testing.assert_close(out["vlm_judge_raw"], expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out["vlm_judge"], (expected - 1) / 4, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out["vlm_judge_answer_mass"], p.sum(-1), atol=1e-6, rtol=1e-4)
    assert ((out["vlm_judge"] >= 0) & (out["vlm_judge"] <= 1)).all()
    assert "Rate a cat from 1 to 5." in judge.questions(["a cat"])[0]


def test_text_mode_parses_greedy_answers_and_quotes_one_it_cannot_parse(checkpoint):
    """The tiny model writes noise: the error quotes ``generate``'s own greedy answer for the
    first image and, as that answer ran to max_tokens, says to raise it."""
    judge = VLMJudge(pretrained=str(checkpoint), mode="text", max_tokens=4, batch_size=2)
    x = images(2, seed=2)
    texts, cut = judge.answer_texts(x, PROMPTS[:2])
    inputs = judge.inputs(x[:1], PROMPTS[:1])
    alone = judge.model.generate(**inputs, max_new_tokens=4, do_sample=False)
    alone = alone[:, inputs["input_ids"].shape[1] :]
    assert texts[0] == judge.processor.batch_decode(alone, skip_special_tokens=True)[0]
    assert cut == [True, True]
    shown = " ".join(texts[0].split())
    with pytest.raises(VLMAnswerError, match=re.escape("answer 0 does not match pattern")) as err:
        judge(x, PROMPTS[:2])
    assert repr(shown) in str(err.value) and "cut at max_tokens, raise max_tokens" in str(err.value)


def test_left_padding_and_batching_do_not_change_scores(checkpoint, judge):
    """Prompts of different lengths are padded on the left so each row's last position is
    its answer slot; scores must equal one-at-a-time scoring."""
    x = images()
    batched = judge(x, PROMPTS)
    single = VLMJudge(pretrained=str(checkpoint), batch_size=1)(x, PROMPTS)
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-4)
    pil = [Image.fromarray(a) for a in to_uint8_hwc(x)]
    torch.testing.assert_close(judge(pil, PROMPTS), batched, atol=1e-6, rtol=1e-5)


def test_template_goes_into_the_question(judge):
    text = judge.questions(["a red circle"])[0]
    assert 'Does this image show "a red circle"? Answer Yes or No.' in text
    assert text.endswith("<|im_start|>assistant\n") and "<|image_pad|>" in text


@pytest.mark.parametrize(
    "args, message",
    [
        ({"template": "Is this good?"}, "template must contain '{prompt}'"),
        ({"mode": "likert"}, "mode must be one of yes_no, score, text"),
        ({"mode": "score", "low": 1, "high": 10}, "single digits"),
        ({"yes": ["Yessir"]}, "yes/no answer 'Yessir' is 3 tokens"),
        ({"mode": "text", "max_tokens": 1}, "max_tokens must be >= 2"),
    ],
)
def test_bad_arguments_are_one_clear_error(checkpoint, args, message):
    with pytest.raises(rewards.RewardArgsError, match=re.escape(message)):
        rewards.build("vlm_judge", pretrained=str(checkpoint), **args)


def test_missing_weights_name_the_path_or_the_download(tmp_path):
    with pytest.raises(MissingRewardWeightsError, match=re.escape(str(tmp_path / "nope"))):
        VLMJudge(pretrained=str(tmp_path / "nope"))
    with pytest.raises(MissingRewardWeightsError, match="hf download Qwen/Qwen2.5-VL-7B-Instruct"):
        VLMJudge()

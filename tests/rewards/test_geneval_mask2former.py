"""GenEval's detector through transformers (rewards/geneval_mask2former.py, issue 51
item 4): mmdetection's resizing and instance post-processing against their formulas, and
the reward built from a tiny random Mask2Former saved in the transformers format."""

from __future__ import annotations

import pytest
import torch

import rewards
from diffrl.models import tiny
from rewards import geneval_rules as rules
from rewards.geneval import GenEval
from rewards.geneval_mask2former import Mask2FormerDetector, instances, mask_boxes, preprocess, rescaled_size


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ((512, 512), (800, 800)),
        ((480, 640), (800, 1067)),
        ((1000, 3000), (444, 1333)),
        ((32, 32), (800, 800)),
    ],
)
def test_images_are_resized_as_mmcv_imrescale_fits_1333_by_800(size, expected):
    """scale = min(1333 / long side, 800 / short side), sizes rounded half up."""
    assert rescaled_size(*size) == expected


def test_preprocessing_normalises_in_0_255_units_and_pads_to_32():
    image = torch.full((1, 3, 30, 40), 0.5)  # -> 800 x 1067, padded to 800 x 1088
    x, resized = preprocess(image)
    assert resized == (800, 1067) and tuple(x.shape) == (1, 3, 800, 1088)
    mean, std = torch.tensor([123.675, 116.28, 103.53]), torch.tensor([58.395, 57.12, 57.375])
    torch.testing.assert_close(x[0, :, 400, 500], (127.5 - mean) / std)
    assert x[0, :, :, 1067:].abs().max() == 0  # zero padding after normalisation


def test_mask_boxes_are_mmdets_mask2bbox():
    masks = torch.zeros(2, 10, 20, dtype=torch.bool)
    masks[0, 3:7, 10:15] = True
    assert mask_boxes(masks).tolist() == [[10.0, 3.0, 15.0, 7.0], [0.0, 0.0, 0.0, 0.0]]


def test_instances_score_each_query_class_pair_by_its_probability_times_its_mask_quality():
    q, c = 2, 3
    class_logits = torch.tensor([[0.0, 5.0, 0.0, 0.0], [1.0, 0.0, 0.0, 2.0]])  # last column: no object
    mask_logits = torch.full((q, 8, 8), -4.0)
    mask_logits[0, 2:5, 1:7] = 3.0
    mask_logits[1, 6:8, 0:2] = 1.0
    labels, scores, boxes, masks = instances(class_logits, mask_logits, (8, 8), (8, 8), (8, 8))
    assert len(labels) == q * c  # fewer pairs than mmdet's 100: all of them
    probs = class_logits.softmax(-1)[:, :-1]
    for label, score, box, mask in zip(labels.tolist(), scores.tolist(), boxes.tolist(), masks):
        query = 0 if mask[3, 3] else 1
        on = mask_logits[query] > 0
        quality = mask_logits[query].sigmoid()[on].mean()
        assert score == pytest.approx(float(probs[query, label] * quality), rel=1e-5)
        assert box == ([1.0, 2.0, 7.0, 5.0] if query == 0 else [0.0, 6.0, 2.0, 8.0])
    best = int(scores.argmax())
    assert labels[best] == 1 and masks[best].sum() == 18


def test_masks_come_back_at_the_image_s_size_through_the_padded_input():
    """Logits at a quarter of the padded input; the image's part of it is resized back."""
    mask_logits = torch.full((1, 4, 6), -5.0)
    mask_logits[0, :, :3] = 5.0  # the left half of the padded input (24 px of 24 x 16 used)
    _, _, boxes, masks = instances(torch.tensor([[4.0, 0.0]]), mask_logits, (16, 24), (16, 12), (32, 24))
    assert tuple(masks.shape) == (1, 32, 24) and masks[0].all()  # the image is exactly that half
    assert boxes.tolist() == [[0.0, 0.0, 24.0, 32.0]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import (
        CLIPConfig,
        CLIPModel,
        CLIPVisionConfig,
        Mask2FormerConfig,
        Mask2FormerForUniversalSegmentation,
        SwinConfig,
    )

    root = tmp_path_factory.mktemp("mask2former")
    swin = SwinConfig(
        image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
        window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"],
    )  # fmt: skip
    config = Mask2FormerConfig(
        backbone_config=swin, hidden_dim=32, num_queries=12, encoder_layers=1, decoder_layers=2,
        feature_size=32, mask_feature_size=32, encoder_feedforward_dim=64, dim_feedforward=64,
        num_attention_heads=2, id2label=dict(enumerate(rules.COCO_CLASSES)),
    )  # fmt: skip
    with tiny.seeded(0):
        Mask2FormerForUniversalSegmentation(config).save_pretrained(root / "m2f")
        config.id2label = {0: "thing", 1: "stuff"}
        config.label2id = {"thing": 0, "stuff": 1}
        Mask2FormerForUniversalSegmentation(config).save_pretrained(root / "m2f_two")
    clip_tok = tiny.clip_tokenizer()
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32
    )
    clip_cfg = CLIPConfig(
        text_config=tiny.clip_text_config(clip_tok, projection_dim=16).to_dict(),
        vision_config=CLIPVisionConfig(**vision, patch_size=8, projection_dim=16).to_dict(),
        projection_dim=16,
    )
    with tiny.seeded(1):
        CLIPModel(clip_cfg).save_pretrained(root / "clip")
    clip_tok.save_pretrained(root / "clip")
    return root


def test_a_mask2former_checkpoint_gets_genevals_thresholds_and_no_suppression(checkpoints):
    reward = GenEval(detector=str(checkpoints / "m2f"), clip=str(checkpoints / "clip"))
    assert isinstance(reward.detector, Mask2FormerDetector)
    assert reward.thresholds == {"other": 0.3, "counting": 0.9} and reward.max_overlap == 1.0


def test_the_detector_finds_masked_objects_of_the_asked_classes(checkpoints):
    detector = Mask2FormerDetector(str(checkpoints / "m2f"), torch.device("cpu"), torch.float32)
    images = torch.rand((2, 3, 32, 48), generator=torch.Generator().manual_seed(0))
    found = detector(images, ["dog", "cup"])
    assert len(found) == 2
    for per_class in found:
        assert set(per_class) <= {"dog", "cup"}
        for f in (f for fs in per_class.values() for f in fs):
            assert tuple(f.mask.shape) == (32, 48) and 0 <= f.score <= 1
            assert 0 <= f.box[0] <= f.box[2] <= 48 and 0 <= f.box[1] <= f.box[3] <= 32
    total = sum(len(fs) for fs in found[0].values())
    assert total <= 100


def test_the_reward_runs_end_to_end_on_the_tiny_mask2former(checkpoints):
    reward = rewards.build("geneval", detector=str(checkpoints / "m2f"), clip=str(checkpoints / "clip"))
    images = torch.rand((2, 3, 32, 32), generator=torch.Generator().manual_seed(1))
    out = reward(images, ["a photo of a dog", "a photo of a red cup and a blue dog"])
    for key in ("geneval", "geneval_partial", "geneval_strict", "geneval_correct"):
        assert out[key].shape == (2,) and ((out[key] >= 0) & (out[key] <= 1)).all()


def test_a_checkpoint_that_is_not_a_coco_instance_model_is_refused(checkpoints):
    with pytest.raises(
        ValueError, match="has 2 classes; GenEval's Mask2Former is a COCO instance model with 80"
    ):
        Mask2FormerDetector(str(checkpoints / "m2f_two"), torch.device("cpu"), torch.float32)

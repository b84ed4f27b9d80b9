"""The ``geneval`` reward's models on tiny checkpoints written in their ``save_pretrained``
formats: OWLv2 candidates and CLIP colours against by-hand decodes, and the whole reward."""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import rewards
from diffrl.models import tiny
from rewards import geneval_rules as rules
from rewards.clip_common import MissingRewardWeightsError
from rewards.geneval import GenEval
from rewards.geneval_models import (
    COLOUR_TEMPLATES,
    DETECTOR_THRESHOLDS,
    ClipColours,
    OwlDetector,
    ThresholdsError,
    colour_crop,
    crop,
    detector_thresholds,
)
from rewards.geneval_rules import Found

# ----------------------------------------------------------------------------- OWLv2 + CLIP


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import (
        CLIPConfig,
        CLIPModel,
        CLIPVisionConfig,
        Owlv2Config,
        Owlv2ForObjectDetection,
        Owlv2ImageProcessor,
        Owlv2Processor,
    )

    root = tmp_path_factory.mktemp("geneval")
    tok = tiny.clip_tokenizer(model_max_length=16, specials_last=True)  # OWL masks queries starting with id 0
    text = dict(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=16, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    with tiny.seeded(0):
        owl = Owlv2ForObjectDetection(Owlv2Config(text_config=text, vision_config=vision, projection_dim=32))
    owl.save_pretrained(root / "owl")
    Owlv2Processor(
        image_processor=Owlv2ImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok
    ).save_pretrained(root / "owl")
    clip_tok = tiny.clip_tokenizer()
    clip_cfg = CLIPConfig(
        text_config=tiny.clip_text_config(clip_tok, projection_dim=16).to_dict(),
        vision_config=CLIPVisionConfig(**vision, projection_dim=16).to_dict(),
        projection_dim=16,
    )
    with tiny.seeded(1):
        CLIPModel(clip_cfg).save_pretrained(root / "clip")
    clip_tok.save_pretrained(root / "clip")
    return root


def test_owl_candidates_equal_a_by_hand_decode(checkpoints):
    detector = OwlDetector(str(checkpoints / "owl"), torch.device("cpu"), torch.float32)
    x = torch.rand(2, 3, 40, 56, generator=torch.Generator().manual_seed(0))
    classes = ["dog", "cat"]
    got = detector(x, classes)
    from PIL import Image

    from rewards.images import to_uint8_hwc

    pil = [Image.fromarray(a) for a in to_uint8_hwc(x)]
    inputs = detector.processor(
        text=[["a photo of a dog", "a photo of a cat"]] * 2, images=pil, return_tensors="pt"
    )
    with torch.no_grad():
        out = detector.model(**inputs)
    best, labels = out.logits.max(-1)  # each box goes to its best query (by logit: sigmoids saturate and tie)
    probs = torch.sigmoid(best)
    cx, cy, w, h = out.pred_boxes.unbind(-1)
    corners = (
        torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1) * 56
    )  # the padded square's side
    for i in range(2):
        expected = {}
        for b, p, lab in zip(corners[i].tolist(), probs[i].tolist(), labels[i].tolist()):
            if p > 0:
                expected.setdefault(classes[lab], []).append((b, p))
        assert sorted(got[i]) == sorted(expected)
        for cls in expected:
            mine = [(list(f.box), f.score) for f in got[i][cls]]
            for (b1, p1), (b2, p2) in zip(mine, expected[cls]):
                assert p1 == pytest.approx(p2, abs=1e-6) and b1 == pytest.approx(b2, abs=1e-4)


def test_colours_are_clip_zero_shot_with_averaged_templates(checkpoints):
    colours = ClipColours(str(checkpoints / "clip"), torch.device("cpu"), torch.float32)
    image = torch.rand(3, 48, 48, generator=torch.Generator().manual_seed(2))
    found = [
        Found((0, 0, 20, 30)),
        Found((10, 5, 48, 48)),
        Found((30.4, 30.6, 31.0, 31.2)),
    ]  # the last: one pixel
    got = colours(image, found, "dog")
    model, tok = colours.model, colours.tokenizer
    classifier = []
    for c in rules.GENEVAL_COLOURS:
        enc = tok(
            [t.format(c=c, cls="dog") for t in COLOUR_TEMPLATES],
            padding="max_length",
            max_length=77,
            return_tensors="pt",
        )
        with torch.no_grad():
            text = model.get_text_features(**enc)
        text = getattr(text, "pooler_output", text)
        classifier.append(F.normalize(F.normalize(text, dim=-1).mean(0), dim=-1))
    expected = []
    for f in found:
        pixels = colours.preprocess(crop(image, f.box))
        with torch.no_grad():
            out = model(pixel_values=pixels, input_ids=enc["input_ids"][:1])
        expected.append(
            rules.GENEVAL_COLOURS[
                int((F.normalize(out.image_embeds, dim=-1) @ torch.stack(classifier).T).argmax())
            ]
        )
    assert got == expected
    assert crop(image, (30.4, 30.6, 31.0, 31.2)).shape == (3, 1, 1)


def _pil_crop(image: torch.Tensor, box, mask=None) -> torch.Tensor:
    """GenEval's ImageCrops in PIL: the mask composited onto #999, then crop (clipped box)."""
    from PIL import Image

    from rewards.images import to_uint8_hwc

    pil = Image.fromarray(to_uint8_hwc(image[None])[0])
    if mask is not None:
        pil = Image.composite(pil, Image.new("RGB", pil.size, color="#999"), Image.fromarray(mask.numpy()))
    h, w = image.shape[-2:]
    x0, y0 = max(round(box[0]), 0), max(round(box[1]), 0)
    x1, y1 = min(round(box[2]), w), min(round(box[3]), h)
    return torch.tensor(np.asarray(pil.crop((x0, y0, x1, y1)))).permute(2, 0, 1).float() / 255


def _record_crops(colours: ClipColours) -> list:
    """The crops ``colours`` classifies, in order (before CLIP's resize and normalisation)."""
    seen, preprocess = [], colours.preprocess
    colours.preprocess = lambda pixels: seen.append(pixels) or preprocess(pixels)
    return seen


def test_clip_sees_genevals_masked_crop_when_a_detection_has_a_mask(checkpoints):
    image = (torch.rand(3, 48, 48, generator=torch.Generator().manual_seed(4)) * 255).round() / 255
    mask = torch.zeros(48, 48, dtype=torch.bool)
    mask[10:30, 12:40] = True
    found = [Found((8.0, 6.0, 44.0, 35.0), mask=mask), Found((0, 0, 20, 20))]  # with and without a mask
    for masks in (True, False):
        colours = ClipColours(str(checkpoints / "clip"), torch.device("cpu"), torch.float32, masks=masks)
        seen = _record_crops(colours)
        colours(image, found, "dog")
        expected = [_pil_crop(image, found[0].box, mask if masks else None), _pil_crop(image, found[1].box)]
        assert len(seen) == 2
        for got, want in zip(seen, expected):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="does not cover image"):
        colour_crop(image, Found((0, 0, 4, 4), mask=mask[:10]))


def test_shapeworld_twin_with_clip_names_colours_on_masked_crops(checkpoints):
    from rewards.shapeworld.grammar import COLOURS
    from rewards.shapeworld.render import PALETTE, Placed, draw

    pixels = torch.from_numpy(draw([Placed("red", "triangle", 4, 6, 20)], 32)).permute(2, 0, 1).float() / 255
    reward = GenEval(detector="shapeworld", clip=str(checkpoints / "clip"))
    assert isinstance(reward.colours, ClipColours) and reward.colours.colours == COLOURS
    seen = _record_crops(reward.colours)
    out = reward(pixels[None], ["a photo of a red triangle"])
    assert torch.isfinite(out["geneval"]).all() and len(seen) == 1
    red, grey = torch.tensor(PALETTE["red"]) / 255, torch.full((3,), 0x99 / 255)
    colours = seen[0].flatten(1).T
    is_red, is_grey = (colours - red).abs().amax(1) < 1e-6, (colours - grey).abs().amax(1) < 1e-6
    assert (is_red | is_grey).all() and is_grey.any()  # the white around the triangle became grey


def test_reward_with_models_is_batch_invariant_and_logs_clauses(checkpoints):
    reward = GenEval(
        detector=str(checkpoints / "owl"),
        clip=str(checkpoints / "clip"),
        threshold=0.5,
        counting_threshold=0.5,
    )
    x = torch.rand(4, 3, 40, 40, generator=torch.Generator().manual_seed(3))
    prompts = [
        "a photo of a red dog",
        "a photo of a red dog",
        "a photo of two cats",
        "a photo of a cat left of a dog",
    ]
    metadata = {}
    out = reward(x, prompts, metadata)
    assert set(out) == {"geneval", "geneval_partial", "geneval_strict", "geneval_correct"}
    assert all(torch.isfinite(v).all() and v.shape == (4,) for v in out.values())
    assert (
        len(metadata["geneval"]) == 4
        and metadata["geneval"][3]["geneval"].clauses[-1]["clause"] == "a cat left of a dog"
    )
    assert reward.colours._classifiers  # colour classifiers are cached per class...
    reward.to("cpu", "float32")
    assert not reward.colours._classifiers  # ...and recomputed after a move
    single = [reward(x[i : i + 1], prompts[i : i + 1]) for i in range(4)]
    for key in out:
        torch.testing.assert_close(torch.cat([s[key] for s in single]), out[key])


def test_owl_thresholds_default_to_the_ones_owlv2_is_documented_with(checkpoints):
    import inspect

    from transformers import Owlv2Processor

    # OWLv2's model card and transformers' post-processing filter at 0.1, not GenEval's 0.3 / 0.9
    documented = inspect.signature(Owlv2Processor.post_process_grounded_object_detection)
    owl = documented.parameters["threshold"].default
    reward = GenEval(detector=str(checkpoints / "owl"), clip=str(checkpoints / "clip"))
    assert reward.thresholds == {"other": owl, "counting": owl}
    one = GenEval(detector=str(checkpoints / "owl"), clip=str(checkpoints / "clip"), counting_threshold=0.4)
    assert one.thresholds == {"other": owl, "counting": 0.4}  # an explicit value wins, the other defaults


def test_an_unknown_detector_refuses_to_start_without_both_thresholds(checkpoints, monkeypatch):
    with pytest.raises(ThresholdsError, match=r"'grounding-dino' detector.*set both threshold and"):
        detector_thresholds("grounding-dino", 0.3, None)
    assert detector_thresholds("grounding-dino", 0.3, 0.5) == (0.3, 0.5)
    monkeypatch.delitem(DETECTOR_THRESHOLDS, "owlv2")  # as if the tiny OWLv2 were another detector
    with pytest.raises(ThresholdsError, match="'owlv2' detector"):
        GenEval(detector=str(checkpoints / "owl"))  # stops before CLIP (none given) is loaded
    with pytest.raises(ThresholdsError):
        rewards.build("geneval", detector=str(checkpoints / "owl"), threshold=0.2)


def test_missing_weights_name_the_path_or_the_download(tmp_path, checkpoints):
    with pytest.raises(MissingRewardWeightsError, match=re.escape(str(tmp_path / "nope"))):
        GenEval(detector=str(tmp_path / "nope"))
    with pytest.raises(
        MissingRewardWeightsError, match="hf download facebook/mask2former-swin-small-coco-instance"
    ):
        GenEval(detector="facebook/mask2former-swin-small-coco-instance")  # transformers' weights
    with pytest.raises(
        MissingRewardWeightsError, match=r"could not be downloaded.*wget 'http://127\.0\.0\.1:9/"
    ):
        GenEval(detector="http://127.0.0.1:9/m2f.pth")  # mmdetection's file from its URL: nothing listens
    with pytest.raises(MissingRewardWeightsError, match="hf download openai/clip-vit-large-patch14"):
        GenEval(detector=str(checkpoints / "owl"))
    with pytest.raises(rewards.RewardArgsError, match="score must be one of partial, strict, geneval"):
        rewards.build("geneval", detector="shapeworld", score="loose")


def test_bgr_feeds_the_detector_red_and_blue_swapped_and_clip_the_image(checkpoints):
    """flow_grpo's reward server hands RGB arrays to mmdet, which reads arrays as BGR
    (``detector_channels: bgr``); CLIP names colours on the image as it is either way."""
    kw = dict(detector=str(checkpoints / "owl"), clip=str(checkpoints / "clip"), threshold=0.0)
    x = torch.rand(2, 3, 40, 40, generator=torch.Generator().manual_seed(4))
    fed, coloured = {}, {}
    for channels in ("rgb", "bgr"):
        reward = GenEval(**kw, counting_threshold=0.0, detector_channels=channels)
        detect, colours, fed[channels], coloured[channels] = reward.detector, reward.colours, [], []
        reward.detector = lambda px, classes, d=detect, c=channels: (
            fed[c].append(px.clone()) or d(px, classes)
        )
        reward.colours = lambda im, found, cls, k=colours, c=channels: (
            coloured[c].append(im) or k(im, found, cls)
        )
        reward(x, ["a photo of a red dog"] * 2)
    torch.testing.assert_close(torch.cat(fed["rgb"]), x)
    torch.testing.assert_close(torch.cat(fed["bgr"]), x[:, [2, 1, 0]])
    assert len(coloured["bgr"]) == 2 and all(torch.equal(im, x[i]) for i, im in enumerate(coloured["bgr"]))
    with pytest.raises(rewards.RewardArgsError, match="names colours itself"):
        rewards.build("geneval", detector="shapeworld", detector_channels="bgr")

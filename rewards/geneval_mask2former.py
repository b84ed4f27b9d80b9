"""GenEval's detector through transformers: Mask2Former COCO instance segmentation.

GenEval (djghosh13/geneval@af4902f2, ``evaluation/evaluate_images.py``) and flow_grpo's
reward server (yifan123/reward-server@92ac29fb, ``reward_server/gen_eval.py``) detect with
mmdetection's ``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco``: Mask2Former with a Swin-S
backbone, COCO's 80 classes, masks. mmdetection does not install beside current stacks,
so this runs the same architecture through transformers'
``Mask2FormerForUniversalSegmentation`` (``facebook/mask2former-swin-small-coco-instance``
by default) and reproduces mmdetection's test path around it:

* preprocessing (mmdet's test pipeline for that config): resize keeping the aspect ratio
  to fit 1333 x 800 (``mmcv.imrescale``: scale = min(1333 / long side, 800 / short side),
  sizes rounded half up), normalise with ImageNet's mean and std in 0-255 units, pad
  bottom-right with zeros to a multiple of 32;
* post-processing (``MaskFormerFusionHead.simple_test`` and ``instance_postprocess``):
  mask logits upsampled bilinearly to the padded input, cropped to the resized image,
  upsampled to the original size; the top 100 (query, class) pairs by class probability
  (softmax, no-object column dropped); each pair's score is its probability times the mean
  sigmoid of its mask over the mask's pixels (logit > 0); its box is the mask's extent
  (``mask2bbox``: x0, y0, last x + 1, last y + 1).

GenEval's own filter then applies (:func:`rewards.geneval_models.keep` with its 0.3 /
0.9 thresholds, 16 objects a class, no suppression), and colours are read on the masked
crops as GenEval does.

The weights are GenEval's own by default: mmdetection's checkpoint, its ``.pth`` read into
the transformers model by a key map (:mod:`rewards.geneval_mmdet`, downloaded once from
OpenMMLab into torch.hub's cache). ``detector: facebook/mask2former-swin-small-coco-instance``
loads transformers' hub weights instead: the Mask2Former authors' Detectron2 training of
the same architecture, near the same COCO mask AP (about 46) but with other detections
image by image.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rewards import geneval_rules as rules
from rewards.clip_common import hf_pretrained
from rewards.geneval_rules import Found

IMAGENET_MEAN = (123.675, 116.28, 103.53)  # mmdet's data preprocessor, 0-255 RGB
IMAGENET_STD = (58.395, 57.12, 57.375)
SCALE = (1333, 800)  # long side, short side
SIZE_DIVISOR = 32
MAX_PER_IMAGE = 100  # mmdet's test_cfg for Mask2Former


def rescaled_size(height: int, width: int, scale=SCALE) -> tuple[int, int]:
    """``mmcv.imrescale``'s output size: the largest that fits ``scale`` keeping the ratio."""
    factor = min(max(scale) / max(height, width), min(scale) / min(height, width))
    return int(height * factor + 0.5), int(width * factor + 0.5)


def preprocess(images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """(B, 3, H, W) floats in [0, 1] -> (normalised, padded batch; the resized size)."""
    h, w = rescaled_size(*images.shape[-2:])
    x = F.interpolate(images.float() * 255, size=(h, w), mode="bilinear", align_corners=False)
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
    x = (x - mean) / std
    pad_h, pad_w = -h % SIZE_DIVISOR, -w % SIZE_DIVISOR
    return F.pad(x, (0, pad_w, 0, pad_h)), (h, w)


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """``mask2bbox``: (N, H, W) bool -> (N, 4) boxes (x0, y0, last x + 1, last y + 1);
    an empty mask gives zeros."""
    boxes = torch.zeros((len(masks), 4), device=masks.device)
    for i, mask in enumerate(masks):
        xs, ys = mask.any(0).nonzero()[:, 0], mask.any(1).nonzero()[:, 0]
        if len(xs):
            boxes[i] = torch.stack([xs[0], ys[0], xs[-1] + 1, ys[-1] + 1]).float()
    return boxes


def instances(class_logits, mask_logits, padded, resized, original, max_per_image: int = MAX_PER_IMAGE):
    """One image's detections as mmdet's instance post-processing makes them: (labels,
    scores, boxes, masks), the top ``max_per_image`` (query, class) pairs. ``class_logits``
    (Q, C + 1), ``mask_logits`` (Q, h, w) at the model's output resolution; ``padded``,
    ``resized`` and ``original`` are (H, W) of the padded input, the resized image in it
    and the image as given."""
    masks = F.interpolate(mask_logits[None].float(), size=padded, mode="bilinear", align_corners=False)
    masks = masks[..., : resized[0], : resized[1]]
    masks = F.interpolate(masks, size=original, mode="bilinear", align_corners=False)[0]
    probs = class_logits.float().softmax(-1)[:, :-1]
    classes = probs.shape[1]
    top, index = probs.flatten().topk(min(max_per_image, probs.numel()), sorted=False)
    labels, queries = index % classes, index // classes
    masks = masks[queries]
    binary = masks > 0
    quality = (masks.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
    return labels, top * quality, mask_boxes(binary), binary


class Mask2FormerDetector:
    """The detector of GenEval (see the module docstring); its classes are GenEval's names
    of COCO's 80, by index (mmdet's order, the order of both checkpoints)."""

    def __init__(self, pretrained: str, device, dtype, max_per_image: int = MAX_PER_IMAGE, model=None):
        """``pretrained``: a hub id or ``save_pretrained`` folder, or (with ``model`` given,
        e.g. read from mmdetection's checkpoint) only its name for messages."""
        from transformers import Mask2FormerForUniversalSegmentation

        self.model = model or hf_pretrained(
            "geneval",
            Mask2FormerForUniversalSegmentation,
            pretrained,
            arg="detector",
            output_loading_info=True,
        )
        labels = self.model.config.num_labels
        if labels != len(rules.COCO_CLASSES):
            raise ValueError(
                f"geneval: detector '{pretrained}' has {labels} classes; GenEval's Mask2Former is a COCO "
                f"instance model with {len(rules.COCO_CLASSES)} "
                "(facebook/mask2former-swin-small-coco-instance)"
            )
        self.device, self.dtype, self.max_per_image = device, dtype, int(max_per_image)

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor, classes: list[str]) -> list[dict[str, list[Found]]]:
        """Every detection of each image in the classes asked for, with its mask."""
        x, resized = preprocess(pixels.to(self.device))
        outputs = self.model(pixel_values=x.to(self.dtype))
        wanted = {rules.COCO_CLASSES.index(c): c for c in classes if c in rules.COCO_CLASSES}
        out = []
        for i in range(len(pixels)):
            labels, scores, boxes, masks = instances(
                outputs.class_queries_logits[i],
                outputs.masks_queries_logits[i],
                tuple(x.shape[-2:]),
                resized,
                tuple(pixels.shape[-2:]),
                self.max_per_image,
            )
            per_class: dict[str, list[Found]] = {}
            for label, score, box, mask in zip(labels.tolist(), scores.tolist(), boxes.tolist(), masks):
                if label in wanted:
                    per_class.setdefault(wanted[label], []).append(
                        Found(tuple(box), float(score), mask=mask.cpu())
                    )
            out.append(per_class)
        return out

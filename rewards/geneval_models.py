"""The models behind the ``geneval`` reward: an open-vocabulary detector, a CLIP colour
classifier, GenEval's detection filter, and the ShapeWorld pixel detector as their offline
twin. GenEval detects with an mmdetection Mask2Former and names colours with CLIP ViT-L/14
zero-shot on the detected crops; mmdetection does not install on current stacks, so the
detector is any transformers zero-shot detector (OWLv2 by default, Minderer et al. 2023,
arXiv:2306.09683), queried with the classes the caption names, and the colour classifier is
a transformers ``CLIPModel`` (``openai/clip-vit-large-patch14``, the weights open_clip's
``ViT-L-14``/``openai`` loads) with GenEval's three colour templates averaged as
clip_benchmark's zero-shot classifier does.

Colour crops (GenEval's ``ImageCrops``; djghosh13/geneval@af4902f2
``evaluation/evaluate_images.py``, the same in yifan123/reward-server@92ac29fb
``reward_server/gen_eval.py``): GenEval composites Mask2Former's mask onto #999 grey and
then crops the box, so only the object's pixels carry colour. A detection with a ``mask``
(the ShapeWorld twin) is cropped that way here too; OWLv2 gives boxes only, so its crops
keep the background and any neighbour inside the box, which then enter the colour vote
(docs/BENCHMARKS.md measures how much on the twin). Boxes reaching past the image: PIL's
crop in GenEval pads them with black, which a colour vote can read as "black"; we clip them
to the image (OWLv2's boxes live in its padded square and often reach past the shorter
side, where the reference's padding would be black).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from PIL import Image

from rewards import geneval_rules as rules
from rewards.clip_common import (
    hf_image_embeds,
    hf_pretrained,
    hf_text_embeds,
    hf_text_max_length,
    hf_tokenize,
    image_size_of,
    normalize,
    resize_shortest_and_center_crop,
    to_model,
)
from rewards.geneval_rules import Found
from rewards.images import to_uint8_hwc
from rewards.shapeworld.render import BACKGROUND, PALETTE

COLOUR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")

# (threshold, counting_threshold) each detector's confidences fit. GenEval's 0.3 / 0.9
# (djghosh13/geneval@af4902f2, evaluation/evaluate_images.py; the same in reward-server's
# gen_eval.py) were set for Mask2Former, whose confidences for real objects sit near 1;
# OWL-ViT / OWLv2 sigmoid scores rarely pass 0.9 (OWLv2's model card and transformers'
# post_process_grounded_object_detection use 0.1), so 0.9 would fail most counting
# prompts. 0.1 serves both: no source gives OWLv2 a stricter counting value.
# ShapeWorld detections all have confidence 1, so GenEval's values change nothing there.
DETECTOR_THRESHOLDS = {
    "shapeworld": (0.3, 0.9),
    "mask2former": (0.3, 0.9),  # GenEval's own detector (rewards.geneval_mask2former)
    "owlv2": (0.1, 0.1),
    "owlvit": (0.1, 0.1),
}
# suppression between a class's boxes: none in GenEval (NMS_THRESHOLD = 1.0, its detector
# being Mask2Former); OWLv2 proposes overlapping boxes for one object, so 0.5 there
DETECTOR_MAX_OVERLAP = {"mask2former": 1.0, "owlv2": 0.5, "owlvit": 0.5}


class ThresholdsError(ValueError):
    """A detector with no known confidence scale was given without explicit thresholds."""


def detector_thresholds(kind: str, threshold: float | None, counting_threshold: float | None):
    """The (threshold, counting_threshold) to use: explicit values win; otherwise the
    detector kind's (:data:`DETECTOR_THRESHOLDS`), or one error for an unknown kind."""
    if threshold is not None and counting_threshold is not None:
        return float(threshold), float(counting_threshold)
    if kind not in DETECTOR_THRESHOLDS:
        raise ThresholdsError(
            f"geneval: no default confidence thresholds for a '{kind}' detector (known: "
            f"{', '.join(DETECTOR_THRESHOLDS)}); set both threshold and counting_threshold in the "
            f"reward's args, calibrated on images whose objects you have counted."
        )
    default, counting = DETECTOR_THRESHOLDS[kind]
    return (
        default if threshold is None else float(threshold),
        counting if counting_threshold is None else float(counting_threshold),
    )


def box_iou(a, b) -> float:
    """GenEval's ``compute_iou`` (integer-pixel boxes: a side spans ``x1 - x0 + 1``)."""

    def area(box):
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))
    union = area(a) + area(b) - inter
    return inter / union if union else 0.0


def keep(candidates: list[Found], threshold: float, max_objects: int, max_overlap: float) -> list[Found]:
    """GenEval's per-class filter: above ``threshold``, most confident first, at most
    ``max_objects``, then greedy suppression of boxes with IoU >= ``max_overlap``."""
    ordered = sorted((f for f in candidates if f.score > threshold), key=lambda f: -f.score)[:max_objects]
    kept = []
    while ordered:
        best = ordered.pop(0)
        kept.append(best)
        if max_overlap < 1:
            ordered = [f for f in ordered if box_iou(best.box, f.box) < max_overlap]
    return kept


def is_mmdet_checkpoint(spec: str) -> bool:
    """An mmdetection ``.pth`` file or its URL (GenEval's own Mask2Former weights), not a
    transformers model (a hub id or a ``save_pretrained`` folder)."""
    return str(spec).startswith(("http://", "https://")) or str(spec).endswith(".pth")


def mmdet_checkpoint_path(spec: str) -> str:
    """Where the ``.pth`` is: a local file, or a URL's file downloaded once into torch.hub's cache."""
    from rewards.clip_common import url_file

    return url_file("geneval", spec) if str(spec).startswith(("http://", "https://")) else spec


def build_detector(pretrained: str, device, dtype):
    """The detector a checkpoint is: Mask2Former (GenEval's, closed-vocabulary COCO
    instance segmentation; mmdetection's ``.pth`` or transformers weights) or a zero-shot
    detector (OWLv2, OWL-ViT)."""
    from transformers import AutoConfig

    from rewards.geneval_mask2former import Mask2FormerDetector

    if is_mmdet_checkpoint(pretrained):
        from rewards.geneval_mmdet import load_mmdet_mask2former

        model = load_mmdet_mask2former(mmdet_checkpoint_path(pretrained))
        return Mask2FormerDetector(pretrained, device, dtype, model=model)
    config = hf_pretrained("geneval", AutoConfig, pretrained, arg="detector")
    if config.model_type == "mask2former":
        return Mask2FormerDetector(pretrained, device, dtype)
    return OwlDetector(pretrained, device, dtype)


class OwlDetector:
    """Open-vocabulary boxes from a transformers zero-shot detector (OWLv2/OWL-ViT)."""

    def __init__(self, pretrained: str, device, dtype):
        from transformers import AutoModelForZeroShotObjectDetection, AutoProcessor

        self.model = hf_pretrained(
            "geneval",
            AutoModelForZeroShotObjectDetection,
            pretrained,
            arg="detector",
            output_loading_info=True,
        )
        self.processor = hf_pretrained("geneval", AutoProcessor, pretrained, arg="detector")
        self.device, self.dtype = device, dtype

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor, classes: list[str]) -> list[dict[str, list[Found]]]:
        """Every candidate box of each image, by the class whose query it matches best."""
        pil = [Image.fromarray(a) for a in to_uint8_hwc(pixels)]
        queries = [[f"a photo of {rules.article(c)}" for c in classes]] * len(pil)
        inputs = self.processor(text=queries, images=pil, return_tensors="pt")
        inputs = to_model(inputs, self.device, self.dtype)
        outputs = self.model(**inputs)
        side = max(pixels.shape[-2:])  # OWLv2 pads to a square before resizing; boxes are in it
        found = self.processor.post_process_grounded_object_detection(
            outputs, threshold=0.0, target_sizes=[(side, side)] * len(pil)
        )
        out = []
        for image in found:
            per_class: dict[str, list[Found]] = {}
            for box, score, label in zip(
                image["boxes"].tolist(), image["scores"].tolist(), image["labels"].tolist()
            ):
                per_class.setdefault(classes[label], []).append(Found(tuple(box), float(score)))
            out.append(per_class)
        return out


# GenEval's crop background: ImageCrops composites the mask onto Image.new(color="#999")
GENEVAL_GREY = 0x99 / 255


def colour_crop(image: torch.Tensor, found: Found, use_mask: bool = True) -> torch.Tensor:
    """What GenEval's colour classifier sees of one detection: with a mask (and
    ``use_mask``), the object composited onto #999 grey, then the box crop; without one,
    the raw box crop, background included."""
    if use_mask and found.mask is not None:
        mask = torch.as_tensor(found.mask, device=image.device)
        if tuple(mask.shape) != tuple(image.shape[-2:]):
            raise ValueError(f"geneval: mask {tuple(mask.shape)} does not cover image {tuple(image.shape)}")
        image = torch.where(mask.bool(), image, torch.full_like(image, GENEVAL_GREY))
    return crop(image, found.box)


class ClipColours:
    """GenEval's colour classifier: CLIP zero-shot over its colour words on each detection's
    crop (:func:`colour_crop`; ``masks=False`` ignores masks and classifies the raw box),
    with the three templates' normalised text embeddings averaged per colour."""

    def __init__(self, pretrained: str, device, dtype, colours=rules.GENEVAL_COLOURS, masks: bool = True):
        from transformers import AutoTokenizer, CLIPModel

        self.model = hf_pretrained("geneval", CLIPModel, pretrained, arg="clip", output_loading_info=True)
        self.tokenizer = hf_pretrained("geneval", AutoTokenizer, pretrained, arg="clip")
        self.image_size = image_size_of(self.model.config.vision_config.image_size)
        self.max_length = hf_text_max_length(self.tokenizer, self.model)
        self.device, self.dtype, self.colours, self.masks = device, dtype, tuple(colours), bool(masks)
        self._classifiers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def classifier(self, cls: str) -> torch.Tensor:
        """(colours, D) unit text embeddings for ``cls``, cached per class."""
        if cls not in self._classifiers:
            rows = []
            for colour in self.colours:
                texts = [t.format(c=colour, cls=cls) for t in COLOUR_TEMPLATES]
                emb = hf_text_embeds(
                    self.model, hf_tokenize(self.tokenizer, texts, self.max_length, self.device)
                )
                rows.append(F.normalize(F.normalize(emb.float(), dim=-1).mean(0), dim=-1))
            self._classifiers[cls] = torch.stack(rows)
        return self._classifiers[cls]

    def forget_classifiers(self) -> None:
        self._classifiers.clear()

    @torch.no_grad()
    def __call__(self, image: torch.Tensor, found: list[Found], cls: str) -> list[str]:
        if not found:
            return []
        crops = [self.preprocess(colour_crop(image, f, self.masks)) for f in found]
        embeds = F.normalize(hf_image_embeds(self.model, torch.cat(crops).to(self.dtype)).float(), dim=-1)
        return [self.colours[i] for i in (embeds @ self.classifier(cls).T).argmax(-1).tolist()]

    def preprocess(self, pixels: torch.Tensor) -> torch.Tensor:
        return normalize(resize_shortest_and_center_crop(pixels[None].to(self.device), self.image_size))


def crop(image: torch.Tensor, box) -> torch.Tensor:
    """``PIL.Image.crop(box)`` on a (3, H, W) tensor (rounded corners, at least one pixel),
    except that a box reaching past the image is clipped to it where PIL pads black."""
    h, w = image.shape[-2:]
    x0, y0 = min(max(round(box[0]), 0), w - 1), min(max(round(box[1]), 0), h - 1)
    x1, y1 = max(min(round(box[2]), w), x0 + 1), max(min(round(box[3]), h), y0 + 1)
    return image[:, y0:y1, x0:x1]


class ShapeWorldDetector:
    """The ShapeWorld pixel detector (:func:`rewards.shapeworld.verifier.detect`) as a GenEval
    detector: classes are shapes, every detection has confidence 1 and its palette colour,
    boxes are pixel extents (exclusive right/bottom edges, as continuous boxes), and, as
    Mask2Former gives GenEval, a mask: the pixels of its colour inside its box (the
    object itself, plus any same-coloured pixels of a neighbour whose box overlaps)."""

    def __call__(self, pixels: torch.Tensor, classes: list[str]) -> list[dict[str, list[Found]]]:
        from rewards.shapeworld.verifier import detect

        pixels = pixels.float().cpu()
        out = []
        for image, detections in zip(pixels, detect(pixels)):
            labels = palette_labels(image)
            per_class: dict[str, list[Found]] = {}
            for d in detections:
                x0, y0, x1, y1 = d.box
                mask = torch.zeros_like(labels, dtype=torch.bool)
                inside = labels[y0 : y1 + 1, x0 : x1 + 1]
                mask[y0 : y1 + 1, x0 : x1 + 1] = inside == list(PALETTE).index(d.colour)
                found = Found((x0, y0, x1 + 1, y1 + 1), 1.0, d.colour, mask)
                per_class.setdefault(d.shape, []).append(found)
            out.append(per_class)
        return out


def palette_labels(image: torch.Tensor, fg_threshold: float = 0.3) -> torch.Tensor:
    """(H, W) index of each pixel's nearest ShapeWorld palette colour, -1 on the white
    background: the labelling :func:`rewards.shapeworld.verifier.detect` segments."""
    palette = torch.tensor(list(PALETTE.values()), dtype=torch.float32) / 255
    background = torch.tensor(BACKGROUND, dtype=torch.float32).view(3, 1, 1) / 255
    foreground = (image - background).abs().amax(0) > fg_threshold
    nearest = ((image.permute(1, 2, 0)[..., None, :] - palette) ** 2).sum(-1).argmin(-1)
    return torch.where(foreground, nearest, -1)


def known_colours(image: torch.Tensor, found: list[Found], cls: str) -> list[str]:
    """The colours a detector already knows (ShapeWorld's palette)."""
    return [f.colour for f in found]

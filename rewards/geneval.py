"""GenEval reward (Ghosh et al. 2023, "GenEval: An Object-Focused Framework for Evaluating
Text-to-Image Alignment", arXiv:2310.11513): GenEval's rules (:mod:`rewards.geneval_rules`)
over a transformers detector and CLIP colour classifier (:mod:`rewards.geneval_models`).
The detector is GenEval's own by default: mmdetection's Mask2Former Swin-S COCO checkpoint
(:mod:`rewards.geneval_mmdet` reads its ``.pth`` into transformers' model;
:mod:`rewards.geneval_mask2former` runs mmdetection's pre- and post-processing around it);
transformers' hub weights of the same architecture, or an OWLv2 or OWL-ViT checkpoint
(open vocabulary, boxes only), may be given instead. To score with GenEval's official mmdetection stack, use
the ``reward_server`` reward against flow_grpo's reward server (:mod:`rewards.reward_server`).

A prompt's task comes from the GenEval metadata its line carries (``tag``, ``include``,
``exclude`` of GenEval's and flow_grpo's ``*_metadata.jsonl``, as flow_grpo's reward server
scores), else from its caption ("a photo of two dogs", "a photo of a cat left of a dog",
...: GenEval's templates, any case, a closing full stop, digits or English plurals
allowed). Scores, all logged (``score`` picks the one optimised):

* ``geneval_partial``: the mean clause credit with exact counts. With ``partial: flow_grpo``
  (the default) it is flow-GRPO's training reward as its reward server computes it
  (yifan123/reward-server@92ac29fb, ``reward_server/gen_eval.py: evaluate_reward``),
  including the extra 1.0 it appends after a failed relation (3/4 for a position prompt
  whose relation alone fails); the default follows the reference so that rewards and
  curves compare with flow-GRPO's. ``partial: per_clause`` gives each clause one credit
  (2/3 there), which is not the reference's number;
* ``geneval_strict``: flow-GRPO's exact-count verdict (1 when every clause holds);
* ``geneval_correct``: GenEval's benchmark verdict (at-least counts, exclusions).
tests/fixtures/reference/ocr_geneval.json holds the reward server's outputs.

Detections pass GenEval's filters: confidence above ``threshold`` (``counting_threshold`` for
counting prompts), at most ``max_objects`` per class, and greedy suppression of boxes
overlapping a kept one by IoU ``max_overlap`` or more (GenEval keeps all, 1.0, the default
with Mask2Former; OWLv2 proposes several boxes per object, so 0.5 with it). GenEval's
thresholds, 0.3 / 0.9, were set for Mask2Former and are its defaults; left unset, the
thresholds follow the detector (:data:`rewards.geneval_models.DETECTOR_THRESHOLDS`): 0.1 /
0.1 for OWLv2 and OWL-ViT (the
value of OWLv2's model card; 0.9 would fail most counting prompts), GenEval's for
ShapeWorld (whose confidences are all 1); any other detector refuses to start until both
are set. The OWL values are not calibrated on generated images: calibrate them on images
you have counted before trusting the counting score.

``detector: shapeworld`` is the offline twin: the ShapeWorld pixel detector and palette
colours under the same rules, for captions over circles, squares and triangles; given a
``clip``, CLIP names the twin's colours on GenEval's masked crops (``mask_crops``), which
isolates the colour step (:mod:`rewards.geneval_models` documents the crops).
"""

from __future__ import annotations

import torch

from rewards import geneval_rules as rules
from rewards.clip_common import ClipReward
from rewards.geneval_mmdet import URL as MMDET_URL
from rewards.geneval_models import (
    DETECTOR_MAX_OVERLAP,
    ClipColours,
    ShapeWorldDetector,
    build_detector,
    detector_thresholds,
    keep,
    known_colours,
)

SCORES = {"partial": "geneval_partial", "strict": "geneval_strict", "geneval": "geneval_correct"}
PARTIAL = {"flow_grpo": rules.FLOW_GRPO, "per_clause": rules.FLOW_GRPO_PER_CLAUSE}


class GenEval(ClipReward):
    """``reward(images, prompts) -> {"geneval": chosen score, "geneval_partial", "geneval_strict",
    "geneval_correct"}``; with a ``metadata`` dict, each image's clauses go to
    ``metadata["geneval"]``.

    Args:
        detector: mmdetection's Mask2Former ``.pth`` (a URL, by default GenEval's checkpoint,
            or a file), a hub id or directory of a transformers Mask2Former COCO instance
            model or zero-shot detector (OWLv2), or ``shapeworld``.
        clip: hub id or directory of the CLIPModel that names colours; with ``shapeworld``
            optional (the palette names them when None).
        score: ``partial``, ``strict`` or ``geneval`` (see the module docstring).
        partial: ``flow_grpo`` (the reference's partial credit) or ``per_clause``.
        threshold, counting_threshold, max_objects, max_overlap: the detection filter; None
            thresholds take the detector's defaults (see the module docstring).
        position_threshold: GenEval's share of the box sizes discounted from offsets (0.1).
        mask_crops: CLIP sees a detection's mask composited onto GenEval's #999 grey, as in
            GenEval; only segmenting detectors give masks (the ShapeWorld twin, not OWLv2,
            whose box crops keep their background). False classifies raw box crops.
        detector_channels: what the detector is fed: ``rgb`` (GenEval's benchmark: mmcv
            reads the image file as BGR and mmdet's ``Normalize(to_rgb=True)`` turns it
            back) or ``bgr`` (flow_grpo's reward server: ``inference_detector`` gets PIL's
            RGB arrays, which mmdet takes for BGR and flips, so the detector sees red and
            blue swapped; reward-server@92ac29fb ``gen_eval.py: evaluate_image``). Colours
            are named by CLIP on the RGB image either way, as there.
        device, dtype, batch_size: where and how to run; ``batch_size`` images per forward.
    """

    name = "geneval"
    differentiable = False
    reads_metadata = True
    default_detector = MMDET_URL  # GenEval's own weights (rewards.geneval_mmdet)
    default_clip = "openai/clip-vit-large-patch14"

    def __init__(
        self,
        detector: str | None = None,
        clip: str | None = None,
        score: str = "partial",
        partial: str = "flow_grpo",
        threshold: float | None = None,
        counting_threshold: float | None = None,
        max_objects: int = 16,
        max_overlap: float | None = None,
        position_threshold: float = 0.1,
        mask_crops: bool = True,
        detector_channels: str = "rgb",
        device=None,
        dtype="float32",
        batch_size: int = 8,
    ):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        if score not in SCORES:
            raise ValueError(f"geneval: score must be one of {', '.join(SCORES)}, got {score!r}")
        if partial not in PARTIAL:
            raise ValueError(f"geneval: partial must be one of {', '.join(PARTIAL)}, got {partial!r}")
        given = (threshold, counting_threshold)
        if int(max_objects) < 1 or any(t is not None and not 0 <= float(t) < 1 for t in given):
            raise ValueError("geneval: thresholds must be in [0, 1) and max_objects >= 1")
        if detector_channels not in ("rgb", "bgr"):
            raise ValueError(f"geneval: detector_channels must be rgb or bgr, got {detector_channels!r}")
        if detector_channels == "bgr" and detector == "shapeworld":
            raise ValueError(
                "geneval: detector_channels bgr swaps the detector's input, and the ShapeWorld twin's "
                "detector names colours itself; use rgb with detector: shapeworld"
            )
        self.swap_channels = detector_channels == "bgr"
        self.score, self.flow_rules, self.max_objects = score, PARTIAL[partial], int(max_objects)
        self.holds = rules.box_relation(float(position_threshold))
        if detector == "shapeworld":
            from rewards.shapeworld.grammar import COLOURS, SHAPES

            self.detector, self.classes, self.colour_words = ShapeWorldDetector(), SHAPES, COLOURS
            self.colours, self._models = known_colours, []  # the palette names colours exactly
            if clip is not None:  # CLIP on the twin's crops instead: measures the colour step
                self.colours = ClipColours(clip, self.device, self.dtype, COLOURS, mask_crops)
                self._models = [self.colours.model]
            self.max_overlap = 1.0 if max_overlap is None else float(max_overlap)
            threshold, counting_threshold = detector_thresholds("shapeworld", *given)
        else:
            self.detector = build_detector(detector or self.default_detector, self.device, self.dtype)
            # before CLIP loads: an unknown detector without thresholds stops here
            kind = self.detector.model.config.model_type
            threshold, counting_threshold = detector_thresholds(kind, *given)
            self.colours = ClipColours(clip or self.default_clip, self.device, self.dtype, masks=mask_crops)
            self._models = [self.detector.model, self.colours.model]
            self.classes, self.colour_words = rules.COCO_CLASSES, rules.GENEVAL_COLOURS
            default_overlap = DETECTOR_MAX_OVERLAP.get(kind, 0.5)
            self.max_overlap = default_overlap if max_overlap is None else float(max_overlap)
        self.thresholds = {"counting": counting_threshold, "other": threshold}
        self._freeze()

    def _modules(self):
        return self._models

    def to(self, device=None, dtype=None):
        super().to(device, dtype)
        for part in (self.detector, self.colours):
            if hasattr(part, "device"):
                part.device, part.dtype = self.device, self.dtype
        if isinstance(self.colours, ClipColours):
            self.colours.forget_classifiers()  # they were computed on the old device / dtype
        return self

    def task(self, prompt: str) -> rules.Task:
        """From the prompt's GenEval metadata when it carries it, else from its caption."""
        return rules.prompt_task(prompt, self.classes, self.colour_words)

    def check_prompts(self, prompts: list[str]) -> None:
        rules.check_captions(prompts, self.classes, self.colour_words)

    @classmethod
    def prompt_checker(cls, detector: str | None = None, **_):
        """The prompt check without the detector and CLIP loaded (``--dry-run``, ``--preflight``):
        the ShapeWorld vocabulary with ``detector: shapeworld``, GenEval's COCO classes else."""
        if detector == "shapeworld":
            from rewards.shapeworld.grammar import COLOURS, SHAPES

            vocabulary = (SHAPES, COLOURS)
        else:
            vocabulary = (rules.COCO_CLASSES, rules.GENEVAL_COLOURS)
        return lambda prompts: rules.check_captions(prompts, *vocabulary)

    def judge(self, image: torch.Tensor, task: rules.Task, candidates: dict) -> dict[str, rules.Judgement]:
        """Both verdicts of one image from its unfiltered candidates."""
        threshold = self.thresholds["counting" if task.tag == "counting" else "other"]
        detected = {c: keep(f, threshold, self.max_objects, self.max_overlap) for c, f in candidates.items()}
        detected = {c: f for c, f in detected.items() if f}

        named: dict = {}  # (class, box) -> colour: both rule sets ask about the same boxes

        def colours(found, cls):
            todo = [f for f in found if (cls, f.box) not in named]
            for f, colour in zip(todo, self.colours(image, todo, cls)):
                named[(cls, f.box)] = colour
            return [named[(cls, f.box)] for f in found]

        return {
            "geneval": rules.judge(task, detected, colours, self.holds, rules.GENEVAL),
            "flow_grpo": rules.judge(task, detected, colours, self.holds, self.flow_rules),
        }

    def detect(self, pixels: torch.Tensor, tasks: list) -> list[dict | None]:
        """Unfiltered candidates of each image, one detector call per set of queried classes
        (a GRPO group shares its prompt, so its images go through together)."""
        by_classes: dict[tuple[str, ...], list[int]] = {}
        for i, task in enumerate(tasks):
            if task is not None:
                by_classes.setdefault(tuple(sorted({r.cls for r in task.include + task.exclude})), []).append(
                    i
                )
        candidates: list[dict | None] = [None] * len(tasks)
        seen = pixels.flip(1) if self.swap_channels else pixels  # (B, 3, H, W): RGB -> BGR
        for classes, rows in by_classes.items():
            for i, found in zip(rows, self.detector(seen[rows], list(classes))):
                candidates[i] = found
        return candidates

    def _score(self, pixels, prompts):
        tasks = [_task_or_none(self, p) for p in prompts]  # unchecked prompts score 0, never raise
        verdicts = [
            self.judge(image, task, found) if task is not None else None
            for image, task, found in zip(pixels, tasks, self.detect(pixels, tasks))
        ]
        self._verdicts.extend(verdicts)
        out = {
            "geneval_partial": [v["flow_grpo"].credit if v else 0.0 for v in verdicts],
            "geneval_strict": [float(v["flow_grpo"].correct) if v else 0.0 for v in verdicts],
            "geneval_correct": [float(v["geneval"].correct) if v else 0.0 for v in verdicts],
        }
        out = {k: torch.tensor(v) for k, v in out.items()}
        return {self.name: out[SCORES[self.score]], **out}

    def __call__(self, images, prompts=None, metadata=None):
        self._verdicts: list = []
        out = super().__call__(images, prompts, metadata)
        if isinstance(metadata, dict):
            metadata[self.name] = self._verdicts
        return out


def _task_or_none(reward: GenEval, prompt: str):
    try:
        return reward.task(prompt)
    except rules.CaptionError:
        return None

"""VideoAlign's reward model (VideoReward; Liu et al. 2025, "Improving Video Generation with
Human Feedback", arXiv 2501.13918), registry name ``videoalign``: a Qwen2-VL-2B backbone
whose LoRA and vision tower were trained with a linear reward head read at three special
tokens, one per criterion: visual quality (VQ), motion quality (MQ), text alignment (TA).

Reference: KwaiVGI/VideoAlign @219ab9d (``inference.py``, ``trainer.py``, ``utils.py``,
``vision_process.py``); DanceGRPO vendors it unchanged. What this module reproduces:

* **Checkpoint** (the released directory): ``model_config.json`` (``model_config``,
  ``data_config``, ``peft_lora_config``, ``inference_config``) and ``checkpoint-N/model.pth``,
  the PEFT model's whole state dict (LoRA unmerged, the vision tower, the resized token
  embeddings and ``rm_head``), saved by transformers 4.45; the newest ``checkpoint-N`` is
  used (``load_model_from_checkpoint``). LoRA is merged here (W + scale B A, scale =
  alpha / r, or alpha / sqrt(r) with rsLoRA) and the keys are renamed to the current
  transformers layout (``model.language_model.*``, ``model.visual.*``), so no PEFT model
  is built. The tokenizer is ``checkpoint-N/tokenizer`` if present, else the base's with
  the three tokens added (they are appended, so their ids are the same).
* **Head** (``Qwen2VLRewardModelBT.forward``): ``rm_head`` (hidden -> output_dim, no bias)
  on the last hidden state; the rows at the special tokens, in prompt order VQ, MQ, TA;
  with output_dim 3 each token reads its own column (the diagonal).
* **Input** (``prepare_batch``, ``fetch_video``): one user turn, the video then the prompt
  text (the ``detailed_special`` template, ``{text_prompt}`` filled), the base model's chat
  template with the generation prompt, right padding; frames sampled at ``fps`` from the
  clip's ``video_fps`` (``smart_nframes``: between 4 and the clip's length, a multiple of
  2; indices ``linspace(0, T - 1, n).round()``), resized bicubic with antialias to a
  multiple of 28 with at most ``max_pixels`` and at least 128 * 28 * 28 pixels
  (``smart_resize``), values 0-255 rescaled by the processor.
* **Positions** (``Qwen2VLRewardModelBT.forward``, trainer.py:115-125): the text model is
  called with ``position_ids=None``, which transformers 4.45's ``Qwen2VLModel`` turns into
  plain 1-D positions 0..L-1 on all three M-RoPE axes (the video tokens are not given their
  (t, h, w) grid positions). The released model was trained and is scored that way, so
  :func:`text_positions` passes exactly those; left to itself, today's ``Qwen2VLModel``
  computes 3-D M-RoPE positions and every score moves.
* **Scores** (``reward``): each criterion normalised by ``inference_config``'s mean and std
  (``use_norm``), Overall = VQ + MQ + TA.

Deviations: the clip is scored from its frames (uint8-rounded like a decoded video), not
from an encoded mp4 (the reference and DanceGRPO write the clip with a lossy codec and
read it back). The template is not shipped: it is read at run time from VideoAlign's
``prompt_template.py`` (a local file or URL, by default the pinned reference's, checked
against its sha256) and parsed without running it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
from pathlib import Path

import torch

from rewards.video import as_video

CRITERIA = ("VQ", "MQ", "TA")
SPECIAL_TOKENS = tuple(f"<|{c}_reward|>" for c in CRITERIA)
SCORES = ("overall", *CRITERIA)
COMMIT = "219ab9db64c045e5181a2202d11f686439351292"
TEMPLATE_URL = f"https://raw.githubusercontent.com/KwaiVGI/VideoAlign/{COMMIT}/prompt_template.py"
TEMPLATE_SHA256 = "8fb42f91fd7440a1c9a377e78f36d67da6132eb348f402eecbeb57e41f138ae9"
TEMPLATE_NAMES = {"detailed_special": "DETAILED_PROMPT_WITH_SPECIAL_TOKEN"}
# vision_process.py's constants
FACTOR, FRAME_FACTOR, MIN_FRAMES, MAX_FRAMES = 28, 2, 4, 768
VIDEO_MIN_PIXELS = 128 * 28 * 28
# what the processor returns that the model reads (positions are passed, see text_positions)
MODEL_INPUTS = ("input_ids", "attention_mask", "pixel_values_videos", "video_grid_thw")


class VideoAlignError(ValueError):
    """A VideoAlign checkpoint, template or argument is unusable; says which and the fix."""


# -- frames -------------------------------------------------------------------------------
def sampled_frame_count(total: int, video_fps: float, fps: float) -> int:
    """``smart_nframes`` with ``fps``: the clip's duration times ``fps`` frames, within
    [4, min(768, total)] (each bound taken to a multiple of 2), rounded to a multiple of 2."""
    low = math.ceil(MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
    high = math.floor(min(MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
    n = round(min(max(total / video_fps * fps, low), high) / FRAME_FACTOR) * FRAME_FACTOR
    n = min(n, total)
    if not FRAME_FACTOR <= n <= total:
        raise VideoAlignError(f"videoalign: a clip of {total} frames is too short (it needs at least 2)")
    return n


def sampled_frames(total: int, video_fps: float, fps: float) -> list[int]:
    n = sampled_frame_count(total, video_fps, fps)
    return torch.linspace(0, total - 1, n).round().long().tolist()


def resized_size(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``smart_resize``: both sides multiples of 28, the area within [min, max] pixels, the
    aspect ratio kept as well as that allows."""
    h = max(FACTOR, round(height / FACTOR) * FACTOR)
    w = max(FACTOR, round(width / FACTOR) * FACTOR)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = math.floor(height / beta / FACTOR) * FACTOR
        w = math.floor(width / beta / FACTOR) * FACTOR
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / FACTOR) * FACTOR
        w = math.ceil(width * beta / FACTOR) * FACTOR
    return h, w


def clip_frames(clip: torch.Tensor, video_fps: float, fps: float, max_pixels: int) -> torch.Tensor:
    """One (F, 3, H, W) clip in [0, 1] -> the (n, 3, h, w) float 0-255 frames the model
    sees: sampled, rounded to uint8 as a decoded video is, resized bicubic with antialias."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    frames = (clip[sampled_frames(clip.shape[0], video_fps, fps)].clamp(0, 1) * 255).round().to(torch.uint8)
    size = resized_size(frames.shape[-2], frames.shape[-1], VIDEO_MIN_PIXELS, max_pixels)
    return TF.resize(frames, list(size), interpolation=InterpolationMode.BICUBIC, antialias=True).float()


def text_positions(input_ids: torch.Tensor) -> torch.Tensor:
    """(3, B, L) positions 0..L-1 on each M-RoPE axis: what transformers 4.45's
    ``Qwen2VLModel.forward`` builds from ``cache_position`` when ``position_ids`` is None,
    the call VideoAlign's reward model makes (trainer.py:115)."""
    b, length = input_ids.shape
    return torch.arange(length, device=input_ids.device).view(1, 1, -1).expand(3, b, -1)


# -- the template --------------------------------------------------------------------------
def template_text(source: str, kind: str = "detailed_special", sha256: str | None = None) -> str:
    """The prompt template ``kind`` from VideoAlign's ``prompt_template.py`` at ``source``
    (a path or an http(s) URL), read as Python syntax, never run."""
    if kind not in TEMPLATE_NAMES:
        raise VideoAlignError(f"videoalign: prompt template '{kind}' is not supported; use detailed_special")
    data = _read_source(source)
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise VideoAlignError(
            f"videoalign: {source} is not the pinned prompt_template.py (sha256 "
            f"{hashlib.sha256(data).hexdigest()[:12]}..., expected {sha256[:12]}...)"
        )
    for node in ast.parse(data.decode()).body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == TEMPLATE_NAMES[kind] for t in node.targets
        ):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    raise VideoAlignError(f"videoalign: {source} defines no string {TEMPLATE_NAMES[kind]}")


def _read_source(source: str) -> bytes:
    """A local file, or a URL downloaded once into torch.hub's cache under a name made from
    the whole URL (templates of different commits share the file name prompt_template.py)."""
    if re.match(r"https?://", source):
        from rewards.clip_common import MissingRewardWeightsError, url_file

        name = f"videoalign-{hashlib.sha256(source.encode()).hexdigest()[:16]}.py"
        try:
            return Path(url_file("videoalign", source, name)).read_bytes()
        except MissingRewardWeightsError as err:
            raise VideoAlignError(
                f"videoalign: could not fetch the prompt template {source} ({err.__cause__!r}); offline, "
                "pass template: PATH to prompt_template.py of a VideoAlign clone (KwaiVGI/VideoAlign)"
            ) from None
    path = Path(source).expanduser()
    if not path.is_file():
        raise VideoAlignError(
            f"videoalign: template '{source}' is not a file (VideoAlign's prompt_template.py)"
        )
    return path.read_bytes()


# -- the checkpoint ------------------------------------------------------------------------
def latest_checkpoint(root: Path) -> Path:
    steps = sorted(root.glob("checkpoint-*"), key=lambda p: int(p.name.rpartition("-")[2]), reverse=True)
    if not steps or not (steps[0] / "model.pth").is_file():
        raise VideoAlignError(
            f"videoalign: no checkpoint-N/model.pth under {root}; download the released model with "
            "`hf download KwaiVGI/VideoReward --local-dir DIR` and pass checkpoint: DIR"
        )
    return steps[0]


def lora_scale(peft_cfg: dict) -> float:
    r, alpha = peft_cfg.get("lora_r", 16), peft_cfg.get("lora_alpha", 32)
    return alpha / math.sqrt(r) if peft_cfg.get("use_rslora") else alpha / r


def merged_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The PEFT state dict of ``model.pth`` as a plain Qwen2-VL + ``rm_head`` state dict in
    the current transformers layout, every LoRA pair merged into its base weight."""
    plain, lora = {}, {}
    for key, value in state.items():
        key = key.removeprefix("base_model.model.")
        if ".original_module." in key:
            continue
        key = key.replace(".modules_to_save.default.", ".")
        found = re.match(r"(.*)\.lora_(A|B)\.[^.]+\.weight$", key)
        if found:
            lora.setdefault(found.group(1), {})[found.group(2)] = value
        elif ".lora_" in key:
            raise VideoAlignError(
                f"videoalign: LoRA weight '{key}' of an unsupported kind (linear LoRA only)"
            )
        else:
            plain[key.replace(".base_layer.", ".")] = value
    for module, pair in lora.items():
        weight = plain[f"{module}.weight"]
        delta = (pair["B"].float() @ pair["A"].float()) * scale
        plain[f"{module}.weight"] = (weight.float() + delta).to(weight.dtype)
    return {_current_name(k): v for k, v in plain.items()}


def _current_name(key: str) -> str:
    """transformers 4.45's Qwen2-VL names -> today's (vision tower and language model under
    ``model.``); names already current are kept."""
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + key.removeprefix("model.")
    return key


# -- the reward ----------------------------------------------------------------------------
class VideoAlignReward:
    """VideoAlign's VQ / MQ / TA scores of (B, F, 3, H, W) clips in [0, 1] (registry name
    ``videoalign``). ``score``: the value trained on, ``overall`` (VQ + MQ + TA) or one
    criterion (DanceGRPO trains HunyuanVideo on VQ); all three are logged. ``video_fps``:
    the clip's frame rate (Wan2.1: 16), from which ``fps`` frames a second are sampled
    (the checkpoint's ``data_config.fps`` unless given). ``base``: where the Qwen2-VL base's
    config and processor are (the checkpoint's ``model_name_or_path`` unless given: a hub
    id or a directory; its weights are not needed, ``model.pth`` holds them all)."""

    name = "videoalign"

    def __init__(
        self,
        checkpoint: str = "KwaiVGI/VideoReward",
        base: str | None = None,
        score: str = "overall",
        use_norm: bool = True,
        video_fps: float = 16.0,
        fps: float | None = None,
        max_pixels: int | None = None,
        template: str = TEMPLATE_URL,
        device=None,
        dtype: str = "bfloat16",
        batch_size: int = 2,
    ):
        if score not in SCORES:
            raise VideoAlignError(f"videoalign: score must be one of {', '.join(SCORES)}, got '{score}'")
        root = _checkpoint_dir(checkpoint)
        if not (root / "model_config.json").is_file():
            raise VideoAlignError(
                f"videoalign: {root} has no model_config.json; download the released model with "
                "`hf download KwaiVGI/VideoReward --local-dir DIR` and pass checkpoint: DIR"
            )
        config = json.loads((root / "model_config.json").read_text())
        model_cfg, data_cfg = config["model_config"], config.get("data_config", {})
        if model_cfg.get("reward_token", "special") != "special" or not model_cfg.get(
            "use_special_tokens", True
        ):
            raise VideoAlignError(
                "videoalign: only checkpoints read at the special reward tokens are supported"
            )
        step = latest_checkpoint(root)
        base = base or model_cfg["model_name_or_path"]
        self.processor = _processor(base, step)
        self.special_ids = self.processor.tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
        self.model, self.head = _model(base, step, config.get("peft_lora_config", {}))
        pinned = TEMPLATE_SHA256 if template == TEMPLATE_URL else None
        self.template = template_text(
            template, data_cfg.get("prompt_template_type", "detailed_special"), pinned
        )
        self.score, self.batch_size, self.video_fps = score, int(batch_size), float(video_fps)
        self.fps = float(fps if fps is not None else data_cfg.get("fps", 2.0))
        self.max_pixels = int(
            max_pixels if max_pixels is not None else data_cfg.get("max_frame_pixels", 200704)
        )
        self.norm = config.get("inference_config") if use_norm else None
        from rewards.clip_common import resolve_dtype

        self.to(device or "cpu", resolve_dtype(dtype))

    def to(self, device=None, dtype=None):
        self.model.to(device=device, dtype=dtype)
        self.head.to(device=device, dtype=dtype)
        self.device, self.dtype = self.head.weight.device, self.head.weight.dtype
        return self

    @property
    def models(self):
        return [self.model, self.head]

    def inputs(self, clips: torch.Tensor, prompts: list[str]):
        """The processor's batch for B clips and prompts, as ``prepare_batch`` builds it."""
        videos = [clip_frames(c, self.video_fps, self.fps, self.max_pixels) for c in clips]
        texts = [
            self.processor.apply_chat_template(
                [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": self.prompt(p)}]}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for p in prompts
        ]
        return self.processor(
            text=texts,
            videos=videos,
            padding=True,
            return_tensors="pt",
            do_rescale=True,
            do_resize=False,  # resized above as the reference's fetch_video does
            do_sample_frames=False,
        )

    def prompt(self, text: str) -> str:
        return self.template.format(text_prompt=text)

    @torch.no_grad()
    def raw_scores(self, clips: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """(B, 3) VQ, MQ, TA as the head reads them, before normalisation."""
        batch = self.inputs(clips, prompts).to(self.device)
        batch["pixel_values_videos"] = batch["pixel_values_videos"].to(self.dtype)
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        hidden = self.model(**inputs, position_ids=text_positions(batch["input_ids"])).last_hidden_state
        logits = self.head(hidden).float()  # (B, L, output_dim)
        mask = torch.isin(batch["input_ids"], torch.tensor(self.special_ids, device=self.device))
        b = len(prompts)
        if int(mask.sum()) != 3 * b:
            raise VideoAlignError(
                "videoalign: every prompt must hold each reward token once (check the template)"
            )
        pooled = logits[mask].view(b, 3, -1)
        return pooled.diagonal(dim1=1, dim2=2) if pooled.shape[-1] == 3 else pooled.reshape(b, 3)

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        video = as_video(images, self.name)
        if prompts is None or len(prompts) != video.shape[0]:
            raise VideoAlignError(f"videoalign needs one prompt per clip ({video.shape[0]})")
        raw = torch.cat(
            [
                self.raw_scores(video[s : s + self.batch_size], list(prompts[s : s + self.batch_size])).cpu()
                for s in range(0, video.shape[0], self.batch_size)
            ]
        )
        scores = raw
        if self.norm:
            mean = torch.tensor([self.norm[f"{c}_mean"] for c in CRITERIA])
            std = torch.tensor([self.norm[f"{c}_std"] for c in CRITERIA])
            scores = (raw - mean) / std
        out = {f"{self.name}_{c.lower()}": scores[:, i] for i, c in enumerate(CRITERIA)}
        out[f"{self.name}_overall"] = scores.sum(1)
        out[self.name] = out[f"{self.name}_{self.score.lower()}"]
        return out


def _checkpoint_dir(spec: str) -> Path:
    """A local directory, or a hub repository's snapshot (downloaded once into the hub cache)."""
    from rewards.clip_common import looks_like_hub_id

    if not looks_like_hub_id(spec):
        return Path(spec).expanduser()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec))
    except Exception as err:  # offline, unknown repository: one line, the fix
        raise VideoAlignError(
            f"videoalign: could not get {spec} from the hub ({type(err).__name__}); download it with "
            f"`hf download {spec} --local-dir DIR` and pass checkpoint: DIR"
        ) from None


def _processor(base: str, step: Path):
    """The base's processor with right padding and the checkpoint's tokenizer (or the
    base's with the three reward tokens appended)."""
    from transformers import AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(base, padding_side="right")
    except OSError as err:
        raise VideoAlignError(
            f"videoalign: the base model's processor '{base}' is not available ({err}); fetch it with "
            f"`hf download {base} --include '*.json' '*.txt'` or pass base: DIR"
        ) from None
    if (step / "tokenizer").is_dir():
        processor.tokenizer = AutoTokenizer.from_pretrained(step / "tokenizer", padding_side="right")
    else:
        processor.tokenizer.add_tokens(list(SPECIAL_TOKENS), special_tokens=True)
    return processor


def _model(base: str, step: Path, peft_cfg: dict):
    """(Qwen2VLModel, rm_head) with ``model.pth``'s weights, LoRA merged."""
    from transformers import AutoConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    state = torch.load(step / "model.pth", map_location="cpu", weights_only=True)
    state = merged_state_dict(state, lora_scale(peft_cfg))
    head_weight = state.pop("rm_head.weight")
    state.pop("lm_head.weight", None)  # the language-model head: never read by the reward
    config = AutoConfig.from_pretrained(base)
    config.text_config.vocab_size = state["model.language_model.embed_tokens.weight"].shape[0]
    model = Qwen2VLModel(config).eval().requires_grad_(False)
    missing, unexpected = model.load_state_dict(
        {k.removeprefix("model."): v for k, v in state.items()}, strict=False
    )
    if missing or unexpected:
        raise VideoAlignError(
            f"videoalign: {step / 'model.pth'} does not fit the base '{base}' "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    head = torch.nn.Linear(head_weight.shape[1], head_weight.shape[0], bias=False).requires_grad_(False)
    head.weight.data.copy_(head_weight)
    return model, head

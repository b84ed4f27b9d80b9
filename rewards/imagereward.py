"""ImageReward (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for
Text-to-Image Generation") loaded from the official ``ImageReward.pt`` without the ``image-reward``
package, which pins timm 0.6 / fairscale and imports helpers transformers 5 removed.

The model (THUDM/ImageReward, ImageReward/ImageReward.py) is BLIP (Li et al. 2022): a ViT-L/16
encodes the 224 px image; the BERT text encoder reads the prompt and cross-attends to the image
tokens in every layer; an MLP maps the text encoder's position-0 feature to a scalar, and

    score = (mlp(h_0) - 0.16717362830052426) / 1.0333394966054072.

Facts taken from the reference code, each with a test:
- the prompt is tokenized by bert-base-uncased (plus BLIP's [DEC] and [ENC] special tokens),
  padded to 35 tokens; ``ImageReward.score`` feeds the ids as they come, so position 0 is [CLS].
  (BLIP's ITM head swaps in [ENC] there; ImageReward's scoring never does.)
- images: Resize(224, bicubic) on the short side, CenterCrop(224), CLIP mean/std normalisation.
  Here that runs on tensors (bicubic with antialias, PIL's filter) so the reward is differentiable.
- ``ImageReward.pt`` is a plain state dict of the ImageReward module: ``blip.visual_encoder.*``,
  ``blip.text_encoder.*``, ``mlp.layers.{0,2,4,6,7}.*``, plus BLIP's unused contrastive projections
  ``blip.vision_proj.*`` / ``blip.text_proj.*`` and med.py's ``embeddings.position_ids`` buffer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rewards.blip import BertTextEncoder, TextConfig, VisionTransformer, ViTConfig
from rewards.clip_common import resolve_dtype
from rewards.errors import UserError, one_line
from rewards.heads import RewardMLP
from rewards.images import RewardInputError, to_tensor_batch

HUB_REPO = "THUDM/ImageReward"
SCORE_MEAN = 0.16717362830052426  # ImageReward.__init__: self.mean / self.std
SCORE_STD = 1.0333394966054072
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_LENGTH = 35  # ImageReward.score: padding='max_length', truncation=True, max_length=35
DOWNLOAD_HINT = (
    "Get the official files with `hf download THUDM/ImageReward ImageReward.pt med_config.json "
    "--local-dir DIR` and pass checkpoint='DIR/ImageReward.pt' (med_config.json is read from "
    "the same folder)."
)
TOKENIZER_HINT = (
    "ImageReward uses the bert-base-uncased tokenizer: `hf download bert-base-uncased vocab.txt "
    "tokenizer_config.json --local-dir DIR` and pass tokenizer='DIR'."
)
_VISION_KEYS = {"image_size", "patch_size", "width", "depth", "heads", "mlp_ratio"}

# Official key prefix -> our module's prefix; the rest of each key is the same (rewards/blip.py
# keeps vit.py's and med.py's names).
_RENAMES = (
    ("blip.visual_encoder.", "visual_encoder."),
    ("blip.text_encoder.", "text_encoder."),
    ("mlp.layers.", "mlp.layers."),
)
# In ImageReward.pt but not used to score: BLIP_Pretrain's ITC projections and a buffer (arange).
_UNUSED = ("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids")


class ImageRewardFilesMissing(UserError, FileNotFoundError):
    """A file the ImageReward loader needs is not on disk and could not be fetched."""


class ImageRewardCheckpointError(UserError, ValueError):
    """The checkpoint's keys or shapes do not match the model that was built."""


class ImageRewardNet(nn.Module):
    """BLIP image encoder + image-grounded text encoder + MLP; returns the raw (unnormalised) score."""

    def __init__(self, vision: ViTConfig, text: TextConfig):
        super().__init__()
        self.visual_encoder = VisionTransformer(vision)
        self.text_encoder = BertTextEncoder(text)
        self.mlp = RewardMLP(text.hidden_size)

    def forward(
        self, pixels: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        image = self.visual_encoder(pixels)
        text = self.text_encoder(input_ids, attention_mask, image)
        # the reference casts the CLS feature to float before the head; the head stays fp32 here
        return self.mlp(text[:, 0].float()).squeeze(-1)


def normalize_score(raw: torch.Tensor) -> torch.Tensor:
    return (raw - SCORE_MEAN) / SCORE_STD


def preprocess(images: torch.Tensor, size: int = 224) -> torch.Tensor:
    """(B, 3, H, W) float in [0, 1] -> (B, 3, size, size) CLIP-normalised, differentiably.

    Mirrors torchvision's Resize(size) (short side to ``size``, long side ``int(size*long/short)``)
    and CenterCrop(size). Bicubic with antialias is PIL's filter (a = -0.5, widened when shrinking);
    the clamp stands in for PIL's uint8 output. An image already at the target size is not resampled,
    as torchvision leaves it.
    """
    h, w = images.shape[-2:]
    new_h, new_w = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    x = images.float()
    if (new_h, new_w) != (h, w):
        x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True).clamp(
            0, 1
        )
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    x = x[..., top : top + size, left : left + size]
    mean = torch.tensor(CLIP_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


def map_official_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official ImageReward.pt keys -> ImageRewardNet keys. Known-unused keys are dropped; any other
    key passes through unchanged, so a strict load names it as unexpected rather than losing it."""
    out = {}
    for key, value in state.items():
        if key.startswith(_UNUSED):
            continue
        for src, dst in _RENAMES:
            if key.startswith(src):
                out[dst + key[len(src) :]] = value
                break
        else:
            out[key] = value
    return out


def official_name(key: str) -> str:
    """ImageRewardNet key -> the key it has in ImageReward.pt (for error messages)."""
    for src, dst in _RENAMES:
        if key.startswith(dst):
            return src + key[len(dst) :]
    return key


def _is_hub_id(spec: str) -> bool:
    return (
        not Path(spec).expanduser().exists()
        and re.fullmatch(r"[\w.-]+/[\w.-]+", spec) is not None
        and not spec.endswith((".pt", ".pth", ".bin", ".json"))
    )


def _hub_file(repo: str, filename: str, hint: str) -> Path:
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(repo_id=repo, filename=filename))
    except Exception as err:  # offline, unknown repo, no cache: all the same answer for the user
        raise ImageRewardFilesMissing(
            f"ImageReward: could not get {filename} from the hub repo '{repo}' ({one_line(err)}). {hint}"
        ) from err


def _local_file(path: Path, what: str) -> Path:
    path = path.expanduser()
    if not path.is_file():
        raise ImageRewardFilesMissing(f"ImageReward: {what} not found at '{path}'. {DOWNLOAD_HINT}")
    return path


def resolve_files(checkpoint: str | Path, med_config: str | Path | dict | None) -> tuple[Path, dict]:
    """Checkpoint path and med config dict from a hub id, a folder, or a file (+ its sibling config)."""
    spec = str(checkpoint)
    if _is_hub_id(spec):
        ckpt = _hub_file(spec, "ImageReward.pt", DOWNLOAD_HINT)
        default_cfg = lambda: _hub_file(spec, "med_config.json", DOWNLOAD_HINT)  # noqa: E731
    else:
        root = Path(spec).expanduser()
        ckpt = _local_file(root / "ImageReward.pt" if root.is_dir() else root, "checkpoint ImageReward.pt")
        default_cfg = lambda: _local_file(ckpt.parent / "med_config.json", "med_config.json")  # noqa: E731
    if isinstance(med_config, dict):
        return ckpt, med_config
    cfg_path = default_cfg() if med_config is None else _local_file(Path(med_config), "med_config.json")
    return ckpt, json.loads(cfg_path.read_text())


def load_tokenizer(spec: str | Path, vocab_size: int):
    """bert-base-uncased plus BLIP's init_tokenizer specials ([DEC] as bos, [ENC] as an additional
    special token), so prompts containing those strings tokenize as the reference does."""
    try:
        from transformers import BertTokenizer

        tok = BertTokenizer.from_pretrained(
            str(Path(spec).expanduser()) if Path(spec).expanduser().exists() else spec
        )
    except Exception as err:
        raise ImageRewardFilesMissing(
            f"ImageReward: tokenizer '{spec}' could not be loaded ({one_line(err)}). {TOKENIZER_HINT}"
        ) from err
    tok.add_special_tokens({"bos_token": "[DEC]"})
    # transformers 5 no longer keeps additional_special_tokens_ids, so look [ENC] up by name
    tok.add_tokens(["[ENC]"], special_tokens=True)
    tok.enc_token_id = tok.convert_tokens_to_ids("[ENC]")
    if len(tok) > vocab_size:
        raise ValueError(
            f"ImageReward: tokenizer '{spec}' has {len(tok)} tokens but the text embedding has "
            f"{vocab_size} rows; it is not the bert-base-uncased vocabulary the checkpoint expects"
        )
    return tok


def load_net(path: Path, vision: ViTConfig, text: TextConfig) -> ImageRewardNet:
    """Build ImageRewardNet and load ImageReward.pt into it with strict=True after the key mapping."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not any(str(k).startswith("blip.") for k in state):
        top = list(state)[:5] if isinstance(state, dict) else type(state).__name__
        raise ImageRewardCheckpointError(
            f"ImageReward: '{path}' is not an ImageReward state dict "
            f"(expected keys 'blip.*' and 'mlp.*'; found {top})"
        )
    mapped = map_official_state_dict(state)
    net = ImageRewardNet(vision, text)
    expected = set(net.state_dict())
    missing = sorted(official_name(k) for k in expected - set(mapped))
    unexpected = sorted(k for k in mapped if k not in expected)
    if missing or unexpected:
        raise ImageRewardCheckpointError(
            f"ImageReward: '{path}' does not match the model built from med_config/vision_config: "
            f"{len(missing)} missing keys {missing[:8]}, {len(unexpected)} unexpected keys {unexpected[:8]}"
        )
    try:
        net.load_state_dict(mapped, strict=True)
    except RuntimeError as err:  # shapes: a vision_config or med_config that is not the checkpoint's
        raise ImageRewardCheckpointError(f"ImageReward: '{path}': {one_line(err)}") from err
    return net


def _vision_config(overrides: dict | None) -> ViTConfig:
    overrides = dict(overrides or {})
    unknown = set(overrides) - _VISION_KEYS
    if unknown:
        raise ValueError(f"vision_config: unknown keys {sorted(unknown)}; valid keys: {sorted(_VISION_KEYS)}")
    return ViTConfig(**overrides)


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    try:
        return resolve_dtype(dtype)
    except ValueError as err:
        raise ValueError(f"imagereward: {err}") from None


class ImageReward:
    """Registry name ``imagereward``: ``reward(images, prompts, metadata) -> {"imagereward": (B,)}``.

    Differentiable in the images (ReFL-style use); the weights are frozen. Video (B, F, 3, H, W)
    is scored per frame and averaged. Scores do not depend on ``batch_size`` (fixed 35-token
    padding, per-sample attention masks).
    """

    name = "imagereward"

    def __init__(
        self,
        checkpoint: str | Path = HUB_REPO,
        med_config: str | Path | dict | None = None,
        tokenizer: str | Path = "bert-base-uncased",
        device: str | torch.device | None = None,
        dtype: str | torch.dtype = "float32",
        batch_size: int = 8,
        vision_config: dict | None = None,
        max_length: int = MAX_LENGTH,
    ):
        if int(batch_size) < 1:
            raise ValueError(f"imagereward: batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.max_length = int(batch_size), int(max_length)
        vision = _vision_config(vision_config)
        ckpt, med = resolve_files(checkpoint, med_config)
        text = TextConfig.from_med_config(med, encoder_width=vision.width)
        self.net = load_net(ckpt, vision, text).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(tokenizer, text.vocab_size)
        self.enc_token_id = self.tokenizer.enc_token_id  # as BLIP exposes it; scoring does not use it
        self.image_size = vision.image_size
        self.to(device or ("cuda" if torch.cuda.is_available() else "cpu"), dtype)

    def to(
        self, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None
    ) -> ImageReward:
        """Move the encoders to ``device``/``dtype``; the small MLP head stays float32."""
        if device is not None:
            self.device = torch.device(device)
            self.net.to(self.device)
        if dtype is not None:
            self.dtype = _dtype(dtype)
            self.net.visual_encoder.to(self.dtype)
            self.net.text_encoder.to(self.dtype)
        return self

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer(
            list(prompts),
            padding="max_length",
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        return enc.input_ids.to(self.device), enc.attention_mask.to(self.device)

    def _prompts(self, prompts, n: int) -> list[str]:
        if isinstance(prompts, str):
            prompts = [prompts] * n
        prompts = list(prompts)
        if len(prompts) != n or not all(isinstance(p, str) for p in prompts):
            raise ValueError(
                f"imagereward: need one prompt string per image ({n} images), got {len(prompts)} prompts"
            )
        return prompts

    def score_pixels(self, pixels: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Normalised scores for one chunk of preprocessed (N, 3, S, S) pixels and N prompts."""
        ids, mask = self.tokenize(prompts)
        return normalize_score(self.net(pixels.to(self.device, self.dtype), ids, mask))

    def __call__(self, images, prompts, metadata=None) -> dict[str, torch.Tensor]:
        batch = to_tensor_batch(images)
        if batch.shape[0] == 0:
            return {self.name: torch.zeros(0, device=self.device)}
        lo, hi = batch.detach().aminmax()
        if lo < -0.5 or hi > 1.5:  # catches [-1, 1] or 0..255 inputs, which would score silently wrong
            raise RewardInputError(
                f"imagereward: images must be in [0, 1]; got values in [{lo:.3g}, {hi:.3g}]"
            )
        frames = batch.flatten(0, 1) if batch.ndim == 5 else batch
        repeat = frames.shape[0] // batch.shape[0]  # video: F frames per prompt
        texts = [p for p in self._prompts(prompts, batch.shape[0]) for _ in range(repeat)]
        scores = []
        for s in range(
            0, frames.shape[0], self.batch_size
        ):  # one chunk of full-size frames on the device at a time
            pixels = preprocess(frames[s : s + self.batch_size].to(self.device), self.image_size)
            scores.append(self.score_pixels(pixels, texts[s : s + self.batch_size]))
        return {self.name: torch.cat(scores).view(batch.shape[0], repeat).mean(1)}

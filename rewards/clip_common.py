"""Shared machinery for the CLIP-family rewards (HPSv2, PickScore, CLIPScore, LAION aesthetic).

Everything here works on tensors so that a reward can be differentiated with respect to
its input images (DRaFT / ReFL-style direct reward backprop): resizing is
``torch.nn.functional.interpolate`` (bicubic, antialiased: torchvision's tensor resize for
HPSv2, PIL's two-pass resize for the ``CLIPImageProcessor`` models), padding and cropping
are tensor ops, and the CLIP normalisation constants are module constants.

Weights are never loaded at import time. A reward resolves its weights when it is
constructed: a local file or directory is used as is; a Hugging Face hub id goes through
the ordinary hub path (``huggingface_hub.hf_hub_download`` / ``from_pretrained``), so a
user with internet gets the weights and a user without gets one
:class:`MissingRewardWeightsError` that names the file and the command that fetches it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Sequence
from urllib.parse import unquote, urlparse

import torch
import torch.nn.functional as F

from rewards.errors import UserError, one_line
from rewards.images import RewardInputError, to_tensor_batch

# OpenAI CLIP's published pixel statistics (Radford et al. 2021; ``OPENAI_DATASET_MEAN/STD``
# in open_clip, ``OPENAI_CLIP_MEAN/STD`` in transformers). Every model in this family was
# trained with them: OpenAI ViT-L/14, LAION ViT-H-14 (HPSv2, PickScore).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# "owner/name" with the characters the hub allows; anything else is taken for a local path
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")


class MissingRewardWeightsError(UserError, FileNotFoundError):
    """A reward's weights are neither on disk nor obtainable from the hub."""


# ----------------------------------------------------------------------------- weights


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype) not in _DTYPES:
        raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {dtype!r}")
    return _DTYPES[str(dtype)]


def looks_like_hub_id(spec: str) -> bool:
    """True for ``owner/name`` that is not an existing local path (nor a weights file name,
    so a mistyped relative path like ``ckpt/HPS_v2.pt`` is reported as a missing file)."""
    return (
        bool(_HUB_ID.match(spec))
        and not os.path.exists(spec)
        and not spec.startswith(".")
        and not spec.endswith(_WEIGHT_SUFFIXES)
    )


def missing_weights(reward: str, what: str, fetch: str) -> MissingRewardWeightsError:
    return MissingRewardWeightsError(f"{reward}: weights not found: {what}. {fetch}")


def hub_file(reward: str, repo_id: str, filename: str, arg: str = "checkpoint") -> str:
    """Download (or reuse the cached) ``repo_id/filename`` through the hub client."""
    import huggingface_hub  # module attribute lookup, so tests can monkeypatch it

    try:
        return huggingface_hub.hf_hub_download(repo_id, filename)
    except Exception as err:  # offline, gated, missing: all mean "the file is not here"
        raise missing_weights(
            reward,
            f"'{filename}' from hub repo '{repo_id}' could not be fetched ({type(err).__name__})",
            f"Download it with `hf download {repo_id} {filename} --local-dir DIR` "
            f"and pass {arg}='DIR/{filename}'.",
        ) from err


def url_file_path(url: str, filename: str | None = None) -> str:
    """Where :func:`url_file` keeps ``url``'s file: torch.hub's checkpoint cache, under
    ``filename`` (default: the URL's own file name)."""
    name = filename or unquote(os.path.basename(urlparse(url).path))
    return os.path.join(torch.hub.get_dir(), "checkpoints", name)


def url_file(reward: str, url: str, filename: str | None = None) -> str:
    """Download ``url`` once into torch.hub's checkpoint cache (for weights published outside
    the hub); ``filename`` names the cached file where URLs share a file name."""
    dst = url_file_path(url, filename)
    if os.path.isfile(dst):
        return dst
    try:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        torch.hub.download_url_to_file(url, dst, progress=False)
    except Exception as err:
        raise missing_weights(
            reward,
            f"'{url}' could not be downloaded ({type(err).__name__})",
            f"Fetch it with `wget '{url}' -O '{dst}'`, or pass a local file path.",
        ) from err
    return dst


def local_file(reward: str, path: str, fetch: str) -> str:
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise missing_weights(reward, f"no file at '{path}'", fetch)
    return path


def hf_pretrained(
    reward: str, cls, spec: str, arg: str = "pretrained", unused: tuple[str, ...] = (), **kwargs
):
    """``cls.from_pretrained(spec)`` for a local directory or a hub id, with one clear error.

    ``unused``: prefixes of parameters the model builds but the reward never runs (TrOCR's
    checkpoints have no ViT pooler), which may therefore be missing from the checkpoint."""
    fetch = (
        f"Download it with `hf download {spec} --local-dir DIR` and pass {arg}='DIR'"
        if looks_like_hub_id(spec)
        else f"Pass {arg}= a hub id or a directory saved with save_pretrained"
    )
    if not looks_like_hub_id(spec) and not os.path.isdir(os.path.expanduser(spec)):
        raise missing_weights(reward, f"no directory at '{spec}'", fetch + ".")
    try:
        with quiet_loading():
            loaded = cls.from_pretrained(os.path.expanduser(spec), **kwargs)
    except OSError as err:  # transformers reports missing local/hub files as OSError
        raise missing_weights(reward, f"'{spec}' could not be loaded ({one_line(err)})", fetch + ".") from err
    if not kwargs.get("output_loading_info"):
        return loaded
    model, info = loaded
    missing = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(unused))
    if missing:  # a reward with randomly initialised layers is silently wrong
        raise ValueError(
            f"{reward}: '{spec}' lacks weights for {len(missing)} parameters, e.g. {missing[:3]}"
        )
    return model


@contextlib.contextmanager
def quiet_loading():
    """Silence load chatter that is misleading here: open_clip warns "initialized randomly"
    before we load the checkpoint, and transformers reports the text-tower keys that a
    vision-only model skips on purpose. Errors still surface."""
    import transformers

    level, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    root_disabled = logging.root.manager.disable
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(root_disabled)
        transformers.logging.set_verbosity(level)
        if bars:
            transformers.logging.enable_progress_bar()


def strip_prefix(state_dict: dict, prefix: str = "module.") -> dict:
    """Drop a DistributedDataParallel ``module.`` prefix when every key carries it."""
    if state_dict and all(k.startswith(prefix) for k in state_dict):
        return {k[len(prefix) :]: v for k, v in state_dict.items()}
    return state_dict


# ----------------------------------------------------------------------------- images


def reward_images(images, reward: str) -> torch.Tensor:
    """Float (B, 3, H, W) batch; video goes through the ``video_frames`` wrapper instead."""
    batch = to_tensor_batch(images)
    if batch.ndim == 5:
        raise RewardInputError(
            f"{reward} scores images (B, 3, H, W); got video {tuple(batch.shape)}. "
            f"Score video with the 'video_frames' reward (rewards.video), e.g. "
            f"rewards.build('video_frames', reward='{reward}', args={{...}})."
        )
    return batch


def reward_prompts(prompts, n: int, reward: str, keep_metadata: bool = False) -> list[str]:
    """One plain string per image (tokenizers get no ``str`` subclasses); ``keep_metadata``
    keeps :class:`~rewards.prompts.AnnotatedPrompt` objects for rewards that read it."""
    if isinstance(prompts, str) or prompts is None or len(prompts) != n:
        got = "None" if prompts is None else repr(prompts) if isinstance(prompts, str) else f"{len(prompts)}"
        raise RewardInputError(f"{reward} needs one prompt per image: {n} images, prompts={got}")
    return [p if keep_metadata and hasattr(p, "metadata") else str(p) for p in prompts]


def resize_bicubic(images: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """Bicubic resize with antialias, as ``torchvision.transforms.functional.resize`` on a
    float tensor (same call underneath; an identity size is returned untouched, as there)."""
    if tuple(images.shape[-2:]) == tuple(size_hw):
        return images
    return F.interpolate(images, size=tuple(size_hw), mode="bicubic", align_corners=False, antialias=True)


def resize_longest_and_pad(images: torch.Tensor, size: int, fill: float = 0.0) -> torch.Tensor:
    """HPSv2's eval transform (``ResizeMaxSize`` in tgxs002/HPSv2 hpsv2/src/open_clip/transform.py).

    Scale so the LONGER side is ``size`` (new side = Python ``round(side * scale)``), then pad
    to a square with ``fill`` (0 = black, before normalisation), centred: left/top get
    ``pad // 2`` and right/bottom the rest. The official transform skips the pad when the
    longer side already equals ``size``; we always pad, since the ViT needs a square input.
    """
    h, w = images.shape[-2:]
    scale = size / float(max(h, w))
    new_h, new_w = round(h * scale), round(w * scale)
    images = resize_bicubic(images, (new_h, new_w))
    pad_h, pad_w = size - new_h, size - new_w
    return F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=fill)


def resize_bicubic_pil(images: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """Bicubic resize as PIL's ``Image.resize(BICUBIC)`` (and torch's uint8 path) computes it.

    torch's antialiased float kernel is PIL's (a = -0.5, support scaled by the downscale
    factor), but PIL resamples horizontally, then vertically, and keeps the intermediate
    image in 8 bits, which clips the bicubic overshoot. Clamping to [0, 1] after each pass
    reproduces that; a single 2-D pass differs by up to ~20/255 on high-frequency content.
    The clamp only zeroes the gradient of overshooting pixels.
    """
    (h, w), (new_h, new_w) = images.shape[-2:], size_hw
    if new_w != w:
        images = F.interpolate(images, size=(h, new_w), mode="bicubic", align_corners=False, antialias=True)
        images = images.clamp(0, 1)
    if new_h != h:
        images = F.interpolate(
            images, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True
        )
        images = images.clamp(0, 1)
    return images


def resize_shortest_and_center_crop(images: torch.Tensor, size: int) -> torch.Tensor:
    """transformers ``CLIPImageProcessor``: resize the SHORTER side to ``size`` (longer side
    ``int(size * long / short)``, floored as ``get_resize_output_image_size``), with PIL's
    bicubic (:func:`resize_bicubic_pil`), then a centre crop whose top-left is
    ``int((side - size) / 2)``. The processor also rounds the resized image to uint8; we
    keep floats, so results differ from it by at most about 1/255 per pixel."""
    h, w = images.shape[-2:]
    if w <= h:
        new_h, new_w = int(size * h / w), size
    else:
        new_h, new_w = size, int(size * w / h)
    images = resize_bicubic_pil(images, (new_h, new_w))
    top, left = (new_h - size) // 2, (new_w - size) // 2
    return images[..., top : top + size, left : left + size]


def normalize(images: torch.Tensor, mean=CLIP_MEAN, std=CLIP_STD) -> torch.Tensor:
    m = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - m) / s


def image_size_of(size) -> int:
    """A square model input size from an int or an (h, w) pair."""
    if isinstance(size, (tuple, list)):
        if size[0] != size[1]:
            raise ValueError(f"CLIP rewards expect a square image size, got {tuple(size)}")
        size = size[0]
    return int(size)


# ----------------------------------------------------------------------------- base class


class ClipReward:
    """Common ``reward(images, prompts, metadata)`` driver: input checks, chunking, device/dtype.

    Subclasses set ``name``, list their torch modules in ``_modules()`` and implement
    ``_score(pixels, prompts) -> dict`` on one chunk of fp32 [0, 1] pixels already on the
    reward's device. The call does not switch off autograd: under ``torch.enable_grad()``
    with images that require grad, the scores are differentiable with respect to them
    (the model's own parameters are frozen).
    """

    name = "clip_reward"
    differentiable = True
    needs_prompts = True  # False for image-only scores (aesthetic): prompts are then ignored
    reads_metadata = False  # True where a prompt's line metadata is scored (geneval)

    def __init__(self, device=None, dtype="float32", batch_size: int = 16):
        if int(batch_size) < 1:
            raise ValueError(f"{self.name}: batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.device = torch.device(device or "cpu")
        self.dtype = resolve_dtype(dtype)

    def _modules(self) -> Sequence[torch.nn.Module]:
        raise NotImplementedError

    def _freeze(self) -> None:
        for module in self._modules():
            module.requires_grad_(False)
            module.eval()
            module.to(device=self.device, dtype=self.dtype)

    def to(self, device=None, dtype=None) -> ClipReward:
        """Move the model (the trainer calls this with the policy's device and dtype)."""
        if device is not None:
            self.device = torch.device(device)
        if dtype is not None:
            self.dtype = resolve_dtype(dtype)
        for module in self._modules():
            module.to(device=self.device, dtype=self.dtype)
        return self

    def _score(self, pixels: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def __call__(self, images, prompts=None, metadata=None) -> dict[str, torch.Tensor]:
        if isinstance(images, (list, tuple)) and len({getattr(im, "size", None) for im in images}) > 1:
            # PIL images of different sizes cannot be stacked: each is preprocessed on its own
            # (scores do not depend on the batch, so this changes nothing but speed)
            batches = [reward_images([im], self.name) for im in images]
        else:
            batches = [reward_images(images, self.name)]
        n = sum(b.shape[0] for b in batches)
        prompts = (
            reward_prompts(prompts, n, self.name, self.reads_metadata) if self.needs_prompts else [""] * n
        )
        parts, start = [], 0
        for batch in batches:
            stop = start + batch.shape[0]
            parts.append(run_chunked(self._score, batch, prompts[start:stop], self.batch_size, self.device))
            start = stop
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def run_chunked(
    score: Callable, batch: torch.Tensor, prompts: list[str], batch_size: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Score ``batch`` ``batch_size`` images at a time; (B,) fp32 results on the input's device.

    Images are scored independently, so chunking only bounds memory, never the result.
    """
    parts = []
    for i in range(0, batch.shape[0], batch_size):
        pixels = batch[i : i + batch_size].to(device=device, dtype=torch.float32)
        parts.append(score(pixels, prompts[i : i + batch_size]))
    return {k: torch.cat([p[k] for p in parts]).float().to(batch.device) for k in parts[0]}


def to_model(batch, device, dtype) -> dict[str, torch.Tensor]:
    """A processor's outputs on the model's device, floats in the model's dtype (ids stay integers)."""
    return {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in batch.items()}


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine of L2-normalised features, computed in fp32."""
    a, b = F.normalize(a.float(), dim=-1), F.normalize(b.float(), dim=-1)
    return (a * b).sum(-1)


# ----------------------------------------------------------------------------- transformers CLIP


def hf_tokenize(tokenizer, prompts: list[str], max_length: int, device) -> dict[str, torch.Tensor]:
    """Pad every prompt to the model's full context so a prompt tokenizes the same in any batch."""
    enc = tokenizer(
        prompts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
    )
    return {"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)}


def hf_image_embeds(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """``CLIPModel.get_image_features`` spelled out (its return type changed in transformers 5)."""
    pooled = model.vision_model(pixel_values=pixel_values).pooler_output
    return model.visual_projection(pooled)


def hf_text_embeds(model, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
    pooled = model.text_model(**tokens).pooler_output
    return model.text_projection(pooled)


def hf_text_max_length(tokenizer, model) -> int:
    return min(int(tokenizer.model_max_length), int(model.config.text_config.max_position_embeddings))


def has_tokenizer_files(spec: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
    return os.path.isdir(spec) and any(os.path.isfile(os.path.join(spec, n)) for n in names)


class TransformersClipReward(ClipReward):
    """A transformers ``CLIPModel`` reward preprocessed as ``CLIPImageProcessor`` does.

    ``tokenizer=None`` takes the tokenizer from ``pretrained`` when that is a directory
    holding one, else from ``default_tokenizer`` (itself defaulting to ``pretrained``).
    """

    default_pretrained = "openai/clip-vit-large-patch14"
    default_tokenizer: str | None = None

    def __init__(
        self,
        pretrained: str | None = None,
        tokenizer: str | None = None,
        device=None,
        dtype="float32",
        batch_size: int = 16,
    ):
        from transformers import AutoTokenizer, CLIPModel

        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        pretrained = pretrained or self.default_pretrained
        if tokenizer is None:
            local = has_tokenizer_files(os.path.expanduser(pretrained))
            tokenizer = pretrained if local else (self.default_tokenizer or pretrained)
        self.model = hf_pretrained(self.name, CLIPModel, pretrained, output_loading_info=True)
        self.tokenizer = hf_pretrained(self.name, AutoTokenizer, tokenizer, arg="tokenizer")
        self.image_size = image_size_of(self.model.config.vision_config.image_size)
        self.max_length = hf_text_max_length(self.tokenizer, self.model)
        self._freeze()

    def _modules(self):
        return [self.model]

    def preprocess(self, pixels: torch.Tensor) -> torch.Tensor:
        return normalize(resize_shortest_and_center_crop(pixels, self.image_size))

    def features(self, pixels: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected, unnormalised image and text embeddings (B, D) of one chunk."""
        image = hf_image_embeds(self.model, self.preprocess(pixels).to(self.dtype))
        tokens = hf_tokenize(self.tokenizer, prompts, self.max_length, self.device)
        return image, hf_text_embeds(self.model, tokens)

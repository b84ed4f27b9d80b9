"""Human Preference Score v2 / v2.1 (Wu et al. 2023, "Human Preference Score v2: A Solid
Benchmark for Evaluating Human Preferences of Text-to-Image Synthesis", arXiv:2306.09341).

HPSv2 is OpenCLIP ViT-H-14 fine-tuned on HPD v2; the score is the cosine between the
L2-normalised image and text features (official ``hpsv2/img_score.py``:
``diag(image_features @ text_features.T)`` of the normalised features).

Checkpoint format, as the official code loads it (``model.load_state_dict(checkpoint
['state_dict'])`` in tgxs002/HPSv2 ``hpsv2/img_score.py``): a dict whose ``'state_dict'``
entry is an open_clip ``CLIP`` state dict for ``ViT-H-14`` (keys ``visual.*``,
``transformer.*``, ``token_embedding.weight``, ``positional_embedding``, ``ln_final.*``,
``text_projection``, ``logit_scale``; no ``module.`` prefix). Files ``HPS_v2_compressed.pt``
and ``HPS_v2.1_compressed.pt`` live in the hub repo ``xswu/HPSv2``. The ``hpsv2`` pip
package is not used (it does not import with current torch/timm); open_clip builds the
same architecture.

Preprocessing is the official eval transform (``light_augmentation=True`` ->
``ResizeMaxSize``): resize the longer side to 224 (bicubic), zero-pad to a centred square,
normalise with the OpenAI CLIP mean/std.
"""

from __future__ import annotations

import os

import torch

from rewards.clip_common import (
    ClipReward,
    cosine,
    hub_file,
    image_size_of,
    local_file,
    looks_like_hub_id,
    normalize,
    quiet_loading,
    resize_longest_and_pad,
    strip_prefix,
)

HUB_REPO = "xswu/HPSv2"
RANDOM = "random"  # checkpoint value: the architecture with random weights (speed and memory only)


def load_hps_model(reward: str, checkpoint: str, model_name: str):
    """open_clip ``model_name`` with the official HPS checkpoint format loaded strictly."""
    import open_clip

    if open_clip.get_model_config(model_name) is None:
        raise ValueError(f"{reward}: open_clip has no model config '{model_name}' (HPSv2 uses 'ViT-H-14')")
    with quiet_loading():
        model = open_clip.create_model(model_name, pretrained=None)
    if checkpoint == RANDOM:
        return model, open_clip.get_tokenizer(model_name)
    # map_location="cpu": the file may carry CUDA tensors; the reward moves the model itself
    checkpoint_dict = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint_dict, dict) or "state_dict" not in checkpoint_dict:
        raise ValueError(
            f"{reward}: '{checkpoint}' is not an HPS checkpoint (expected a dict with 'state_dict')"
        )
    model.load_state_dict(strip_prefix(checkpoint_dict["state_dict"]), strict=True)
    return model, open_clip.get_tokenizer(model_name)


class HPSv2(ClipReward):
    """HPSv2 reward: ``reward(images, prompts) -> {"hpsv2": cosine (B,)}``.

    Args:
        checkpoint: local path to ``HPS_v2_compressed.pt`` (or a directory holding it), a hub
            repo id holding it, or None for the official hub repo ``xswu/HPSv2`` (downloaded
            once into the huggingface_hub cache), or ``"random"``: the architecture with random
            weights, for measuring throughput and memory (the scores mean nothing).
        model_name: open_clip architecture name (``ViT-H-14``; tests pass a tiny config).
        device, dtype, batch_size: where and how to run; ``batch_size`` images per forward.
    """

    name = "hpsv2"
    filename = "HPS_v2_compressed.pt"

    def __init__(
        self,
        checkpoint: str | None = None,
        model_name: str = "ViT-H-14",
        device=None,
        dtype="float32",
        batch_size: int = 16,
    ):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        path = self._resolve(checkpoint)
        self.model, self.tokenizer = load_hps_model(self.name, path, model_name)
        self.image_size = image_size_of(self.model.visual.image_size)
        self._freeze()

    def _resolve(self, checkpoint: str | None) -> str:
        """None -> the official hub file; a hub id -> its ``filename``; a directory -> the
        ``filename`` in it; else a local file."""
        if checkpoint == RANDOM:
            print(
                f"{self.name}: random weights (checkpoint='random'): speed and memory only, "
                "scores mean nothing"
            )
            return RANDOM
        if checkpoint is None or looks_like_hub_id(str(checkpoint)):
            return hub_file(self.name, checkpoint or HUB_REPO, self.filename)
        path = os.path.expanduser(str(checkpoint))
        if os.path.isdir(path):
            path = os.path.join(path, self.filename)
        fetch = (
            f"Download it with `hf download {HUB_REPO} {self.filename} --local-dir DIR` "
            f"and pass checkpoint='DIR/{self.filename}' (or checkpoint=None to use the hub cache)."
        )
        return local_file(self.name, path, fetch)

    def _modules(self):
        return [self.model]

    def preprocess(self, pixels: torch.Tensor) -> torch.Tensor:
        return normalize(resize_longest_and_pad(pixels, self.image_size, fill=0.0))

    def features(self, pixels: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Unnormalised image and text features (B, D) of one chunk."""
        image = self.model.encode_image(self.preprocess(pixels).to(self.dtype))
        tokens = self.tokenizer(prompts).to(self.device)
        return image, self.model.encode_text(tokens)

    def _score(self, pixels, prompts):
        image, text = self.features(pixels, prompts)
        return {self.name: cosine(image, text)}


class HPSv21(HPSv2):
    """HPSv2.1: same model and score, weights ``HPS_v2.1_compressed.pt`` (key ``hpsv21``)."""

    name = "hpsv21"
    filename = "HPS_v2.1_compressed.pt"

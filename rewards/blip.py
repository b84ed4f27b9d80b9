"""BLIP's image and text encoders in plain PyTorch (Li et al. 2022, "BLIP: Bootstrapping
Language-Image Pre-training for Unified Vision-Language Understanding and Generation").

ImageReward (Xu et al. 2023) scores an image with BLIP's ViT and BLIP's image-grounded text
encoder, a BERT whose every layer adds cross-attention to the image tokens. The reference code
(github.com/salesforce/BLIP, models/vit.py and models/med.py, copied into THUDM/ImageReward as
ImageReward/models/BLIP/) needs timm 0.6, fairscale and transformers helpers that transformers 5
removed, so the two encoders are re-implemented here.

Parameter names follow vit.py (timm-style: ``patch_embed.proj``, ``blocks.N.attn.qkv``) and med.py
(BERT-style: ``encoder.layer.N.crossattention.self.key``), so a BLIP checkpoint's sub-state-dicts load
with a prefix rename and nothing else. Dropout is left out: these encoders only ever score (the
reward is frozen), and med.py's and vit.py's dropouts are identities in eval mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ViTConfig:
    """BLIP ViT shape; the defaults are ``create_vit('large', 224)`` (ViT-L/16 at 224 px)."""

    image_size: int = 224
    patch_size: int = 16
    width: int = 1024
    depth: int = 24
    heads: int = 16
    mlp_ratio: float = 4.0

    def __post_init__(self):
        if self.image_size % self.patch_size:
            raise ValueError(
                f"vision_config: image_size {self.image_size} is not a multiple of patch {self.patch_size}"
            )
        if self.width % self.heads:
            raise ValueError(f"vision_config: width {self.width} is not divisible by heads {self.heads}")


@dataclass(frozen=True)
class TextConfig:
    """The med.py BERT fields ImageReward uses; ``encoder_width`` is the ViT width."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    layer_norm_eps: float
    encoder_width: int

    @classmethod
    def from_med_config(cls, med: dict, encoder_width: int, source: str = "med_config") -> TextConfig:
        """Read BLIP's ``med_config.json``. Like BLIP_Pretrain, the file's own ``encoder_width``
        (768 in the shipped file) is overridden by the vision width (1024 for ViT-L)."""
        required = [
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
        ]
        missing = [k for k in required if k not in med]
        if missing:
            raise ValueError(f"{source}: missing keys {missing}")
        # Only what med.py does for ImageReward is implemented; anything else would score wrongly.
        if med.get("hidden_act", "gelu") != "gelu":
            raise ValueError(
                f"{source}: hidden_act {med['hidden_act']!r} is not supported (BLIP uses 'gelu')"
            )
        if med.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{source}: only absolute position embeddings are supported")
        if not med.get("add_cross_attention", False):
            raise ValueError(
                f"{source}: add_cross_attention must be true (ImageReward's text encoder attends "
                "to the image)"
            )
        if med["hidden_size"] % med["num_attention_heads"]:
            raise ValueError(f"{source}: hidden_size is not divisible by num_attention_heads")
        return cls(
            **{k: int(med[k]) for k in required},
            layer_norm_eps=float(med.get("layer_norm_eps", 1e-12)),
            encoder_width=int(encoder_width),
        )


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, L, n*d) -> (B, n, L, d)."""
    return x.unflatten(-1, (n, -1)).transpose(1, 2)


# ---------------------------------------------------------------- vision (BLIP models/vit.py)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.proj = nn.Conv2d(3, cfg.width, cfg.patch_size, stride=cfg.patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class ViTAttention(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)  # BLIP's ViT has qkv_bias=True
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # qkv is laid out [q | k | v], each split into heads: timm's reshape(B, N, 3, H, d)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)  # scale head_dim ** -0.5, as vit.py
        return self.proj(out.transpose(1, 2).flatten(2))


class ViTMlp(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        hidden = int(cfg.width * cfg.mlp_ratio)
        self.fc1 = nn.Linear(cfg.width, hidden)
        self.fc2 = nn.Linear(hidden, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # nn.GELU: the exact (erf) form


class ViTBlock(nn.Module):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        # vit.py: norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.norm1 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.attn = ViTAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.width, eps=1e-6)
        self.mlp = ViTMlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """Pre-norm ViT; returns the final-normed tokens (B, 1 + patches, width), CLS first."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.cfg = cfg
        grid = cfg.image_size // cfg.patch_size
        self.patch_embed = PatchEmbed(cfg)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.width))
        self.pos_embed = nn.Parameter(torch.zeros(1, grid * grid + 1, cfg.width))
        self.blocks = nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width, eps=1e-6)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        size = self.cfg.image_size
        if pixels.shape[-2:] != (size, size):  # timm's PatchEmbed asserts the same
            raise ValueError(f"BLIP ViT expects {size}x{size} input, got {tuple(pixels.shape[-2:])}")
        x = self.patch_embed(pixels)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


# ------------------------------------------------------ text (BLIP models/med.py, BertModel)


class BertEmbeddings(nn.Module):
    """Word + absolute position embeddings. med.py has no token-type embedding (unlike BERT)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    """Queries from the text; keys/values from the text (self) or the image tokens (cross)."""

    def __init__(self, cfg: TextConfig, kv_width: int):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(kv_width, cfg.hidden_size)
        self.value = nn.Linear(kv_width, cfg.hidden_size)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q = _heads(self.query(x), self.heads)
        k = _heads(self.key(context), self.heads)
        v = _heads(self.value(context), self.heads)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)  # post-norm, as BERT


class BertAttention(nn.Module):
    def __init__(self, cfg: TextConfig, kv_width: int):
        super().__init__()
        # the submodule is literally named "self" in med.py, hence keys like attention.self.query
        self.self = BertSelfAttention(cfg, kv_width)
        self.output = BertSelfOutput(cfg)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, context, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))  # med_config hidden_act "gelu" is the exact (erf) GELU


class BertOutput(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertLayer(nn.Module):
    """Bidirectional self-attention, then cross-attention to the image, then the feed-forward
    (med.py BertLayer in mode='multimodal', the default BertModel.forward uses)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.attention = BertAttention(cfg, cfg.hidden_size)
        self.crossattention = BertAttention(cfg, cfg.encoder_width)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, x, mask)
        # every image token is valid (ImageReward passes an all-ones encoder_attention_mask)
        x = self.crossattention(x, image, None)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertTextEncoder(nn.Module):
    """med.py ``BertModel(config, add_pooling_layer=False)``: returns last_hidden_state (B, L, hidden)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image: torch.Tensor
    ) -> torch.Tensor:
        if input_ids.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(
                f"text of {input_ids.shape[1]} tokens exceeds {self.cfg.max_position_embeddings} positions"
            )
        x = self.embeddings(input_ids)
        # med.py adds -10000 to padded keys; after softmax that weight is exactly 0 in fp32/bf16,
        # the same as a boolean mask. Bidirectional: ImageReward calls the encoder with is_decoder=False.
        mask = attention_mask.bool()[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, mask, image)
        return x

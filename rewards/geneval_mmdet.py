"""GenEval's own detector weights: mmdetection 2.x's Mask2Former ``.pth`` read into transformers.

GenEval and flow_grpo's reward server detect with mmdetection 2.x's checkpoint :data:`URL`;
:mod:`rewards.geneval_mask2former` runs that architecture through transformers'
``Mask2FormerForUniversalSegmentation``. This module loads mmdetection's file itself (a
``state_dict`` in mmdet 2.x module names, and ``meta``) into that model by a key map, so no
Detectron2/hub weights are needed. The config is read off tensor shapes; the rest follows
mmdetection's config (the constants below).

References (mmdet 2.x layout; 3.x renamed the modules): open-mmlab/mmdetection 2.x
``mmdet/models/backbones/swin.py`` @2a643e47, ``mmdet/models/utils/ckpt_convert.py`` @47d10337,
``mmdet/models/plugins/msdeformattn_pixel_decoder.py`` @3e269315,
``mmdet/models/dense_heads/mask2former_head.py`` @c88cd826, ``configs/mask2former/``
``mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco.py`` -> ``..._swin-t-...`` ->
``mask2former_r50_lsj_8x2_50e_coco(-panoptic).py`` @8018c862; open-mmlab/mmcv v1.7.2
``mmcv/cnn/bricks/transformer.py`` (PatchMerging, MultiheadAttention, FFN, BaseTransformerLayer)
and ``mmcv/ops/multi_scale_deform_attn.py`` (same sampling-offset / attention-weight layout
(heads, levels, points, xy) as transformers'); transformers 5.x ``modeling_mask2former.py``,
``modeling_swin.py`` and, at huggingface/transformers@6af02b5d,
``convert_mask2former_original_pytorch_checkpoint_to_pytorch.py`` (Detectron2's names mirror
mmdet's modules) and ``upernet/convert_swin_upernet_to_pytorch.py`` (mmseg's Swin = mmdet's).

Beyond renaming, and why:

* Swin's ``qkv``: WindowMSA reads its one Linear as (3, heads, C/heads), rows [q; k; v];
  transformers' SwinAttention has separate q/k/v projections: split in thirds. Likewise the
  decoder self-attention's nn.MultiheadAttention ``in_proj`` -> Mask2FormerAttention's q/k/v
  (the cross-attention is an nn.MultiheadAttention on both sides: copied).
* PatchMerging: mmdet gathers each 2x2 patch with ``nn.Unfold``: channel c * 4 + k for offsets
  k = (row, col) (0,0), (0,1), (1,0), (1,1); Swin and transformers concatenate blocks
  [x0, x1, x2, x3] = (0,0), (1,0), (0,1), (1,1): channel block * C + c. mmdet's
  ``swin_converter`` (``correct_unfold_*_order``) maps Swin's order to mmdet's;
  :func:`_unfold_to_swin` is its inverse, for the reduction's input and the norm before it.
* ``relative_position_index``: an mmdet buffer that transformers rebuilds: checked to be Swin's
  index (so the bias table is copied as is) and dropped.
* indices: ``backbone.norm{i}`` -> ``hidden_states_norms.stage{i+1}``; ``lateral_convs.{i}`` /
  ``output_convs.{i}`` (applied to backbone level i) -> ``adapter_{i+1}`` / ``layer_{i+1}``;
  ``mask_embed.{0,2,4}`` -> ``mask_embedder.{0,1,2}``. Both order the 3 encoder levels from low
  to high resolution (input convs, level embeddings, the decoder's level cycle).

mmdetection 3.x's re-release of the same weights (the file GenEval's ``download_models.sh``
fetches) names each layer's parts as attributes; :func:`from_mmdet3` reads them as 2.x's.

Two transformers tensors have no mmdet counterpart and keep their initial values: SwinModel's
final ``layernorm`` (SwinBackbone never applies it) and the loss's ``criterion.empty_weight``.
"""

from __future__ import annotations

import math
import re

import torch

from rewards.errors import UserError, one_line

URL = (
    "https://download.openmmlab.com/mmdetection/v2.0/mask2former/mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco/"
    "mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco_20220504_001756-743b7d99.pth"
)
# mmdetection's config where no tensor shape tells (mask2former_r50_lsj_8x2_50e_coco-panoptic.py):
# num_heads of the decoder's MultiheadAttention and of the pixel decoder's deformable attention
# (also num_levels / num_points, which transformers hard-codes as 3 / 4), the pixel decoder's
# strides; Swin's drop_path_rate 0.3 and pretrain_img_size 224 (swin-t config, swin.py).
HEADS, LEVELS, POINTS = 8, 3, 4
STRIDES = (4, 8, 16, 32)
DROP_PATH, PRETRAIN_SIZE = 0.3, 224

BACKBONE, PIXEL = "model.pixel_level_module.encoder.", "model.pixel_level_module.decoder."
DECODER = "model.transformer_module."
SWIN = BACKBONE + "swin."
TRANSFORMERS_ONLY = (SWIN + "layernorm.", "criterion.")
_EXPECTED = f"expected mmdetection 2.x's Swin Mask2Former .pth, e.g. {URL}"


class MmdetCheckpointError(UserError, ValueError):
    """A file that is not (or not entirely) mmdetection 2.x's Swin Mask2Former checkpoint."""


def _unfold_to_swin(x: torch.Tensor) -> torch.Tensor:
    """Last dim 4C from nn.Unfold's order (c * 4 + k) to Swin's (block * C + c)."""
    *lead, channels = x.shape
    # Swin's x0..x3, at (row, col) offsets (0,0), (1,0), (0,1), (1,1), are unfold's k = 2 row + col:
    # 0, 2, 1, 3 (a self-inverse permutation)
    x = x.reshape(*lead, channels // 4, 4)[..., [0, 2, 1, 3]]
    return x.transpose(-1, -2).reshape(*lead, channels)


def swin_relative_position_index(window: int) -> torch.Tensor:
    """Original Swin's (window², window²) index into the (2w-1)² relative-bias table."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    rel = coords[:, :, None] - coords[:, None, :] + window - 1
    return rel[0] * (2 * window - 1) + rel[1]


# mmdet 2.x name -> transformers name: {i}, {j} indices, {n} = i + 1, {p} weight or bias; "{qkv}" marks
# a fused [q; k; v] Linear split in thirds; None: a buffer transformers rebuilds (checked, dropped).
_B, _S = "backbone.stages.{i}.blocks.{j}.", SWIN + "encoder.layers.{i}.blocks.{j}."
_PD, _TD = "panoptic_head.pixel_decoder.", "panoptic_head.transformer_decoder."
_E, _HE = _PD + "encoder.layers.{i}.", PIXEL + "encoder.layers.{i}."
_D, _HD = _TD + "layers.{i}.", DECODER + "decoder.layers.{i}."
_MASK = DECODER + "decoder.mask_predictor.mask_embedder."
_DS, _HDS = "backbone.stages.{i}.downsample.", SWIN + "encoder.layers.{i}.downsample."
_TABLE = "relative_position_bias_table"
KEYS = {
    # swin.py: PatchEmbed; SwinBlock(norm1, attn=ShiftWindowMSA(w_msa=WindowMSA), norm2, ffn); PatchMerging
    "backbone.patch_embed.projection.{p}": SWIN + "embeddings.patch_embeddings.projection.{p}",
    "backbone.patch_embed.norm.{p}": SWIN + "embeddings.norm.{p}",
    _B + "norm1.{p}": _S + "layernorm_before.{p}",
    _B + "attn.w_msa.qkv.{p}": _S + "attention.{qkv}_proj.{p}",
    _B + "attn.w_msa.proj.{p}": _S + "attention.o_proj.{p}",
    _B + "attn.w_msa." + _TABLE: _S + "attention.relative_position_bias." + _TABLE,
    _B + "attn.w_msa.relative_position_index": None,
    _B + "norm2.{p}": _S + "layernorm_after.{p}",
    _B + "ffn.layers.0.0.{p}": _S + "mlp.fc1.{p}",  # mmcv FFN.layers: [[fc1, act, dropout], fc2, dropout]
    _B + "ffn.layers.1.{p}": _S + "mlp.fc2.{p}",
    _DS + "reduction.weight": (_HDS + "reduction.weight", _unfold_to_swin),  # mmcv PatchMerging
    _DS + "norm.{p}": (_HDS + "norm.{p}", _unfold_to_swin),
    "backbone.norm{i}.{p}": BACKBONE + "hidden_states_norms.stage{n}.{p}",
    # msdeformattn_pixel_decoder.py: ConvModule(conv, gn) is transformers' Sequential(Conv2d, GroupNorm);
    # encoder layers are BaseTransformerLayer(self_attn, norm, ffn, norm), norms numbered in that order
    _PD + "input_convs.{i}.conv.{p}": PIXEL + "input_projections.{i}.0.{p}",
    _PD + "input_convs.{i}.gn.{p}": PIXEL + "input_projections.{i}.1.{p}",
    _E + "attentions.0.sampling_offsets.{p}": _HE + "self_attn.sampling_offsets.{p}",
    _E + "attentions.0.attention_weights.{p}": _HE + "self_attn.attention_weights.{p}",
    _E + "attentions.0.value_proj.{p}": _HE + "self_attn.value_proj.{p}",
    _E + "attentions.0.output_proj.{p}": _HE + "self_attn.output_proj.{p}",
    _E + "norms.0.{p}": _HE + "self_attn_layer_norm.{p}",
    _E + "ffns.0.layers.0.0.{p}": _HE + "fc1.{p}",
    _E + "ffns.0.layers.1.{p}": _HE + "fc2.{p}",
    _E + "norms.1.{p}": _HE + "final_layer_norm.{p}",
    _PD + "level_encoding.weight": PIXEL + "level_embed",
    _PD + "lateral_convs.{i}.conv.{p}": PIXEL + "adapter_{n}.0.{p}",  # forward applies lateral_convs[i]
    _PD + "lateral_convs.{i}.gn.{p}": PIXEL + "adapter_{n}.1.{p}",  # to backbone level i, as adapter_{i+1}
    _PD + "output_convs.{i}.conv.{p}": PIXEL + "layer_{n}.0.{p}",
    _PD + "output_convs.{i}.gn.{p}": PIXEL + "layer_{n}.1.{p}",
    _PD + "mask_feature.{p}": PIXEL + "mask_projection.{p}",
    # mask2former_head.py: layers are (cross_attn, norm, self_attn, norm, ffn, norm)
    _D + "attentions.0.attn.in_proj_{p}": _HD + "cross_attn.in_proj_{p}",
    _D + "attentions.0.attn.out_proj.{p}": _HD + "cross_attn.out_proj.{p}",
    _D + "norms.0.{p}": _HD + "cross_attn_layer_norm.{p}",
    _D + "attentions.1.attn.in_proj_{p}": _HD + "self_attn.{qkv}_proj.{p}",
    _D + "attentions.1.attn.out_proj.{p}": _HD + "self_attn.out_proj.{p}",
    _D + "norms.1.{p}": _HD + "self_attn_layer_norm.{p}",
    _D + "ffns.0.layers.0.0.{p}": _HD + "fc1.{p}",
    _D + "ffns.0.layers.1.{p}": _HD + "fc2.{p}",
    _D + "norms.2.{p}": _HD + "final_layer_norm.{p}",
    _TD + "post_norm.{p}": DECODER + "decoder.layernorm.{p}",
    "panoptic_head.query_embed.weight": DECODER + "queries_embedder.weight",  # positional
    "panoptic_head.query_feat.weight": DECODER + "queries_features.weight",  # content
    "panoptic_head.level_embed.weight": DECODER + "level_embed.weight",
    "panoptic_head.cls_embed.{p}": "class_predictor.{p}",
    "panoptic_head.mask_embed.0.{p}": _MASK + "0.0.{p}",  # Sequential(Linear, ReLU, Linear, ReLU, Linear)
    "panoptic_head.mask_embed.2.{p}": _MASK + "1.0.{p}",
    "panoptic_head.mask_embed.4.{p}": _MASK + "2.0.{p}",
}


def _pattern(name: str) -> re.Pattern:
    regex = re.escape(name)
    for field, group in (("i", r"\d+"), ("j", r"\d+"), ("p", "weight|bias")):
        regex = regex.replace(re.escape("{" + field + "}"), f"(?P<{field}>{group})")
    return re.compile(regex)


_COMPILED = [(_pattern(name), target) for name, target in KEYS.items()]


# mmdetection 3.x's re-release of the same weights (GenEval's download_models.sh fetches
# mmdetection/v3.0/mask2former/..._20220504_001756-c9d0c4f2.pth) names each transformer
# layer's parts as attributes (DetrTransformerDecoderLayer / DeformableDetrTransformerEncoderLayer:
# self_attn, cross_attn, ffn, norms) where 2.x's BaseTransformerLayer lists them in
# operation order (attentions.0 = the first attention, ffns.0). The decoder runs cross_attn
# first in both (Mask2FormerTransformerDecoderLayer.forward), so cross_attn is 2.x's
# attentions.0 and self_attn its attentions.1; the encoder's one attention is attentions.0.
_MMDET3_RENAMES = (
    (re.compile(r"(panoptic_head\.transformer_decoder\.layers\.\d+\.)cross_attn\."), r"\1attentions.0."),
    (re.compile(r"(panoptic_head\.transformer_decoder\.layers\.\d+\.)self_attn\."), r"\1attentions.1."),
    (re.compile(r"(panoptic_head\.pixel_decoder\.encoder\.layers\.\d+\.)self_attn\."), r"\1attentions.0."),
    (
        re.compile(r"(panoptic_head\.(?:transformer_decoder|pixel_decoder\.encoder)\.layers\.\d+\.)ffn\."),
        r"\1ffns.0.",
    ),
)


def from_mmdet3(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An mmdetection 3.x state dict under 2.x's names (a 2.x one is returned as it is)."""
    out = {}
    for key, tensor in state.items():
        for pattern, replacement in _MMDET3_RENAMES:
            key = pattern.sub(replacement, key)
        out[key] = tensor
    return out


def mmdet_to_transformers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """mmdet 2.x (or 3.x) Mask2Former keys -> ``Mask2FormerForUniversalSegmentation.state_dict()`` keys."""
    out, unknown = {}, []
    for key, tensor in from_mmdet3(state).items():
        match = next(((m, target) for pattern, target in _COMPILED if (m := pattern.fullmatch(key))), None)
        if match is None:
            unknown.append(key)
            continue
        m, target = match
        if target is None:  # transformers rebuilds it, so only the table's layout must agree
            if not torch.equal(tensor.cpu(), swin_relative_position_index(math.isqrt(tensor.shape[0]))):
                raise MmdetCheckpointError(f"'{key}' is not Swin's relative position index")
            continue
        target, transform = target if isinstance(target, tuple) else (target, None)
        fields = m.groupdict() | ({"n": int(m["i"]) + 1} if "i" in m.groupdict() else {})
        if "{qkv}" in target:
            if tensor.shape[0] % 3:
                raise MmdetCheckpointError(f"'{key}' has {tensor.shape[0]} rows, not 3 equal q, k, v parts")
            out |= {target.format(qkv=w, **fields): t for w, t in zip("qkv", tensor.chunk(3))}
        else:
            out[target.format(**fields)] = transform(tensor) if transform else tensor
    if unknown:
        raise MmdetCheckpointError(
            f"{len(unknown)} checkpoint keys are not part of mmdetection 2.x's Swin Mask2Former, e.g. "
            f"{unknown[:3]}; {_EXPECTED}"
        )
    return out


def _get(state: dict, key: str) -> torch.Tensor:
    if key not in state:
        raise MmdetCheckpointError(
            f"not an mmdetection 2.x Swin Mask2Former checkpoint (no '{key}'); {_EXPECTED}"
        )
    return state[key]


def _count(state: dict, pattern: str) -> int:
    """How many distinct values the pattern's group takes over the keys (layers, blocks)."""
    return len({m[1] for key in state if (m := re.match(pattern, key))})


def _swin_config(state: dict):
    """The backbone's ``SwinConfig`` from mmdet's Swin tensors (depths, heads, window, widths)."""
    from transformers import SwinConfig

    proj = _get(state, "backbone.patch_embed.projection.weight")  # (embed_dim, 3, patch, patch)
    stages = max(_count(state, r"backbone\.stages\.(\d+)\."), 1)  # none: the error names stage 0's table
    tables = [_get(state, f"backbone.stages.{i}.blocks.0.attn.w_msa.{_TABLE}") for i in range(stages)]
    side = math.isqrt(tables[0].shape[0])  # the table has (2 * window - 1)² rows
    if side * side != tables[0].shape[0] or side % 2 == 0 or len({t.shape[0] for t in tables}) > 1:
        raise MmdetCheckpointError(
            f"relative position tables of {[len(t) for t in tables]} rows, not (2w-1)²"
        )
    ffn = _get(state, "backbone.stages.0.blocks.0.ffn.layers.0.0.weight")
    return SwinConfig(
        image_size=PRETRAIN_SIZE,
        patch_size=proj.shape[-1],
        num_channels=proj.shape[1],
        embed_dim=proj.shape[0],
        depths=[_count(state, rf"backbone\.stages\.{i}\.blocks\.(\d+)\.") for i in range(stages)],
        num_heads=[t.shape[1] for t in tables],
        window_size=(side + 1) // 2,
        mlp_ratio=ffn.shape[0] / proj.shape[0],
        qkv_bias="backbone.stages.0.blocks.0.attn.w_msa.qkv.bias" in state,
        hidden_act="gelu",  # mmdet SwinBlock's act_cfg GELU; norm_cfg LN, eps 1e-5 as transformers'
        drop_path_rate=DROP_PATH,
        use_absolute_embeddings=False,  # use_abs_pos_embed=False: its key would be unknown
        out_features=[f"stage{i + 1}" for i in range(stages)],  # out_indices=(0, 1, 2, 3)
    )


def mmdet_config(state: dict[str, torch.Tensor]):
    """The ``Mask2FormerConfig`` of an mmdet 2.x Swin Mask2Former state dict, from its shapes."""
    from transformers import Mask2FormerConfig

    swin = _swin_config(state)

    def rows(key: str) -> int:
        return _get(state, "panoptic_head." + key).shape[0]

    sampling = rows("pixel_decoder.encoder.layers.0.attentions.0.attention_weights.weight")
    if sampling != HEADS * LEVELS * POINTS:
        raise MmdetCheckpointError(
            f"the pixel decoder samples {sampling} points a query, not mmdet's {HEADS} heads x {LEVELS} "
            f"levels x {POINTS} points, which transformers' Mask2Former hard-codes"
        )
    queries = _get(state, "panoptic_head.query_feat.weight")  # (num_queries, decoder embed dims)
    return Mask2FormerConfig(
        backbone_config=swin,
        feature_size=rows("pixel_decoder.input_convs.0.conv.weight"),
        mask_feature_size=rows("pixel_decoder.mask_feature.weight"),
        hidden_dim=queries.shape[1],
        num_queries=queries.shape[0],
        num_labels=rows("cls_embed.weight") - 1,  # the last class is "no object"
        encoder_layers=_count(state, r"panoptic_head\.pixel_decoder\.encoder\.layers\.(\d+)\."),
        encoder_feedforward_dim=rows("pixel_decoder.encoder.layers.0.ffns.0.layers.0.0.weight"),
        # transformers counts the prediction from the queries before any layer as a layer
        decoder_layers=_count(state, r"panoptic_head\.transformer_decoder\.layers\.(\d+)\.") + 1,
        dim_feedforward=rows("transformer_decoder.layers.0.ffns.0.layers.0.0.weight"),
        num_attention_heads=HEADS,
        dropout=0.0,
        activation_function="relu",
        pre_norm=False,  # operation_order puts each norm after its block
        enforce_input_projection=False,  # decoder_input_projs are Identity (no keys) at equal widths
        common_stride=4,  # one FPN level below the 3 encoder levels, as mmdet's lateral_convs
        feature_strides=list(STRIDES),
        no_object_weight=0.1,  # loss_cls class_weight [1.0] * num_classes + [0.1]
    )


def _read(path) -> tuple[dict, dict]:
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as err:
        raise MmdetCheckpointError(f"no readable file at '{path}' ({one_line(err)}); download {URL}") from err
    except Exception as err:  # torch reports a non-checkpoint as UnpicklingError, KeyError, EOFError, ...
        refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        if refused:  # weights_only's allow-list: no code runs while reading an untrusted file
            raise MmdetCheckpointError(
                f"'{path}' holds a {refused[1]} object, which torch.load(weights_only=True) refuses; "
                "mmdetection's model-zoo files hold only tensors and plain metadata. If you trust the file, "
                "re-save its weights: torch.save({'state_dict': torch.load(path, weights_only=False)"
                "['state_dict']}, new_path)"
            ) from err
        raise MmdetCheckpointError(
            f"'{path}' is not a PyTorch checkpoint ({one_line(err, 120)}); {_EXPECTED}"
        ) from err
    if isinstance(ckpt, dict) and isinstance(ckpt.get("state_dict"), dict):
        return ckpt["state_dict"], ckpt.get("meta") or {}
    if isinstance(ckpt, dict) and ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        return ckpt, {}
    raise MmdetCheckpointError(
        f"'{path}' is not an mmdetection checkpoint (no 'state_dict' of tensors); {_EXPECTED}"
    )


def load_mmdet_mask2former(path):
    """mmdetection 2.x's Swin Mask2Former ``.pth`` (``{"state_dict", "meta"}`` or a bare state
    dict) as a ``Mask2FormerForUniversalSegmentation`` in eval mode, with meta's class names."""
    from transformers import Mask2FormerForUniversalSegmentation

    state, meta = _read(path)
    state = from_mmdet3(state)
    config = mmdet_config(state)
    meta = meta if isinstance(meta, dict) else {}
    classes = meta.get("CLASSES") or (meta.get("dataset_meta") or {}).get("classes")  # 2.x, 3.x
    if classes:
        if len(classes) != config.num_labels:
            raise MmdetCheckpointError(
                f"'{path}': meta names {len(classes)} CLASSES but its classifier has {config.num_labels}"
            )
        config.id2label = dict(enumerate(map(str, classes)))
        config.label2id = {name: i for i, name in config.id2label.items()}
    weights = mmdet_to_transformers(state)
    model = Mask2FormerForUniversalSegmentation(config)
    expected = model.state_dict()
    weights |= {k: v for k, v in expected.items() if k.startswith(TRANSFORMERS_ONLY) and k not in weights}
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(weights) & set(expected) if weights[k].shape != expected[k].shape)
    if missing or unexpected or wrong:
        found = [
            f"{len(keys)} {what} (e.g. {keys[:3]})"
            for keys, what in ((missing, "missing"), (unexpected, "unexpected"), (wrong, "of another shape"))
            if keys
        ]
        raise MmdetCheckpointError(
            f"'{path}' does not fill transformers' Mask2Former built from its own shapes: "
            f"{'; '.join(found)} parameters (transformers names); {_EXPECTED}"
        )
    model.load_state_dict(weights, strict=True)
    return model.eval()

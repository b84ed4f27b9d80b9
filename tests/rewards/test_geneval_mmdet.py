"""mmdetection 2.x's Mask2Former checkpoint read into transformers (rewards/geneval_mmdet.py): a
tiny random transformers Mask2Former, written out under mmdetection's own names and layouts
(transcribed below from mmdet 2.x / mmcv 1.x), loads back exactly; the two re-orderings agree with
mmdet's forward passes; bad files give one clear error."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig
from transformers.models.mask2former.modeling_mask2former import Mask2FormerAttention
from transformers.models.swin.modeling_swin import SwinAttention, SwinPatchMerging

from rewards.geneval_mmdet import MmdetCheckpointError, load_mmdet_mask2former, mmdet_to_transformers

CLASSES = ("person", "bicycle", "car", "motorcycle", "airplane")
S = "model.pixel_level_module.encoder.swin."
P, T = "model.pixel_level_module.decoder.", "model.transformer_module."


def tiny_config(num_labels: int = len(CLASSES)) -> Mask2FormerConfig:
    # what mmdet's config fixes is set as mmdet does (8 heads, drop path 0.3, GELU, relu FFNs, ...)
    swin = SwinConfig(
        embed_dim=16,
        depths=[2, 2, 2, 2],  # two blocks a stage: plain and shifted windows
        num_heads=[1, 2, 4, 8],
        window_size=3,
        mlp_ratio=3.0,
        drop_path_rate=0.3,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    return Mask2FormerConfig(
        backbone_config=swin,
        feature_size=32,
        mask_feature_size=32,
        hidden_dim=32,
        encoder_feedforward_dim=48,
        dim_feedforward=40,
        encoder_layers=2,
        decoder_layers=4,  # 3 mmdet layers: the 3 feature levels each once
        num_attention_heads=8,
        num_queries=6,
        num_labels=num_labels,
    )


def unfold_order(x: torch.Tensor) -> torch.Tensor:
    """mmdet/models/utils/ckpt_convert.py ``swin_converter`` (correct_unfold_reduction_order,
    correct_unfold_norm_order): Swin's 4C = blocks [x0, x1, x2, x3] -> channel c * 4 + k, k the
    nn.Unfold offsets (0,0), (0,1), (1,0), (1,1) = blocks 0, 2, 1, 3."""
    *lead, four_c = x.shape
    blocks = x.reshape(*lead, 4, four_c // 4)[..., [0, 2, 1, 3], :]
    return blocks.transpose(-1, -2).reshape(*lead, four_c)


def mmdet_relative_position_index(window: int) -> torch.Tensor:
    """mmdet/models/backbones/swin.py WindowMSA.__init__: double_step_seq, sum with its transpose, flip."""
    seq = (torch.arange(window)[:, None] * (2 * window - 1) + torch.arange(window)).reshape(1, -1)
    return (seq + seq.T).flip(1)


class _Names:
    """Collects mmdet-named tensors from transformers-named ones (``hf``)."""

    def __init__(self, hf: dict[str, torch.Tensor]):
        self.hf, self.out = hf, {}

    def wb(self, mmdet: str, name: str) -> None:
        for p in ("weight", "bias"):
            self.out[f"{mmdet}.{p}"] = self.hf[f"{name}.{p}"]

    def fused(self, mmdet: str, name: str) -> None:  # one Linear whose rows are [q; k; v]
        for p in ("weight", "bias"):
            self.out[mmdet.format(p)] = torch.cat([self.hf[f"{name}.{x}_proj.{p}"] for x in "qkv"])


def to_mmdet(hf: dict[str, torch.Tensor], config: Mask2FormerConfig) -> dict[str, torch.Tensor]:
    """The weights under mmdet 2.x's names: swin.py (SwinTransformer, SwinBlock, WindowMSA; PatchMerging
    from mmcv's bricks), msdeformattn_pixel_decoder.py, mask2former_head.py; mmcv 1.x FFN is
    Sequential(Sequential(fc1, act, drop), fc2, drop), ConvModule holds conv and gn."""
    names = _Names(hf)
    _swin_names(names, config.backbone_config)
    _pixel_decoder_names(names, config)
    _decoder_names(names, config)
    return names.out


def _swin_names(n: _Names, swin) -> None:
    n.wb("backbone.patch_embed.projection", S + "embeddings.patch_embeddings.projection")
    n.wb("backbone.patch_embed.norm", S + "embeddings.norm")
    for i, depth in enumerate(swin.depths):
        for j in range(depth):
            mm, tr = f"backbone.stages.{i}.blocks.{j}.", f"{S}encoder.layers.{i}.blocks.{j}."
            n.wb(mm + "norm1", tr + "layernorm_before")
            n.fused(mm + "attn.w_msa.qkv.{}", tr + "attention")
            n.wb(mm + "attn.w_msa.proj", tr + "attention.o_proj")
            table = tr + "attention.relative_position_bias.relative_position_bias_table"
            n.out[mm + "attn.w_msa.relative_position_bias_table"] = n.hf[table]
            n.out[mm + "attn.w_msa.relative_position_index"] = mmdet_relative_position_index(swin.window_size)
            n.wb(mm + "norm2", tr + "layernorm_after")
            n.wb(mm + "ffn.layers.0.0", tr + "mlp.fc1")
            n.wb(mm + "ffn.layers.1", tr + "mlp.fc2")
        if i < len(swin.depths) - 1:
            tr, mm = f"{S}encoder.layers.{i}.downsample.", f"backbone.stages.{i}.downsample."
            n.out[mm + "reduction.weight"] = unfold_order(n.hf[tr + "reduction.weight"])
            for p in ("weight", "bias"):
                n.out[f"{mm}norm.{p}"] = unfold_order(n.hf[f"{tr}norm.{p}"])
        n.wb(f"backbone.norm{i}", f"model.pixel_level_module.encoder.hidden_states_norms.stage{i + 1}")


def _pixel_decoder_names(n: _Names, config: Mask2FormerConfig) -> None:
    pd = "panoptic_head.pixel_decoder."
    for i in range(3):  # from low to high resolution on both sides
        n.wb(f"{pd}input_convs.{i}.conv", f"{P}input_projections.{i}.0")
        n.wb(f"{pd}input_convs.{i}.gn", f"{P}input_projections.{i}.1")
    for k in range(config.encoder_layers):  # operation_order (self_attn, norm, ffn, norm)
        mm, tr = f"{pd}encoder.layers.{k}.", f"{P}encoder.layers.{k}."
        for name in ("sampling_offsets", "attention_weights", "value_proj", "output_proj"):
            n.wb(f"{mm}attentions.0.{name}", f"{tr}self_attn.{name}")
        n.wb(mm + "norms.0", tr + "self_attn_layer_norm")
        n.wb(mm + "ffns.0.layers.0.0", tr + "fc1")
        n.wb(mm + "ffns.0.layers.1", tr + "fc2")
        n.wb(mm + "norms.1", tr + "final_layer_norm")
    n.out[pd + "level_encoding.weight"] = n.hf[P + "level_embed"]
    n.out[pd + "lateral_convs.0.conv.weight"] = n.hf[P + "adapter_1.0.weight"]  # no bias under GN
    n.wb(pd + "lateral_convs.0.gn", P + "adapter_1.1")
    n.out[pd + "output_convs.0.conv.weight"] = n.hf[P + "layer_1.0.weight"]
    n.wb(pd + "output_convs.0.gn", P + "layer_1.1")
    n.wb(pd + "mask_feature", P + "mask_projection")


def _decoder_names(n: _Names, config: Mask2FormerConfig) -> None:
    td = "panoptic_head.transformer_decoder."
    for i in range(config.decoder_layers - 1):  # (cross_attn, norm, self_attn, norm, ffn, norm)
        mm, tr = f"{td}layers.{i}.", f"{T}decoder.layers.{i}."
        for p in ("weight", "bias"):
            n.out[f"{mm}attentions.0.attn.in_proj_{p}"] = n.hf[f"{tr}cross_attn.in_proj_{p}"]
        n.wb(mm + "attentions.0.attn.out_proj", tr + "cross_attn.out_proj")
        n.fused(mm + "attentions.1.attn.in_proj_{}", tr + "self_attn")
        n.wb(mm + "attentions.1.attn.out_proj", tr + "self_attn.out_proj")
        for k, name in enumerate(("cross_attn_layer_norm", "self_attn_layer_norm", "final_layer_norm")):
            n.wb(f"{mm}norms.{k}", tr + name)
        n.wb(mm + "ffns.0.layers.0.0", tr + "fc1")
        n.wb(mm + "ffns.0.layers.1", tr + "fc2")
    n.wb(td + "post_norm", T + "decoder.layernorm")
    n.out["panoptic_head.query_embed.weight"] = n.hf[T + "queries_embedder.weight"]
    n.out["panoptic_head.query_feat.weight"] = n.hf[T + "queries_features.weight"]
    n.out["panoptic_head.level_embed.weight"] = n.hf[T + "level_embed.weight"]
    n.wb("panoptic_head.cls_embed", "class_predictor")
    for k in range(3):  # mask_embed = Sequential(Linear, ReLU, Linear, ReLU, Linear)
        n.wb(f"panoptic_head.mask_embed.{2 * k}", f"{T}decoder.mask_predictor.mask_embedder.{k}.0")


@pytest.fixture(scope="module")
def source() -> Mask2FormerForUniversalSegmentation:
    torch.manual_seed(0)
    model = Mask2FormerForUniversalSegmentation(tiny_config()).eval()
    with torch.no_grad():
        for p in model.parameters():  # no zero or constant initialisation may hide a swap
            p.copy_(torch.randn_like(p) * 0.3)
        # mmdet has no SwinModel final norm (SwinBackbone never applies it): the loader keeps the init
        model.model.pixel_level_module.encoder.swin.layernorm.reset_parameters()
    return model


@pytest.fixture(scope="module")
def saved(source, tmp_path_factory):
    path = tmp_path_factory.mktemp("mmdet") / "mask2former.pth"
    meta = {"mmdet_version": "2.25.0", "CLASSES": CLASSES, "epoch": 50, "config": "model = dict(...)"}
    torch.save({"meta": meta, "state_dict": to_mmdet(source.state_dict(), source.config)}, path)
    return path


@pytest.fixture(scope="module")
def loaded(saved) -> Mask2FormerForUniversalSegmentation:
    return load_mmdet_mask2former(saved)


def test_the_checkpoint_loads_back_to_the_same_weights(source, loaded):
    expected, got = source.state_dict(), loaded.state_dict()
    assert got.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []
    assert not loaded.training


def test_the_config_is_read_off_the_shapes(source, loaded):
    def fields(config):
        out = json.loads(config.to_json_string())
        return {k: v for k, v in out.items() if k not in ("id2label", "label2id")}

    assert fields(loaded.config) == fields(source.config)
    assert loaded.config.id2label == dict(enumerate(CLASSES))  # from meta["CLASSES"]


def test_the_loaded_model_predicts_as_the_source(source, loaded):
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = source(pixel_values=x), loaded(pixel_values=x)
    assert got.class_queries_logits.shape == (2, 6, len(CLASSES) + 1)
    assert torch.equal(got.class_queries_logits, want.class_queries_logits)
    assert torch.equal(got.masks_queries_logits, want.masks_queries_logits)


def test_a_bare_state_dict_loads_too(source, tmp_path):
    torch.save(to_mmdet(source.state_dict(), source.config), tmp_path / "bare.pth")
    model = load_mmdet_mask2former(tmp_path / "bare.pth")
    assert torch.equal(model.class_predictor.weight, source.class_predictor.weight)


def test_patch_merging_weights_follow_mmdets_unfold():
    """mmdet 2.x's PatchMerging.forward (mmdet/models/utils/transformer.py, as mmcv 1.x's bricks):
    (B, HW, C) -> (B, C, H, W) -> nn.Unfold(2, stride 2) -> (B, HW/4, 4C) -> norm -> reduction."""
    torch.manual_seed(1)
    dim, h, w = 8, 6, 10
    prefix = "backbone.stages.0.downsample."
    mmdet = {prefix + "reduction.weight": torch.randn(2 * dim, 4 * dim, dtype=torch.float64)}
    mmdet |= {prefix + f"norm.{p}": torch.randn(4 * dim, dtype=torch.float64) for p in ("weight", "bias")}
    x = torch.randn(2, h * w, dim, dtype=torch.float64)
    unfolded = nn.Unfold(kernel_size=2, stride=2)(x.view(2, h, w, dim).permute(0, 3, 1, 2)).transpose(1, 2)
    normed = nn.functional.layer_norm(
        unfolded, (4 * dim,), mmdet[prefix + "norm.weight"], mmdet[prefix + "norm.bias"]
    )
    want = normed @ mmdet[prefix + "reduction.weight"].T
    merging = SwinPatchMerging(dim).double()
    merging.load_state_dict({k.split("downsample.")[1]: v for k, v in mmdet_to_transformers(mmdet).items()})
    with torch.no_grad():
        torch.testing.assert_close(merging(x, (h, w)), want, atol=1e-6, rtol=0)
        merging.load_state_dict({k.split("downsample.")[1]: v for k, v in mmdet.items()})
        assert not torch.allclose(merging(x, (h, w)), want, atol=1e-2)  # unconverted: another order


def test_fused_qkv_follows_mmdets_window_attention():
    """mmdet/models/backbones/swin.py WindowMSA.forward: qkv(x).reshape(B, N, 3, heads, C // heads),
    q scaled by head_dim ** -0.5, plus the relative position bias, softmax, proj."""
    torch.manual_seed(2)
    dim, heads, window, windows = 12, 3, 3, 5
    n, r = window * window, lambda *shape: torch.randn(*shape, dtype=torch.float64)
    table, index = r((2 * window - 1) ** 2, heads), mmdet_relative_position_index(window)
    mmdet = {
        "qkv.weight": r(3 * dim, dim),
        "qkv.bias": r(3 * dim),
        "proj.weight": r(dim, dim),
        "proj.bias": r(dim),
    }
    mmdet |= {"relative_position_bias_table": table, "relative_position_index": index}
    x = r(windows, n, dim)
    qkv = x @ mmdet["qkv.weight"].T + mmdet["qkv.bias"]
    q, k, v = qkv.reshape(windows, n, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
    bias = table[index.view(-1)].view(n, n, heads).permute(2, 0, 1)
    out = ((q * (dim // heads) ** -0.5) @ k.transpose(-2, -1) + bias).softmax(-1) @ v
    want = out.transpose(1, 2).reshape(windows, n, dim) @ mmdet["proj.weight"].T + mmdet["proj.bias"]
    prefix = "backbone.stages.0.blocks.0.attn.w_msa."
    converted = mmdet_to_transformers({prefix + k: v for k, v in mmdet.items()})
    attention = SwinAttention(SwinConfig(attn_implementation="sdpa"), dim, heads, window).double().eval()
    attention.load_state_dict({k.split(".attention.")[1]: v for k, v in converted.items()})
    with torch.no_grad():
        for name, part in zip(("q_proj", "k_proj", "v_proj"), (q, k, v)):
            got = getattr(attention, name)(x).view(windows, n, heads, -1).transpose(1, 2)
            torch.testing.assert_close(got, part, atol=1e-6, rtol=0)
        torch.testing.assert_close(attention(x)[0], want, atol=1e-6, rtol=0)


def test_decoder_self_attention_in_proj_follows_nn_multihead_attention():
    """mmcv 1.x MultiheadAttention for 'self_attn': nn.MultiheadAttention(query + pos, key + pos, query)."""
    torch.manual_seed(4)
    mha = nn.MultiheadAttention(32, 8).double().eval()
    hidden, pos = torch.randn(6, 2, 32, dtype=torch.float64), torch.randn(6, 2, 32, dtype=torch.float64)
    prefix = "panoptic_head.transformer_decoder.layers.0.attentions.1.attn."
    converted = mmdet_to_transformers({prefix + k: v for k, v in mha.state_dict().items()})
    attention = Mask2FormerAttention(32, 8, is_decoder=True).double().eval()
    attention.load_state_dict({k.split(".self_attn.")[1]: v for k, v in converted.items()})
    with torch.no_grad():
        want = mha(hidden + pos, hidden + pos, hidden)[0]
        torch.testing.assert_close(attention(hidden, position_embeddings=pos)[0], want, atol=1e-6, rtol=0)


class Opaque:
    """Pickled as a class instance: weights_only loading refuses it."""


def _edited(saved, tmp_path, edit):
    ckpt = torch.load(saved, weights_only=True)
    edit(ckpt["state_dict"])
    torch.save(ckpt, tmp_path / "edited.pth")
    return tmp_path / "edited.pth"


def test_an_unknown_key_is_named(saved, tmp_path):
    path = _edited(saved, tmp_path, lambda sd: sd.update({"panoptic_head.extra.weight": torch.zeros(2)}))
    with pytest.raises(
        MmdetCheckpointError, match=r"not part of mmdetection 2\.x.*'panoptic_head\.extra\.weight'"
    ):
        load_mmdet_mask2former(path)


def test_a_missing_key_is_named(saved, tmp_path):
    path = _edited(saved, tmp_path, lambda sd: sd.pop("backbone.stages.1.blocks.0.norm2.bias"))
    with pytest.raises(
        MmdetCheckpointError, match=r"1 missing \(e\.g\. \[.*layers\.1\.blocks\.0\.layernorm_after\.bias"
    ):
        load_mmdet_mask2former(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"plain text, not a checkpoint", "is not a PyTorch checkpoint"),
        ({"meta": {"hook": Opaque()}, "state_dict": {}}, r"Opaque object, which torch\.load\(weights_only"),
        ({"model": [1, 2]}, "is not an mmdetection checkpoint"),
        ({"state_dict": {"fc.weight": torch.zeros(2)}}, r"no 'backbone\.patch_embed\.projection\.weight'"),
    ],
)
def test_a_file_that_is_not_the_checkpoint_gives_one_clear_error(tmp_path, content, message):
    path = tmp_path / "file.pth"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(ValueError, match=message) as err:
        load_mmdet_mask2former(path)
    assert isinstance(err.value, MmdetCheckpointError) and "\n" not in str(err.value)


def test_genevals_detector_defaults_to_this_checkpoint_fetched_once_from_its_url(tmp_path, monkeypatch):
    """The geneval reward's default detector is mmdetection's file (issue 60, item 3): given
    as a URL (here a loopback server) it is downloaded once into torch.hub's cache and runs
    as the model it holds; the preflight lists it as a download."""
    import functools
    import http.server
    import threading

    from rewards import geneval_mmdet
    from rewards.geneval import GenEval
    from rewards.geneval_mask2former import Mask2FormerDetector
    from rewards.geneval_models import build_detector
    from rewards.geneval_rules import COCO_CLASSES
    from rewards.needs import reward_needs

    assert GenEval.default_detector == geneval_mmdet.URL
    torch.manual_seed(1)
    coco = Mask2FormerForUniversalSegmentation(tiny_config(len(COCO_CLASSES))).eval()
    (tmp_path / "www").mkdir()
    torch.save({"state_dict": to_mmdet(coco.state_dict(), coco.config)}, tmp_path / "www" / "m2f.pth")
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "www"))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/m2f.pth"
    try:
        detector = build_detector(url, torch.device("cpu"), torch.float32)
    finally:
        httpd.shutdown()
    assert (tmp_path / "hub" / "checkpoints" / "m2f.pth").is_file()
    x = torch.rand(2, 3, 40, 48, generator=torch.Generator().manual_seed(2))
    want = Mask2FormerDetector("source", torch.device("cpu"), torch.float32, model=coco)(x, ["dog", "cat"])
    got = detector(x, ["dog", "cat"])
    assert [{c: [f.box for f in fs] for c, fs in d.items()} for d in got] == [
        {c: [f.box for f in fs] for c, fs in d.items()} for d in want
    ]
    (need,) = [n for n in reward_needs("geneval", {"clip": "/c"}) if n["what"] == "geneval detector"]
    assert need["download_url"] == geneval_mmdet.URL and need["path"].endswith(
        geneval_mmdet.URL.rsplit("/")[-1]
    )


def test_mmdetection_3x_names_of_the_same_weights_load_alike(source, tmp_path):
    """GenEval's download script fetches mmdetection 3.x's re-release of the checkpoint: each
    layer's parts are attributes there (mmdet 3.x DetrTransformerDecoderLayer: self_attn,
    cross_attn, ffn, norms; DeformableDetrTransformerEncoderLayer: self_attn, ffn, norms),
    the decoder's cross_attn running first as 2.x's attentions.0; classes in dataset_meta."""
    import re

    def to_3x(key: str) -> str:
        key = re.sub(r"(transformer_decoder\.layers\.\d+\.)attentions\.0\.", r"\1cross_attn.", key)
        key = re.sub(r"(transformer_decoder\.layers\.\d+\.)attentions\.1\.", r"\1self_attn.", key)
        key = re.sub(r"(encoder\.layers\.\d+\.)attentions\.0\.", r"\1self_attn.", key)
        return re.sub(r"(layers\.\d+\.)ffns\.0\.", r"\1ffn.", key)

    state = {to_3x(k): v for k, v in to_mmdet(source.state_dict(), source.config).items()}
    assert any(".cross_attn.attn.in_proj_weight" in k for k in state) and not any(
        ".ffns." in k for k in state
    )
    path = tmp_path / "v3.pth"
    torch.save({"meta": {"dataset_meta": {"classes": CLASSES}}, "state_dict": state}, path)
    model = load_mmdet_mask2former(path)
    for key, value in source.state_dict().items():
        if not key.startswith(("model.pixel_level_module.encoder.swin.layernorm", "criterion.")):
            assert torch.equal(model.state_dict()[key], value), key
    assert model.config.id2label[2] == "car"

"""Backend choice (on faked hardware), the one-line log, 1x1 convs handed to backends as
linears, and, where nvidia-modelopt imports, our reference quantizers against
modelopt's CPU quantize-dequantize and the modelopt exploration copy on CPU (FP8; its
NVFP4 kernels need CUDA). torchao refuses FP8 below sm_89 and NVFP4 below sm_100 by an
assert, so here its copies are built with that check bypassed: their wiring, what their
linears dispatch to, their numerics against the reference quantizer, and their in-place
weight refresh."""

import importlib

import pytest
import torch

from diffrl.config import load_config
from diffrl.models import build_adapter
from diffrl.models.policy import Policy
from diffrl.precision import fake_fp8, fake_nvfp4
from diffrl.precision.backends import (
    ConvAsLinear,
    _copy_inner_,
    build_exploration_copy,
    capability_flags,
    choose_backend,
    choose_precision,
    detect_hardware,
)
from diffrl.precision.exploration import ExplorationCopy, merged_weight
from diffrl.precision.formats import round_e4m3
from diffrl.precision.keep_high import default_keep_high


def _modelopt_imports() -> bool:
    try:
        importlib.import_module("modelopt.torch.quantization")
    except Exception:
        return False
    return True


needs_modelopt = pytest.mark.skipif(not _modelopt_imports(), reason="nvidia-modelopt does not import")


def _hw(capability=None, modelopt=True, torchao=True, name="NVIDIA H100 80GB HBM3", torchao_nvfp4=False):
    has_fp8, has_nvfp4 = capability_flags(capability)
    return {
        "torchao_nvfp4": torchao_nvfp4,
        "cuda": capability is not None,
        "device_name": name if capability else "CPU",
        "capability": capability,
        "has_fp8": has_fp8,
        "has_nvfp4": has_nvfp4,
        "modelopt": modelopt,
        "torchao": torchao,
    }


H100, B200, A100, CPU = _hw((9, 0)), _hw((10, 0), name="NVIDIA B200"), _hw((8, 0), name="A100"), _hw(None)
B200_FP4 = _hw((10, 0), name="NVIDIA B200", torchao_nvfp4=True)  # a torchao with NVFP4 GEMMs


@pytest.mark.parametrize(
    "capability,flags",
    [
        (None, (False, False)),
        ((8, 0), (False, False)),
        ((8, 6), (False, False)),
        ((8, 9), (True, False)),
        ((9, 0), (True, False)),
        ((10, 0), (True, True)),
        ((12, 0), (True, True)),
    ],
)
def test_capability_flags(capability, flags):
    assert capability_flags(capability) == flags


def test_detect_hardware_describes_this_machine():
    hw = detect_hardware(probe_imports=True)
    assert hw["cuda"] == torch.cuda.is_available()
    assert set(hw) == {
        "cuda",
        "device_name",
        "capability",
        "has_fp8",
        "has_nvfp4",
        "modelopt",
        "torchao",
        "torchao_nvfp4",
    }
    assert not hw["torchao_nvfp4"] or hw["has_nvfp4"]
    assert (hw["has_fp8"], hw["has_nvfp4"]) == capability_flags(hw["capability"])
    assert hw["modelopt"] == _modelopt_imports()
    if not hw["has_fp8"]:  # auto does not import the optional packages where they cannot run
        assert detect_hardware()["modelopt"] is False and detect_hardware()["torchao"] is False


@pytest.mark.parametrize(
    "precision,hw,backend,words",
    [
        ("fp8", H100, "torchao", "real FP8 GEMMs"),
        ("fp8", B200, "torchao", "real FP8 GEMMs"),
        ("fp8", _hw((9, 0), torchao=False), "reference", "pip install torchao"),
        ("fp8", A100, "reference", "no FP8 tensor cores"),
        ("fp8", CPU, "reference", "no CUDA GPU"),
        ("nvfp4", H100, "modelopt", "numerics only, slower than BF16"),
        ("nvfp4", A100, "reference", "sm_89"),
        ("nvfp4", B200, "modelopt", "NVFP4 numerics, BF16 speed"),
        ("nvfp4", B200_FP4, "torchao", "real FP4 GEMMs"),
        ("nvfp4", _hw((10, 0), modelopt=False), "reference", "pip install nvidia-modelopt"),
        ("nvfp4", CPU, "reference", "need"),
        ("bf16", H100, "none", "BF16 control"),
        ("bf16", CPU, "none", "BF16 control"),
    ],
)
def test_auto_choice(precision, hw, backend, words):
    chosen, reason = choose_backend(precision, "auto", hw)
    assert chosen == backend and words in reason


@pytest.mark.parametrize(
    "precision,requested,hw",
    [
        ("fp8", "reference", H100),
        ("nvfp4", "reference", B200),
        ("fp8", "modelopt", CPU),
        ("nvfp4", "modelopt", H100),
        ("nvfp4", "modelopt", A100),
        ("fp8", "torchao", H100),
        ("bf16", "none", H100),
        ("bf16", "reference", CPU),
    ],
)
def test_an_available_request_is_honoured(precision, requested, hw):
    chosen, reason = choose_backend(precision, requested, hw)
    assert chosen == ("none" if precision == "bf16" else requested)
    assert precision == "bf16" or reason.startswith("requested")


@pytest.mark.parametrize(
    "precision,requested,hw,message",
    [
        ("fp8", "torchao", _hw((9, 0), torchao=False), r"pip install torchao.*or use backend reference"),
        ("fp8", "torchao", CPU, r"FP8 tensor cores \(sm_89\+"),
        ("fp8", "torchao", A100, r"A100 \(sm_80\)"),
        ("nvfp4", "torchao", B200, r"real FP4 GEMMs only on Blackwell .* with a torchao that has"),
        ("nvfp4", "torchao", H100, r"H100 .*\(sm_90\).*precision fp8 for speed"),
        ("nvfp4", "modelopt", _hw((10, 0), modelopt=False), r"pip install nvidia-modelopt"),
        ("nvfp4", "modelopt", CPU, "only on a CUDA GPU"),
        ("bf16", "torchao", H100, "does not apply"),
        ("fp8", "none", H100, "runs no quantizer"),
        ("fp8", "tensorrt", H100, "valid: auto, reference, modelopt, torchao, none"),
        ("fp4", "auto", H100, "unknown exploration precision 'fp4'"),
    ],
)
def test_an_impossible_request_says_what_is_missing(precision, requested, hw, message):
    with pytest.raises(ValueError, match=message):
        choose_backend(precision, requested, hw)


@pytest.mark.parametrize(
    "hw,precision,words",
    [
        (B200_FP4, "nvfp4", "runs FP4 GEMMs"),
        (B200, "fp8", "runs FP8 GEMMs (torchao), not FP4"),
        (H100, "fp8", "runs FP8 GEMMs"),
        (_hw((9, 0), torchao=False), "fp8", "FP8 numerics, slower than BF16"),
        (A100, "fp8", "FP8 numerics, slower than BF16"),
        (CPU, "fp8", "no real low-precision GEMMs on the CPU"),
    ],
)
def test_auto_precision_follows_the_hardware(hw, precision, words):
    """solrl.precision auto (issue 50, item 5): NVFP4 only where FP4 GEMMs run."""
    chosen, reason = choose_precision("auto", hw)
    assert chosen == precision and words in reason
    assert choose_backend(chosen, "auto", hw)[0] == (
        "torchao" if hw["torchao"] and hw["has_fp8"] else "reference"
    )


def test_a_named_precision_is_kept_and_an_unknown_one_refused():
    assert choose_precision("nvfp4", H100) == ("nvfp4", "requested")
    with pytest.raises(ValueError, match="valid: auto, nvfp4, fp8, bf16"):
        choose_precision("int4", H100)


def _policy(family="sd3"):
    cfg = load_config(f"tiny_{family}_flowgrpo")
    adapter = build_adapter(cfg.model)
    return adapter, Policy(adapter, cfg.model)


@pytest.mark.parametrize("precision,backend", [("nvfp4", "reference"), ("bf16", "none")])
def test_build_logs_one_line_and_uses_the_family_defaults(precision, backend):
    _, policy = _policy()
    lines = []
    copy = build_exploration_copy(policy.transformer, "sd3", precision, backend=backend, log=lines.append)
    assert isinstance(copy, ExplorationCopy) and (copy.backend, copy.precision) == (backend, precision)
    reference = ExplorationCopy(policy.transformer, precision, default_keep_high("sd3"))
    assert copy.quantized == reference.quantized
    assert len(lines) == 1 and f"{precision} via {backend}" in lines[0]
    if precision == "nvfp4":
        assert (
            f"{len(reference.quantized)} layers quantized, {len(reference.kept)} kept high (sd3 defaults)"
            in lines[0]
        )


def test_build_with_a_custom_list_and_an_unknown_family():
    _, policy = _policy()
    lines = []
    copy = build_exploration_copy(
        policy.transformer, "sd3", "fp8", "reference", keep_high=[], log=lines.append
    )
    assert copy.kept == [] and "custom keep_high" in lines[0]
    with pytest.raises(ValueError, match="Valid model families"):
        build_exploration_copy(policy.transformer, "sdxl", "fp8", "reference", log=lines.append)


def test_conv_as_linear_computes_the_conv():
    g = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv2d(24, 40, 1)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g))
    x = torch.randn(2, 24, 3, 5, generator=g)
    wrapped = ConvAsLinear(conv)
    torch.testing.assert_close(wrapped(x), conv(x), rtol=1e-5, atol=1e-5)
    assert wrapped.weight.shape == (40, 24) and wrapped.bias is wrapped.linear.bias


def test_inner_tensors_are_refreshed_in_place():
    from torch.testing._internal.two_tensor import TwoTensor

    old, new = (
        TwoTensor(torch.zeros(3), torch.ones(3)),
        TwoTensor(torch.full((3,), 2.0), torch.full((3,), 3.0)),
    )
    a = old.a
    assert _copy_inner_(old, new)
    assert old.a is a and old.a.tolist() == [2.0] * 3 and old.b.tolist() == [3.0] * 3
    assert not _copy_inner_(old, TwoTensor(torch.zeros(4), torch.zeros(4)))  # another layout: replace instead
    assert not _copy_inner_(torch.zeros(3), torch.ones(3))  # a plain tensor is no subclass


# -- modelopt, on CPU ----------------------------------------------------------------------
def _weights():
    """Random rows of very different scales, plus hand rows with every E2M1 tie, a
    saturating block, an all-zero block and a subnormal E4M3 block scale (2^-9)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(30, 64, generator=g) * torch.exp(2 * torch.randn(30, 1, generator=g))
    ladder = [0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, -6]
    hand = torch.tensor(
        [
            [2688.0] + [0.0] * 15 + [2 * v for v in ladder] + [0.0] * 16 + [6.375, -6.375, 0.3] + [0.0] * 13,
            [6 * 2.0**-9, 2.0**-9] + [0.0] * 62,
        ]
    )
    return torch.cat([w, hand])


@needs_modelopt
def test_nvfp4_matches_modelopt_quantize_dequantize_bit_for_bit():
    """modelopt's NVFP4QTensor (pure PyTorch on CPU). One known difference is left out:
    where a block's E4M3 scale rounds to 0 (block amax < ~2^-10 * 6 * tensor scale) we
    flush the block to zero, while modelopt clamps the scale up to 2^-9."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    w = _weights()
    packed, scale, double_scale = NVFP4QTensor.quantize(w.clone(), 16)
    theirs = packed.dequantize(
        dtype=torch.float32, scale=scale, double_scale=double_scale, block_sizes={-1: 16}
    )
    assert torch.equal(fake_nvfp4(w), theirs)


@needs_modelopt
@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_matches_modelopt_codes_bit_for_bit_and_values_to_one_ulp(per_row):
    """modelopt's FP8QTensor picks the same E4M3 code for every element as our reference
    (fp64 ``x * 448 / amax``, rounded once). Dequantized, modelopt multiplies the code by
    an fp32 scale ``amax / 448`` (two roundings) where we round ``code * amax / 448``
    once from fp64, so the values may differ in the last bit, never more."""
    from modelopt.torch.quantization.qtensor import FP8QTensor

    w = _weights()
    packed, scale = FP8QTensor.quantize(w.clone(), axis=0 if per_row else None)
    amax = (w.abs().amax(dim=-1, keepdim=True) if per_row else w.abs().amax()).double()
    assert torch.equal(round_e4m3(w.double() * 448 / amax), packed._quantized_data.float())
    ours, theirs = fake_fp8(w, per_row=per_row), packed.dequantize(dtype=torch.float32, scale=scale)
    ulp = torch.finfo(torch.float32).eps * ours.abs()  # one ulp or more, below 2x one
    assert ((ours - theirs).abs() <= ulp).all()


def _enabled_owners(model):
    from modelopt.torch.quantization.nn import TensorQuantizer

    return {
        n.rpartition(".")[0]
        for n, m in model.named_modules()
        if isinstance(m, TensorQuantizer) and m.is_enabled
    }


def _forward(adapter, model):
    cond = adapter.encode_prompts(["a red circle", "two cats"])
    x = torch.randn((2, *adapter.latent_shape()), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return adapter.velocity(model, x, torch.tensor([0.7, 0.7]), cond)


@needs_modelopt
@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_modelopt_copy_quantizes_our_layers_not_its_name_defaults(precision):
    """NVFP4 is built and calibrated here too, unfolded: its forward and its weight
    folding need CUDA."""
    from diffrl.precision.backends import ModelOptCopy

    _, policy = _policy("flux")
    copy = ModelOptCopy(policy.transformer, precision, default_keep_high("flux"), fold=False)
    assert _enabled_owners(copy.model) == set(copy.quantized)  # weight and input quantizers alike
    assert "single_transformer_blocks.0.proj_out" in copy.quantized  # modelopt's default disables *proj_out.*
    name = "single_transformer_blocks.0.proj_out"
    layer = copy.model.get_submodule(name)
    assert torch.equal(layer.weight, merged_weight(policy.transformer.get_submodule(name)))  # stored high
    per_row = precision == "fp8"  # the reference's FP8 weight scales are per output row
    amax = layer.weight.abs().amax(dim=1) if per_row else layer.weight.abs().amax()
    assert torch.equal(layer.weight_quantizer.amax.reshape(amax.shape), amax)
    if precision == "fp8":  # every quantized layer computes with the reference copy's weight
        reference = ExplorationCopy(policy.transformer, "fp8", default_keep_high("flux"))
        for name in copy.quantized:
            ours = copy.model.get_submodule(name)
            torch.testing.assert_close(
                ours.weight_quantizer(ours.weight),
                reference.model.get_submodule(name).weight,
                rtol=1e-6,
                atol=0,
            )


@needs_modelopt
def test_modelopt_fp8_copy_computes_what_the_reference_copy_computes():
    """Per-row weight scales and per-token activation scales, as the reference (and
    torchao's PerRow copy) take them (modelopt's default recipe takes one per tensor: 3%
    weight differences)."""
    adapter, policy = _policy("flux")
    ours = build_exploration_copy(policy.transformer, "flux", "fp8", backend="modelopt", log=lambda _: None)
    reference = build_exploration_copy(
        policy.transformer, "flux", "fp8", backend="reference", log=lambda _: None
    )
    high = _forward(adapter, policy.transformer)
    shift = (_forward(adapter, reference.model) - high).norm()
    assert shift > 0
    assert (_forward(adapter, ours.model) - _forward(adapter, reference.model)).norm() <= 1e-3 * shift


@needs_modelopt
def test_modelopt_sync_recalibrates_instead_of_keeping_a_stale_amax():
    adapter, policy = _policy("flux")
    copy = build_exploration_copy(policy.transformer, "flux", "fp8", backend="modelopt", log=lambda _: None)
    name = copy.quantized[0]
    before = copy.model.get_submodule(name).weight_quantizer.amax.clone()
    with torch.no_grad():  # shrink every weight: a running max would keep the old amax
        for p in policy.transformer.parameters():
            p.mul_(0.5)
    copy.sync(policy.transformer)
    after = copy.model.get_submodule(name).weight_quantizer.amax.flatten()
    assert torch.equal(after, merged_weight(policy.transformer.get_submodule(name)).abs().amax(dim=1))
    assert (after < before.flatten()).all()
    fresh = build_exploration_copy(policy.transformer, "flux", "fp8", backend="modelopt", log=lambda _: None)
    assert torch.equal(_forward(adapter, copy.model), _forward(adapter, fresh.model))


def _count_fake_quant(monkeypatch, model):
    """Which kinds of quantizer (``weight_quantizer``, ``input_quantizer``) of ``model``
    fake-quantize a tensor, one entry per call, from now on."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    kinds = {id(m): n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, TensorQuantizer)}
    calls, real = [], TensorQuantizer._fake_quantize

    def spy(self, inputs):
        calls.append(kinds.get(id(self), "elsewhere"))
        return real(self, inputs)

    monkeypatch.setattr(TensorQuantizer, "_fake_quantize", spy)
    return calls


@needs_modelopt
def test_modelopt_folds_weights_once_and_computes_what_it_computed_unfolded(monkeypatch):
    """After a sync the weights are quantize-dequantized once and stored (issue 37,
    defect 8): a forward fake-quantizes activations only, and its output is the unfolded
    copy's bit for bit (on CPU in fp32 the fold applies the same quantizer to the same
    fp32 weight the unfolded forward quantizes, then the same matmul runs)."""
    from diffrl.precision.backends import ModelOptCopy

    adapter, policy = _policy("flux")
    folded = build_exploration_copy(policy.transformer, "flux", "fp8", backend="modelopt", log=lambda _: None)
    calls = _count_fake_quant(monkeypatch, folded.model)
    out = _forward(adapter, folded.model)
    assert calls.count("weight_quantizer") == 0 and calls.count("input_quantizer") > 0
    unfolded = ModelOptCopy(policy.transformer, "fp8", default_keep_high("flux"), fold=False)
    calls = _count_fake_quant(monkeypatch, unfolded.model)
    assert torch.equal(out, _forward(adapter, unfolded.model))
    assert calls.count("weight_quantizer") == calls.count("input_quantizer") > 0  # the spy sees weights
    name = "single_transformer_blocks.0.proj_out"
    layer = unfolded.model.get_submodule(name)
    assert torch.equal(folded.model.get_submodule(name).weight, layer.weight_quantizer(layer.weight))


@needs_modelopt
def test_modelopt_sync_folds_the_new_weights_not_the_folded_ones(monkeypatch):
    adapter, policy = _policy("flux")
    copy = build_exploration_copy(policy.transformer, "flux", "fp8", backend="modelopt", log=lambda _: None)
    name = "transformer_blocks.0.attn.to_q"
    before = copy.model.get_submodule(name).weight.clone()
    with torch.no_grad():  # a LoRA step: the merged weights change by a random amount
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    copy.sync(policy.transformer)
    fresh = build_exploration_copy(policy.transformer, "flux", "fp8", backend="modelopt", log=lambda _: None)
    assert not torch.equal(copy.model.get_submodule(name).weight, before)
    for n in copy.quantized:  # folded from the new high-precision weights, like a fresh copy
        assert torch.equal(copy.model.get_submodule(n).weight, fresh.model.get_submodule(n).weight), n
    calls = _count_fake_quant(monkeypatch, copy.model)
    assert torch.equal(_forward(adapter, copy.model), _forward(adapter, fresh.model))
    assert calls.count("weight_quantizer") == 0 and calls.count("input_quantizer") > 0


@needs_modelopt
def test_modelopt_copy_quantizes_sana_pointwise_convs_as_linears():
    adapter, policy = _policy("sana")
    copy = build_exploration_copy(policy.transformer, "sana", "fp8", backend="modelopt", log=lambda _: None)
    conv = "transformer_blocks.0.ff.conv_inverted"
    assert isinstance(copy.model.get_submodule(conv), ConvAsLinear)
    owners = _enabled_owners(copy.model)
    assert f"{conv}.linear" in owners and "transformer_blocks.0.ff.conv_depth" not in owners
    merged = merged_weight(policy.transformer.get_submodule(conv))
    flat = merged.reshape(merged.shape[0], -1)  # loaded as (out, in), folded: quantized once
    torch.testing.assert_close(
        copy.model.get_submodule(conv).weight, fake_fp8(flat, per_row=True), rtol=1e-6, atol=0
    )
    assert torch.isfinite(_forward(adapter, copy.model)).all()


# -- torchao, on CPU with its hardware check bypassed ---------------------------------------
def _torchao_on_cpu(monkeypatch):
    """torchao refuses FP8 below sm_89 by an assert, though its kernels also run on CPU
    with current torch; bypass the check so the copy's wiring and sync are tested here."""
    try:
        quant_api = importlib.import_module("torchao.quantization.quant_api")
    except Exception:
        pytest.skip("torchao does not import")
    if not hasattr(quant_api, "_check_hardware_support"):
        pytest.skip("this torchao checks hardware elsewhere")
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda *a, **k: None)


def _fp8_weight(copy, name):
    layer = copy.module.get_submodule(name)
    return (layer.linear if isinstance(layer, ConvAsLinear) else layer).weight


def test_torchao_copy_quantizes_our_layers_and_syncs_in_place(monkeypatch):
    _torchao_on_cpu(monkeypatch)
    from diffrl.precision.backends import TorchaoCopy

    adapter, policy = _policy("sana")
    policy.transformer.to(torch.bfloat16)
    copy = TorchaoCopy(policy.transformer, default_keep_high("sana"), compile=False)
    subclass = {
        n
        for n, m in copy.module.named_modules()
        if isinstance(m, torch.nn.Linear) and type(m.weight).__name__ == "Float8Tensor"
    }
    expected = {
        f"{n}.linear" if isinstance(copy.module.get_submodule(n), ConvAsLinear) else n for n in copy.quantized
    }
    assert subclass == expected and "transformer_blocks.0.ff.conv_inverted.linear" in subclass
    name = "transformer_blocks.0.ff.conv_point"
    weight, qdata = _fp8_weight(copy, name), _fp8_weight(copy, name).qdata
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(6)).to(p.dtype))
    copy.sync(policy.transformer)
    assert _fp8_weight(copy, name) is weight and weight.qdata is qdata  # refreshed in place
    fresh = TorchaoCopy(policy.transformer, default_keep_high("sana"), compile=False)
    for n in copy.quantized:
        a, b = _fp8_weight(copy, n), _fp8_weight(fresh, n)
        assert torch.equal(a.qdata.float(), b.qdata.float()) and torch.equal(a.scale, b.scale), n
    assert torch.equal(_forward(adapter, copy.model), _forward(adapter, fresh.model))


class DispatchRecorder:
    """Every aten op a forward dispatches, with its arguments' shapes and dtypes."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        calls = self.calls = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                calls.append((func, args))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def test_torchao_fp8_linears_dispatch_to_row_wise_scaled_matmuls(monkeypatch):
    """Issue 50, item 3: the FP8 copy's GEMMs are torch._scaled_mm with a scale per token
    (M, 1) and per output row (1, N), traced on fake tensors (no FP8 GEMM is run)."""
    _torchao_on_cpu(monkeypatch)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from diffrl.precision.backends import TorchaoCopy

    adapter, policy = _policy("flux")
    copy = TorchaoCopy(policy.transformer.to(torch.bfloat16), default_keep_high("flux"), compile=False)
    linears = [copy.module.get_submodule(n) for n in copy.quantized]
    recorder = DispatchRecorder()
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(3, 5, linears[0].in_features, dtype=torch.bfloat16)
        with recorder.mode:
            linears[0](x)
    scaled = [args for func, args in recorder.calls if func is torch.ops.aten._scaled_mm.default]
    assert len(scaled) == 1 and not any(f is torch.ops.aten.mm.default for f, _ in recorder.calls)
    a, b, scale_a, scale_b = scaled[0][:4]
    assert a.dtype == b.dtype == torch.float8_e4m3fn
    assert tuple(scale_a.shape) == (15, 1) and tuple(scale_b.shape) == (1, linears[0].out_features)
    assert all(type(layer.weight).__name__ == "Float8Tensor" for layer in linears if hasattr(layer, "weight"))


def test_torchao_leaves_the_inductor_settings_alone(monkeypatch):
    """quantize_'s default set_inductor_config=True turns on coordinate-descent tuning for
    every later compile in the process (the policy's too); the copy turns it off."""
    _torchao_on_cpu(monkeypatch)
    import torch._inductor.config as inductor

    from diffrl.precision.backends import TorchaoCopy, torchao_config

    assert torchao_config("fp8").set_inductor_config is False
    before = inductor.get_config_copy()
    _, policy = _policy("flux")
    copy = TorchaoCopy(policy.transformer.to(torch.bfloat16), default_keep_high("flux"), compile=False)
    copy.sync(policy.transformer)
    assert inductor.get_config_copy() == before


def test_the_torchao_copy_is_compiled_block_by_block(monkeypatch):
    _torchao_on_cpu(monkeypatch)
    from diffrl.precision.backends import TorchaoCopy
    from diffrl.runtime.regional import RegionalCompile

    _, policy = _policy("flux")
    copy = TorchaoCopy(policy.transformer.to(torch.bfloat16), default_keep_high("flux"), compile=True)
    assert isinstance(copy.model, RegionalCompile) and copy.model.module is copy.module
    assert copy.model.classes == ("FluxTransformerBlock", "FluxSingleTransformerBlock")
    assert copy.model.compile_kwargs["fullgraph"] is True


def _nvfp4_on_cpu(monkeypatch):
    """torchao's NVFP4 config asserts sm_100+; its quantizer itself runs on CPU."""
    from diffrl.precision.backends import torchao_nvfp4_config

    config = torchao_nvfp4_config()
    if config is None:
        pytest.skip("this torchao has no NVFP4 inference config")
    module = importlib.import_module(config.__module__)
    if not hasattr(module, "is_sm_at_least_100"):
        pytest.skip("this torchao checks NVFP4 hardware elsewhere")
    monkeypatch.setattr(module, "is_sm_at_least_100", lambda: True)


def test_torchao_nvfp4_copy_computes_with_the_reference_nvfp4_weights(monkeypatch):
    """Blackwell's FP4 path, built on the CPU: every quantized layer's weight dequantizes
    to the reference NVFP4 of the same BF16 weight (16-element blocks, E4M3 block scales,
    an FP32 tensor scale), up to a few elements rounding the other way (torchao derives
    its scales in BF16 arithmetic), and layers whose widths are not multiples of 16 stay
    in BF16, listed as kept (none here: the rule is tested below)."""
    _nvfp4_on_cpu(monkeypatch)
    from diffrl.precision.backends import TorchaoCopy

    _, policy = _policy("flux")
    transformer = policy.transformer.to(torch.bfloat16)
    copy = TorchaoCopy(transformer, default_keep_high("flux"), compile=False, precision="nvfp4")
    reference = ExplorationCopy(transformer, "nvfp4", default_keep_high("flux"))
    unfit = set(reference.quantized) - set(copy.quantized)
    assert set(copy.quantized) <= set(reference.quantized) and set(copy.kept) == set(reference.kept) | unfit
    for name in unfit:
        layer = copy.module.get_submodule(name)
        assert layer.in_features % 16 or layer.out_features % 16
        assert layer.weight.dtype == torch.bfloat16
    assert copy.quantized
    for name in copy.quantized:
        weight = copy.module.get_submodule(name).weight
        assert type(weight).__name__ == "NVFP4Tensor"
        ours = weight.dequantize(torch.float32)
        expected = reference.model.get_submodule(name).weight.float()
        shift = (expected - merged_weight(transformer.get_submodule(name))).norm()
        assert (ours - expected).norm() <= 0.1 * shift, name  # 0.018 at most on this twin


def test_nvfp4_keeps_layers_its_blocks_do_not_tile():
    from diffrl.precision.backends import _fits_nvfp4_blocks

    assert _fits_nvfp4_blocks(torch.nn.Linear(32, 48))
    assert not _fits_nvfp4_blocks(torch.nn.Linear(24, 32)) and not _fits_nvfp4_blocks(torch.nn.Linear(32, 8))
    assert not _fits_nvfp4_blocks(ConvAsLinear(torch.nn.Conv2d(20, 32, 1)))

"""The FP8 flow's GEMMs (issue 61): a rollout phase's weights cast once and reused, bit for
bit what each forward would cast; blockwise (1x128 / 128x128) casts against torchao's own
PyTorch versions of them; torchao used only in the versions it is tested with."""

import importlib.util

import pytest
import torch
from torch import nn

from diffrl.config import ConfigError
from diffrl.precision import torchao_fp8
from diffrl.precision.formats import fp8_tile_codes
from diffrl.precision.fp8_flow import Fp8Flow, choose_flow_backend
from tests.helpers import quick_config

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
BACKENDS = ["reference"] + (["torchao"] if HAS_TORCHAO else [])


def _lora_model(seed=0):
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(seed)
    model = nn.Sequential()
    model.add_module("a", nn.Linear(48, 32))
    model.add_module("b", nn.Linear(32, 16))
    model = inject_adapter_in_model(
        LoraConfig(r=4, lora_alpha=8, target_modules=["a", "b"], init_lora_weights="gaussian"), model
    )
    with torch.no_grad():
        for layer in (model.a, model.b):
            layer.lora_B["default"].weight.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise", "blockwise"])
def test_a_rollout_phase_casts_each_weight_once_and_computes_the_same(backend, scaling):
    if backend == "torchao" and scaling == "blockwise":
        pytest.skip("torchao's blockwise GEMM runs on Hopper GPUs only")
    model = _lora_model()
    flow = Fp8Flow(model, rollout=True, train=True, scaling=scaling, backend=backend)
    x = 3 * torch.randn(5, 48)
    with flow.phase("train"):  # the training forward: casts inside, with the graph
        trained, trained_two = model(x), model(x[:2])
    with torch.no_grad(), flow.phase("rollout"):
        first, second = model(x), model(x[:2])
        assert model.a._fp8_weight_cast is not None
    assert flow.weight_casts == 2  # two layers, once each for the whole phase
    assert model.a._fp8_weight_cast is None  # dropped when the phase ends
    assert torch.equal(first, trained.detach())
    assert torch.equal(second, trained_two.detach())


def test_a_gradient_inside_a_rollout_phase_never_reads_a_stale_cast():
    model = _lora_model()
    flow = Fp8Flow(model, rollout=True, train=True)
    x = torch.randn(3, 48)
    with flow.phase("rollout"):
        with torch.no_grad():
            model.b.lora_B["default"].weight.add_(1.0)  # the weights move inside the phase
        y = model(x)  # with gradients: cast afresh from the live weights
    with flow.phase("train"):
        assert torch.equal(y, model(x))


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao not installed")
@pytest.mark.parametrize("shape", [(4, 256), (256, 384)])
def test_blockwise_casts_are_torchao_s(shape):
    """1x128 tiles (activations) and 128x128 tiles (weights), codes and scales, against
    torchao's PyTorch implementations of its blockwise training casts."""
    from torchao.prototype.blockwise_fp8_training.kernels import (
        torch_blockwise_scale_act_quant_lhs,
        torch_blockwise_scale_weight_quant,
    )

    torch.manual_seed(0)
    x = torch.randn(*shape) * torch.logspace(-3, 2, shape[1])  # tiles of very different ranges
    codes, scale = fp8_tile_codes(x, (1, 128))
    ao_codes, ao_inverse = torch_blockwise_scale_act_quant_lhs(x.contiguous(), 128)
    assert torch.equal(codes.view(torch.uint8), ao_codes.view(torch.uint8))
    assert torch.equal(1.0 / scale[:, ::128], ao_inverse)  # torchao returns 1 / scale
    if shape[0] % 128 == 0:
        codes, scale = fp8_tile_codes(x, (128, 128))
        ao_codes, ao_inverse = torch_blockwise_scale_weight_quant(x.contiguous(), 128)
        assert torch.equal(codes.view(torch.uint8), ao_codes.view(torch.uint8))
        assert torch.equal(1.0 / scale[::128, ::128], ao_inverse)


def test_blockwise_edge_tiles_take_the_amax_of_what_they_hold():
    x = torch.zeros(3, 130)
    x[:, :128] = 1000.0
    x[:, 128:] = torch.tensor([0.5, -0.25])
    codes, scale = fp8_tile_codes(x, (1, 128))
    assert (codes.float() / scale)[:, 128:].tolist() == [[0.5, -0.25]] * 3  # its own scale: exact


def test_torchao_outside_the_tested_versions_is_named_and_the_fix_given(monkeypatch):
    torchao_fp8.torchao_problem.cache_clear()
    monkeypatch.setattr(torchao_fp8, "torchao_version", lambda: "0.21.0")
    try:
        problem = torchao_fp8.torchao_problem()
        assert "torchao 0.21.0 is installed" in problem and torchao_fp8.PIN in problem
        hopper = {"cuda": True, "capability": (9, 0)}
        backend, why = choose_flow_backend("auto", "rowwise", hw=hopper)
        assert backend == "reference" and "0.21.0" in why
        with pytest.raises(ConfigError, match="precision.backend: torchao cannot run: torchao 0.21.0"):
            choose_flow_backend("torchao", "rowwise", hw=hopper)
        monkeypatch.setattr(torchao_fp8, "torchao_version", lambda: None)
        torchao_fp8.torchao_problem.cache_clear()
        assert "not installed" in torchao_fp8.torchao_problem()
    finally:
        torchao_fp8.torchao_problem.cache_clear()


def test_auto_backend_follows_the_hardware():
    cpu = {"cuda": False, "capability": None}
    assert choose_flow_backend("auto", hw=cpu)[0] == "reference"
    assert choose_flow_backend("reference", hw=cpu) == ("reference", "requested")
    ada = {"cuda": True, "capability": (8, 9)}
    backend, why = choose_flow_backend("auto", "blockwise", hw=ada)  # blockwise needs Hopper
    assert backend == "reference" and "sm_90" in why
    if torchao_fp8.torchao_problem() is None:
        assert choose_flow_backend("auto", "rowwise", hw=ada)[0] == "torchao"


def test_blockwise_is_a_setting(tmp_path):
    cfg = quick_config(
        "tiny_flux_flowgrpo",
        tmp_path,
        "precision.rollout=fp8",
        "precision.train=fp8",
        "precision.scaling=blockwise",
    )
    assert cfg.precision.scaling == "blockwise"

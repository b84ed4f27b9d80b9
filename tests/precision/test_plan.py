"""The precision seam (diffrl/precision/plan.py, issue 59 item 2): convert once, a phase
around rollouts and training, a hook after every optimizer step; a no-op where the config
asks for no low precision, so the trainer needs no branch."""

from __future__ import annotations

import torch

from diffrl.models import build_adapter
from diffrl.models.policy import Policy
from diffrl.precision.plan import PrecisionPlan
from tests.helpers import quick_config


def _policy(cfg):
    adapter = build_adapter(cfg.model)
    return Policy(adapter, cfg.model, cfg.seed).transformer


def test_without_low_precision_every_call_is_a_no_op(tmp_path):
    cfg = quick_config("tiny_flux_flowgrpo", tmp_path)
    transformer = _policy(cfg)
    plan = PrecisionPlan(cfg, log=lambda _: None)
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    plan.convert(transformer, reward_fn=None)
    assert plan.flow is None and plan.solrl is None
    with plan.phase("rollout"), plan.phase("train"):
        pass
    plan.after_optimizer_step()
    assert all(torch.equal(before[k], v) for k, v in transformer.state_dict().items())


def test_the_fp8_flow_quantizes_only_in_the_phases_it_names(tmp_path):
    cfg = quick_config("tiny_flux_flowgrpo", tmp_path, "precision.rollout=fp8", "precision.backend=reference")
    transformer = _policy(cfg)
    plan = PrecisionPlan(cfg, log=lambda _: None)
    plan.convert(transformer, reward_fn=None)
    layer_name = plan.flow.quantized[0]
    layer = transformer.get_submodule(layer_name)
    x = torch.randn(3, 7, (layer.base_layer if hasattr(layer, "base_layer") else layer).in_features)
    with torch.no_grad():
        plain = layer(x)
        with plan.phase("rollout"):
            quantized = layer(x)
        with plan.phase("train"):  # the naive split: the update runs in full precision
            trained = layer(x)
    assert not torch.equal(plain, quantized) and torch.equal(plain, trained)


def test_solrl_s_copy_is_built_by_convert_and_stale_after_each_step(tmp_path):
    cfg = quick_config("tiny_flux_solrl", tmp_path)
    transformer = _policy(cfg)
    plan = PrecisionPlan(cfg, log=lambda _: None)
    plan.convert(transformer, reward_fn=None)
    stage = plan.solrl
    assert stage is not None and stage.copy is not None and stage.stale
    stage.explorer(transformer)  # syncs the copy
    assert not stage.stale and stage.syncs == 1
    plan.after_optimizer_step()
    assert stage.stale

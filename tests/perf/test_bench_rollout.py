"""scripts/bench_rollout.py end to end on CPU (its GPU figures come from the same code at
full size): every section runs, the JSON holds what the tables print, and the tree NFE
matches the branching arithmetic."""

import json
import math

import pytest

from diffrl.config import load_config
from diffrl.sampling import TreeSpec
from tests.helpers import load_script


def test_every_section_runs_on_a_tiny_twin_and_writes_json(tmp_path, capsys):
    bench = load_script("bench_rollout")
    out = tmp_path / "bench.json"
    bench.main(
        [
            "--config",
            "tiny_flux_solrl",
            "--repeats",
            "1",
            "--prompts",
            "1",
            "--iterations",
            "2",
            "--variants",
            "cudagraphs,eager,attn:_native_math",
            "--modes",
            "policy,bf16,nvfp4:reference",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    assert set(results) == {
        "tree",
        "precision",
        "optimisations",
        "train",
        "iteration",
    }  # no arch: no estimate
    cfg = load_config("tiny_flux_solrl")
    for row in results["tree"]:
        spec = TreeSpec.build(
            cfg.sampling.num_steps, *eval(row["schedule"].replace("]x[", "],[")), cfg.tree.split_noise_scale
        )
        tree_nfe = sum(math.prod(spec.factors[:t]) for t in range(spec.num_steps))  # nodes alive at each step
        assert row["tree_nfe_per_leaf"] == tree_nfe / spec.leaves
        assert row["independent_nfe_per_leaf"] == cfg.sampling.num_steps
    assert [r["mode"] for r in results["precision"]] == ["policy", "bf16", "nvfp4:reference"]
    assert results["precision"][1]["speed_vs_bf16"] == 1.0
    assert [r["variant"] for r in results["optimisations"]] == [
        "eager",
        "attn:_native_math",
    ]  # no CUDA graphs on CPU
    train = results["train"]
    assert train["peak_basis"] == "measured GEMM" and train["mfu"] > 0
    # the twin trains without checkpointing: nothing is recomputed
    assert train["model_tflop"] == train["executed_tflop"] > 0
    assert f"model {train['model_tflop']:.4g} TFLOP" in printed  # the FLOP count is printed
    solrl, plain = results["iteration"]["config"], results["iteration"]["flow-GRPO (solrl off)"]
    assert set(solrl["seconds"]) == {"sync", "explore", "select", "regenerate", "score", "train"}
    assert set(plain["seconds"]) == {"rollout", "score", "train"}
    assert abs(sum(solrl["share"].values()) - 1) < 1e-9
    assert "Sol-RL iteration / flow-GRPO iteration" in printed


def test_estimate_section_sizes_a_real_config_without_weights(tmp_path, capsys):
    bench = load_script("bench_rollout")
    out = tmp_path / "estimate.json"
    bench.main(["--config", "sana_solrl", "--sections", "estimate", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "### estimate: sana1.5-1.6b at full size, per process of 8" in printed
    e = json.loads(out.read_text())["results"]["estimate"]
    assert e["arch"] == "sana1.5-1.6b" and e["params"] == 1_604_641_952
    # SANA at 1024px: 32x32 latent tokens; Sol-RL samples CFG-free (guidance 1), so one
    # velocity is one row: about 2 x params x tokens
    approx = 2 * e["params"] * 32 * 32
    assert 0.9 < e["forward_tflop_per_sample_step"] * 1e12 / approx < 1.3
    # LoRA with checkpointing: forward, recompute and an input-gradient backward
    assert 2.5 < e["train_tflop_per_sample"] / e["forward_tflop_per_sample_step"] < 3.5
    assert (
        e["memory_gib"]["exploration copy"] > 0 and e["memory_gib"]["rewards"] > 3
    )  # PickScore ViT-H-14, fp32
    assert e["total_gib"] == pytest.approx(sum(e["memory_gib"].values()))
    by = e["total_gib_by_sharding"]
    assert by["none"] == pytest.approx(e["total_gib"]) and by["fsdp"] < by["none"]


def test_a_bad_mode_is_one_error_before_any_model_is_built(capsys):
    from diffrl.cli import run_cli

    bench = load_script("bench_rollout")
    with pytest.raises(SystemExit) as exit_info:
        run_cli(
            bench.main, ["--config", "tiny_flux_solrl", "--sections", "precision", "--modes", "bf16,fp5:auto"]
        )
    assert exit_info.value.code == 2
    assert "--modes entry 'fp5:auto'" in capsys.readouterr().err


def test_fsdp_estimate_shards_the_transformer_state_and_adds_two_gathered_blocks(tiny_cfg):
    """Hand count on a tiny full fine-tune with an EMA, against the replicated estimate:
    FSDP over 4 processes keeps a quarter of the transformer's weights, gradients, AdamW
    moments, reference copy and EMA shadow, plus the largest block twice (current and
    prefetched unit) and its gradient; everything outside the transformer is unchanged."""
    from diffrl.models import build_adapter
    from diffrl.models.policy import Policy
    from diffrl.perf.estimate import _memory_parts

    cfg = tiny_cfg("flux", "model.full_finetune=true", "train.ema_decay=0.9")
    adapter = build_adapter(cfg.model)
    policy = Policy(adapter, cfg.model, seed=0)
    none = _memory_parts(cfg, adapter, policy, 20.0, 4, "none", 7.0)
    fsdp = _memory_parts(cfg, adapter, policy, 20.0, 4, "fsdp", 7.0)
    t = adapter.transformer
    weights = sum(p.numel() * p.element_size() for p in t.parameters())  # all trainable here
    numel = sum(p.numel() for p in t.parameters())
    blocks = [*t.transformer_blocks, *t.single_transformer_blocks]
    largest = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks)
    assert none["trainable + grads + AdamW"] == 4 * weights and none["transformer (frozen)"] == 0
    assert none["reference copy"] == weights and none["EMA / old policy"] == 4 * numel
    for part in ("trainable + grads + AdamW", "reference copy", "EMA / old policy"):
        assert fsdp[part] == none[part] / 4, part
    assert fsdp["FSDP gathered units"] == 3 * largest and "FSDP gathered units" not in none
    for part in ("VAE", "text encoders", "rewards", "exploration copy"):
        assert fsdp[part] == none[part], part

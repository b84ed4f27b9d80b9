"""Parity with the public reference implementations, on numbers their own code produced.

The fixtures in tests/fixtures/reference were computed by running the reference code
(flow_grpo, DanceGRPO, BranchGRPO, DiffusionNFT, nvidia-modelopt) outside this repository
on small fixed inputs; each records its repository, commit, file and function. No
reference code is in this repository: only its inputs and outputs. Where we deviate on
purpose, the test pins the deviation and the docstring of the module says why.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from diffrl.algorithms.advantages import compute_advantages
from diffrl.sampling.sde import gaussian_kl, step

FIXTURES = Path(__file__).parent / "fixtures" / "reference"


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def tensor(values) -> torch.Tensor:
    """Nested lists of floats, float.hex() strings or 'inf'/'nan' strings."""

    def conv(v):
        if isinstance(v, list):
            return [conv(u) for u in v]
        if isinstance(v, str):
            return float.fromhex(v) if v.lstrip("-").startswith("0x") else float(v)
        return v

    return torch.tensor(conv(values), dtype=torch.float64)


# ----------------------------------------------------------------------------- flow_grpo, DanceGRPO

FLOW = load("flow_grpo_dancegrpo.json")
X, V, PREV = (tensor(FLOW["inputs"][k]).float() for k in ("x", "v", "prev_sample"))


@pytest.mark.parametrize("i", range(4))
def test_sde_step_log_prob_and_kl_match_flow_grpo(i):
    ref = FLOW["fixtures"]["flow_grpo_sde_step"]["per_step"][i]
    sigmas = FLOW["inputs"]["flow_grpo_sigmas"]
    a = FLOW["fixtures"]["flow_grpo_sde_step"]["noise_level"]
    ours = step("sde", X, V, ref["sigma"], ref["sigma_next"], a, sigma_1=sigmas[1], next_latents=PREV)
    torch.testing.assert_close(ours.mean, tensor(ref["prev_sample_mean"]).float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours.std_t, tensor(ref["std_dev_t"]).float(), atol=0, rtol=1e-6)
    torch.testing.assert_close(ours.log_prob, tensor(ref["log_prob"]).float(), atol=1e-5, rtol=1e-6)
    ref_mean = step("sde", X, 0.9 * V, ref["sigma"], ref["sigma_next"], a, sigma_1=sigmas[1]).mean
    kl = gaussian_kl(ours.mean, ref_mean, ours.std, ours.std_t, "flow_grpo")
    # a difference of two fp32 means, squared: relative rounding up to ~1e-5
    torch.testing.assert_close(kl.double(), tensor(ref["kl_loss_per_sample"]), atol=1e-12, rtol=1e-4)


@pytest.mark.parametrize("i", range(4))
def test_cps_step_matches_flow_grpo_under_its_log_prob_convention(i):
    ref = FLOW["fixtures"]["flow_grpo_cps_step"]["per_step"][i]
    a = FLOW["fixtures"]["flow_grpo_cps_step"]["noise_level"]
    ours = step("cps", X, V, ref["sigma"], ref["sigma_next"], a, next_latents=PREV, reduction="flow_grpo")
    torch.testing.assert_close(ours.mean, tensor(ref["prev_sample_mean"]).float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours.std, tensor(ref["std_dev_t"]).float(), atol=0, rtol=1e-6)
    if ref["sigma_next"] == 0.0:
        # the last cps step has std 0: flow_grpo still scores it (and its KL is inf); we
        # give it log-prob 0 and the rollout marks it untrainable, under every convention
        assert ours.log_prob.eq(0).all() and torch.isinf(tensor(ref["kl_loss_per_sample"])).all()
        return
    torch.testing.assert_close(ours.log_prob, tensor(ref["log_prob"]).float(), atol=1e-6, rtol=1e-5)
    # the true density's log-ratio is flow_grpo's divided by 2 std^2
    density = step("cps", X, V, ref["sigma"], ref["sigma_next"], a, next_latents=PREV, reduction="mean")
    const = torch.log(ours.std) + 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(
        ours.log_prob, 2 * ours.std**2 * (density.log_prob + const), rtol=1e-5, atol=1e-6
    )
    ref_mean = step("cps", X, 0.9 * V, ref["sigma"], ref["sigma_next"], a).mean
    kl = gaussian_kl(ours.mean, ref_mean, ours.std, ours.std_t, "flow_grpo")
    torch.testing.assert_close(kl.double(), tensor(ref["kl_loss_per_sample"]), atol=1e-12, rtol=1e-5)


def test_sde_first_step_below_pure_noise_is_our_one_deliberate_deviation():
    fix = FLOW["fixtures"]["flow_grpo_sde_step_grid_below_1"]
    sigmas, ref = fix["sigmas"], fix["per_step"][0]
    a = fix["noise_level"]
    # without sigma_1 we apply flow_grpo's rule (sigma == 1 only) and reproduce it ...
    plain = step("sde", X, V, ref["sigma"], ref["sigma_next"], a, next_latents=PREV)
    torch.testing.assert_close(plain.std_t, tensor(ref["std_dev_t"]).float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(plain.log_prob, tensor(ref["log_prob"]).float(), rtol=1e-5, atol=1e-5)
    # ... with it (as rollouts pass it) the first step uses 1 - sigma_1: std_t 3.5, not 40
    ours = step("sde", X, V, ref["sigma"], ref["sigma_next"], a, sigma_1=sigmas[1], next_latents=PREV)
    expected = a * math.sqrt(ref["sigma"] / (1 - sigmas[1]))
    torch.testing.assert_close(ours.std_t, torch.full((2,), expected), rtol=1e-6, atol=0)
    later = fix["per_step"][1]  # from the second step on the two agree
    second = step("sde", X, V, later["sigma"], later["sigma_next"], a, sigma_1=sigmas[1], next_latents=PREV)
    torch.testing.assert_close(second.log_prob, tensor(later["log_prob"]).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("i", range(4))
def test_dance_step_matches_dancegrpo_flux_step(i):
    fix = FLOW["fixtures"]["dancegrpo_flux_step"]
    ref = fix["per_step"][i]
    ours = step("dance", X, V, ref["sigma"], ref["sigma_next"], fix["eta"], next_latents=PREV)
    torch.testing.assert_close(ours.mean, tensor(ref["prev_sample_mean"]).float(), atol=1e-6, rtol=1e-6)
    assert ours.std[0].item() == pytest.approx(ref["std_dev_t"], rel=1e-6)
    torch.testing.assert_close(ours.log_prob, tensor(ref["log_prob"]).float(), atol=1e-3, rtol=1e-6)


def test_group_advantages_match_flow_grpo_and_the_sample_std_option_matches_dancegrpo():
    fix = FLOW["fixtures"]["flow_grpo_advantages"]
    r = torch.tensor(fix["rewards_two_groups"])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    for estimator, key in (("group", "global_std=False"), ("global_std", "global_std=True")):
        ours = compute_advantages(r, g, estimator, filter_zero_std=False).values
        torch.testing.assert_close(ours.double(), tensor(fix[key]["two_groups"]), atol=1e-6, rtol=0)
    dance = FLOW["fixtures"]["dancegrpo_advantages"]
    r = torch.tensor(dance["rewards"])
    ours = compute_advantages(r, torch.zeros(4, dtype=torch.long), "group", eps=1e-8, std="sample").values
    torch.testing.assert_close(ours.double(), tensor(dance["advantages_use_group"]), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- BranchGRPO

BRANCH = load("branchgrpo.json")


def test_split_noise_draw_mode_is_branchgrpos_split_step():
    from diffrl.sampling.tree import TreeSpec

    fix = BRANCH["split_noise"]
    inp, out = fix["inputs"], fix["outputs"]
    scale, eta = inp["split_noise_scale"], inp["eta"]
    spec = TreeSpec.build(20, [inp["index"]], [2], scale, "draw")
    t = inp["index"]
    assert spec.noise_levels(eta)[t] == eta and spec.draw_scales()[t] == scale  # only the draw is scaled
    x, v = tensor(inp["x"]).float(), tensor(inp["v"]).float()
    eps = torch.cat([tensor(inp["eps_split0"]), tensor(inp["eps_split1"])]).float()
    ours = step(
        "dance",
        x.repeat(2, 1, 1, 1),
        v.repeat(2, 1, 1, 1),
        inp["sigma"],
        inp["sigma_next"],
        spec.noise_levels(eta)[t],
        noise=spec.draw_scales()[t] * eps,
    )
    torch.testing.assert_close(
        ours.next_latents, tensor(out["split_next_latents"]).float(), atol=1e-6, rtol=1e-6
    )
    torch.testing.assert_close(ours.log_prob, tensor(out["split_log_prob"]).float(), atol=1e-5, rtol=1e-6)
    level = TreeSpec.build(20, [t], [2], scale, "level")  # ours: a proper SDE step at 4x the noise level
    assert level.noise_levels(eta)[t] == pytest.approx(eta * scale) and level.draw_scales()[t] == 1.0


def _fixture_tree(case):
    from tests.algorithms.test_tree_credit import hand_tree

    inp = case["inputs"]
    factors = [inp["branch_factor"] if t in inp["split_points"] else 1 for t in range(inp["sampling_steps"])]
    return hand_tree(factors, num_trees=inp["num_trees"])


def _reference_node_values(tree, case) -> torch.Tensor:
    """The fixture's depth-wise advantages, laid out on our nodes (0 at the root)."""
    table = case["reference_depthwise_advantages"]["values"]
    return torch.tensor(
        [
            table[k][d - 1][j] if d > 0 else 0.0
            for k, d, j in zip(tree.tree.tolist(), tree.depth.tolist(), tree.ordinal.tolist())
        ]
    )


def _kept_post_split(tree, train) -> set[tuple[int, int, int]]:
    after = (tree.depth - 1 > tree.spec.last_split) & train
    return {
        (k, d - 1, j)
        for k, d, j in zip(
            tree.tree[after].tolist(), tree.depth[after].tolist(), tree.ordinal[after].tolist()
        )
    }


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("mode, ref_mode", [("chain_prefix", "1"), ("batch_best_worst", "2")])
def test_width_pruning_reference_modes_keep_branchgrpos_edges(case, mode, ref_mode):
    from diffrl.algorithms.tree_credit import trained_edges
    from tests.algorithms.test_tree_credit import tree_cfg

    fixture = BRANCH["pruning"][case]
    tree = _fixture_tree(fixture)
    leaf_rewards = torch.tensor(fixture["inputs"]["leaf_rewards"]).flatten()
    cfg = tree_cfg(width_pruning=mode, width_keep_fraction=fixture["inputs"]["width_pruning_ratio"])
    train = trained_edges(tree, cfg, 0, leaf_rewards, _reference_node_values(tree, fixture))
    expected = {tuple(e) for e in fixture["modes"][ref_mode]["kept_post_last_split_edges_in_reference_order"]}
    assert _kept_post_split(tree, train) == expected


@pytest.mark.parametrize("case", range(3))
def test_depthwise_advantages_match_branchgrpo_with_the_sample_std_option(case):
    from diffrl.algorithms.tree_credit import tree_credit
    from tests.algorithms.test_tree_credit import tree_cfg

    fixture = BRANCH["pruning"][case]
    tree = _fixture_tree(fixture)
    leaf_rewards = torch.tensor(fixture["inputs"]["leaf_rewards"]).flatten()
    cfg = SimpleNamespace(
        tree=tree_cfg(),
        advantage=SimpleNamespace(estimator="group", eps=1e-8, std="sample", filter_zero_std=False),
    )
    credit = tree_credit(tree, leaf_rewards, leaf_rewards[:, None], cfg, 0)
    torch.testing.assert_close(
        credit.advantages.double(), _reference_node_values(tree, fixture).double(), atol=1e-5, rtol=0
    )


# ----------------------------------------------------------------------------- DiffusionNFT

NFT = load("diffusionnft.json")


@pytest.mark.parametrize("case", range(8))
def test_nft_loss_matches_the_diffusionnft_training_loop(case):
    from diffrl.algorithms.nft import nft_loss
    from diffrl.algorithms.objective import LossContext, StepBatch

    inp, fix = NFT["inputs"], NFT["loss_cases"][case]
    x0, noise = tensor(inp["x0_values"]).float(), tensor(inp["noise_values"]).float()
    v, v_old, v_ref = (tensor(inp[k]).float() for k in ("v_theta_values", "v_old_values", "v_ref_values"))
    ref = fix["reference"]
    ocfg = SimpleNamespace(
        args=SimpleNamespace(beta=fix["beta"]),
        adv_clip_max=fix["adv_clip_max"],
        kl_coef=fix["kl_coef_train_beta"],
    )
    for i, t in enumerate(fix["t"]):  # one pass per sample: a pass has one sigma
        row = slice(i, i + 1)
        ctx = LossContext(
            policy_velocity=lambda *_, r=row: v[r],
            reference_velocity=lambda *_, r=row: v_ref[r],
            objective_cfg=ocfg,
            noise_level=0.0,
            old_velocity=lambda *_, r=row: v_old[r],
        )
        sigma = torch.tensor(t)
        batch = StepBatch(
            x_t=(1 - sigma) * x0[row] + sigma * noise[row],
            x_next=None,
            sigma=sigma,
            sigma_next=sigma,
            sigma_1=None,
            kind="ode",
            old_log_prob=torch.zeros(1),
            advantages=torch.tensor(fix["advantages"][i : i + 1]),
            cond=None,
            weights=None,
            x0=x0[row],
        )
        loss, stats = nft_loss(ctx, batch)
        expected = ref["per_sample_policy_loss"][i] + fix["kl_coef_train_beta"] * ref["kl_per_sample"][i]
        assert loss.item() == pytest.approx(expected, rel=1e-6)
        assert stats["nft/r"].item() == pytest.approx(ref["r"][i], rel=1e-6)


def test_old_policy_decay_follows_diffusionnfts_schedule_in_optimizer_steps():
    from diffrl.training.ema import OldPolicy

    fix = NFT["old_policy_decay"]
    param = [torch.nn.Parameter(torch.zeros(1))]
    for (flat, rate, top), key in [
        ((0, 0.001, 0.5), "reference_decay_type_1_default"),
        ((75, 0.0075, 0.999), "reference_decay_type_2_ocr"),
    ]:
        old = OldPolicy(param, flat, rate, top)
        assert [old.decay_at(s) for s in fix["steps"]] == pytest.approx(fix[key], abs=1e-12)


# ----------------------------------------------------------------------------- nvidia-modelopt

MODELOPT = {c["name"]: c for c in load("modelopt.json")["cases"]}


def _same_up_to_zero_sign(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("name", [n for n, c in MODELOPT.items() if c["format"] == "nvfp4"])
def test_nvfp4_matches_modelopts_nvfp4qtensor(name):
    from diffrl.precision.formats import fake_nvfp4, nvfp4_scales

    case = MODELOPT[name]
    x = tensor(case["input_hex"]).float()
    out = tensor(case["modelopt"]["dequantized_hex"]).float()
    ours = fake_nvfp4(x)
    if name == "nvfp4_all_zero":  # modelopt divides 0 by 0 there; we keep zeros
        assert out.isnan().all() and ours.eq(0).all()
        return
    assert _same_up_to_zero_sign(ours, out)  # bit for bit, except that modelopt's -0 code reads +0
    _, block_scale = nvfp4_scales(x)
    assert torch.equal(block_scale, tensor(case["modelopt"]["block_scale_e4m3_hex"]).float())


def test_fp8_exact_tie_rounds_to_even_like_modelopts_fake_quantizer():
    from diffrl.precision.formats import fake_fp8

    case = MODELOPT["fp8_tie"]
    x = tensor(case["input_hex"]).float()
    amax = x.abs().max().double()
    codes = (fake_fp8(x).double() * 448 / amax).round()  # back on the E4M3 grid
    assert torch.equal(codes, tensor(case["modelopt_fake_quant"]["fp8_values_hex"]))  # -336 -> -320
    # modelopt's export path divides by an fp32 amax / 448 first: the tie moves, 352 wins
    export = tensor(case["modelopt_export"]["fp8_values_hex"])
    assert export[0].item() == -352.0 and codes[0].item() == -320.0


# --------------------------------------------------------------- GRPO-Guard, Flow-DPPO, AWM, DGPO

NEW = load("new_objectives.json")


def _objective_cfg(**kw):
    """The objective section the losses read; ``objective.args`` keys (kl_threshold,
    huber_power, advantage_max, ema_beta, beta) go to its ``args``."""
    base = dict(clip_range=0.2, adv_clip_max=5.0, kl_coef=0.0, kl_type="exact", logprob_reduction="mean")
    args = dict(kl_threshold=1e-5, huber_power=0.25, advantage_max=1.0, ema_beta=0.0, beta=10.0)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    return SimpleNamespace(**{**base, **kw}, args=SimpleNamespace(**args))


def _transition_batch():
    """The fixture's SDE transition, taken under v_old, as a StepBatch."""
    from diffrl.algorithms.objective import StepBatch
    from diffrl.models.base import Conditioning

    i = NEW["inputs"]
    x, v_old, eps = (tensor(i[k]).float() for k in ("x", "v_old", "eps"))
    taken = step(
        "sde", x, v_old, i["sigma"], i["sigma_next"], i["noise_level"], sigma_1=i["sigma_1"], noise=eps
    )
    batch = StepBatch(
        x_t=x,
        x_next=taken.next_latents,
        sigma=torch.tensor(i["sigma"]),
        sigma_next=torch.tensor(i["sigma_next"]),
        sigma_1=i["sigma_1"],
        kind="sde",
        old_log_prob=taken.log_prob,
        advantages=tensor(i["advantages"]).float(),
        cond=Conditioning({"e": torch.zeros(len(x), 1)}),
        old_mean=taken.mean,
    )
    return batch, tensor(i["v_new"]).float(), i["noise_level"]


@pytest.mark.parametrize("case", NEW["grpo_guard"]["cases"], ids=lambda c: f"clip{c['clip_range']}")
def test_grpo_guard_loss_matches_verl_omni(case):
    from diffrl.algorithms import get_objective
    from diffrl.algorithms.objective import LossContext

    batch, v_new, level = _transition_batch()
    ctx = LossContext(lambda *_: v_new, None, _objective_cfg(clip_range=case["clip_range"]), level)
    loss, _ = get_objective("grpo_guard")(ctx, batch)
    # theirs ran in float64 on our fp32 log-probs and means; ours is fp32 end to end
    assert loss.item() == pytest.approx(case["loss"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("case", NEW["flow_dppo"]["cases"], ids=lambda c: f"tau{c['threshold']}")
def test_flow_dppo_loss_matches_unirl(case):
    from diffrl.algorithms import get_objective
    from diffrl.algorithms.objective import LossContext

    batch, v_new, level = _transition_batch()
    ctx = LossContext(lambda *_: v_new, None, _objective_cfg(kl_threshold=case["threshold"]), level)
    loss, stats = get_objective("flow_dppo")(ctx, batch)
    assert loss.item() == pytest.approx(case["loss"], rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("case", NEW["awm"]["cases"], ids=lambda c: f"t{c['t']}-p{c['power']}")
def test_awm_surrogate_log_likelihood_matches_the_reference(case):
    from diffrl.algorithms.awm import huber_log_likelihood
    from diffrl.algorithms.objective import per_sample_mean

    i = NEW["awm"]["inputs"]
    x0, noise, v = tensor(i["x0"]), tensor(i["noise"]), tensor(i["v"])
    error = per_sample_mean((v - (noise - x0)) ** 2)
    ours = huber_log_likelihood(error, torch.tensor(case["t"], dtype=torch.float64), case["power"])
    # the reference's timestep is float32 (0.9 is not exact): relative 1e-7
    torch.testing.assert_close(ours, tensor(case["log_prob"]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", NEW["dgpo"]["cases"], ids=lambda c: f"beta{c['beta']}")
def test_dgpo_loss_and_gradient_match_the_reference(case):
    from diffrl.algorithms import get_objective
    from diffrl.algorithms.objective import LossContext, StepBatch

    i = NEW["dgpo"]["inputs"]
    target, v_ref = tensor(i["target_v"]), tensor(i["ref_v"])
    v = tensor(i["model_v"]).requires_grad_(True)
    x0 = torch.zeros_like(target)  # target = eps - x0 with x0 = 0: eps is the target
    batch = StepBatch(
        x_t=target,
        x_next=target,
        sigma=torch.tensor(0.5),
        sigma_next=torch.tensor(0.5),
        sigma_1=None,
        kind="ode",
        old_log_prob=torch.zeros(6),
        advantages=tensor(i["advantages"]),
        cond=None,
        x0=x0,
        forward_noise=target,
        groups=torch.tensor(i["groups"]),
    )
    ctx = LossContext(lambda *_: v, lambda *_: v_ref, _objective_cfg(beta=case["beta"]), 0.7)
    loss, _ = get_objective("dgpo")(ctx, batch)
    loss.backward()
    assert loss.item() == pytest.approx(case["loss"], rel=1e-10)
    torch.testing.assert_close(v.grad, tensor(case["grad_model_v"]), rtol=1e-9, atol=1e-15)


# ----------------------------------------------------------------------------- OCR and GenEval rewards

OCR_GENEVAL = load("ocr_geneval.json")


@pytest.mark.parametrize("case", OCR_GENEVAL["ocr"]["cases"], ids=lambda c: repr(c["recognised"]))
def test_ocr_accuracy_matches_flow_grpo_and_flow_factory(case):
    from rewards.ocr import quoted_text, text_accuracy

    ours = text_accuracy(case["recognised"], quoted_text(case["prompt"]))
    assert ours == pytest.approx(case["flow_grpo"], abs=1e-12)
    assert ours == pytest.approx(case["flow_factory"], abs=1e-12)
    if any(c.isspace() and c != " " for c in case["recognised"]):
        # verl-omni removes every whitespace character, flow_grpo and we only spaces
        assert case["verl_omni"] != case["flow_grpo"]
    else:
        assert ours == pytest.approx(case["verl_omni"], abs=1e-12)


def _judge_reference_case(case, rule):
    from rewards import geneval_rules as rules
    from rewards.geneval_models import keep

    thresholds = OCR_GENEVAL["geneval"]["thresholds"]
    task = rules.Task.from_metadata(case["metadata"])
    threshold = thresholds["counting_threshold" if task.tag == "counting" else "threshold"]
    detected = {}
    for cls, rows in case["detections"].items():
        # the reference ran in float32 (mmdet's arrays): its scores, rounded the same way
        found = [rules.Found(tuple(r[:4]), float(torch.tensor(r[4]))) for r in rows]
        kept = keep(found, threshold, thresholds["max_objects"], case["nms_threshold"])
        if kept:
            detected[cls] = kept

    def colours(found, cls):
        index = [[tuple(r[:4]) for r in case["detections"][cls]].index(f.box) for f in found]
        return [case["colours"][f"{cls}{i}"] for i in index]

    verdict = rules.judge(task, detected, colours, rules.box_relation(thresholds["position_threshold"]), rule)
    return detected, verdict


@pytest.mark.parametrize(
    "case", OCR_GENEVAL["geneval"]["cases"], ids=lambda c: f"{c['name']}-nms{c['nms_threshold']}"
)
def test_geneval_scores_match_flow_grpos_reward_server(case):
    from rewards import geneval_rules as rules

    detected, flow = _judge_reference_case(case, rules.FLOW_GRPO)
    kept = {cls: [list(f.box) for f in found] for cls, found in detected.items()}
    assert kept == {cls: [b[:4] for b in boxes] for cls, boxes in case["kept"].items()}
    assert flow.credit == pytest.approx(case["score"], abs=1e-12)
    assert flow.correct == case["strict_correct"]
    assert _judge_reference_case(case, rules.GENEVAL)[1].correct == case["correct"]
    # the per-clause option removes exactly the reference's extra 1.0 after a failed relation
    per_clause = _judge_reference_case(case, rules.FLOW_GRPO_PER_CLAUSE)[1]
    extra = sum(bool(c.get("extra")) for c in flow.clauses)
    n = len(per_clause.clauses)
    assert per_clause.credit == pytest.approx((case["score"] * (n + extra) - extra) / n, abs=1e-12)


# ----------------------------------------------------------------------------- VLM judges

VLM = load("vlm_judge.json")


def _vlm_format(mode="text", pattern=None, yes=("Yes",), no=("No",)):
    from rewards.vlm_answers import AnswerFormat

    return AnswerFormat.from_args(mode, yes, no, 1, 5, pattern)


@pytest.mark.parametrize("i", range(len(VLM["flow_grpo_final_score"]["answers"])))
def test_final_score_parsing_matches_flow_grpo_up_to_its_scale(i):
    """flow_grpo's UnifiedReward reward is x / 5; ours (x - 1) / 4 of the same x. Where
    flow_grpo returns 0 (no match) we raise; "Final Score: 10" is 1 to its [1-5] regex and
    out of range to ours."""
    from rewards.vlm_answers import VLMAnswerError

    case = VLM["flow_grpo_final_score"]
    answer, extracted, reward = case["answers"][i], case["extracted"][i], case["reward"][i]
    if reward == 0.0 or "10" in answer:
        with pytest.raises(VLMAnswerError, match="does not match pattern|outside the scale"):
            _vlm_format(pattern="final_score").parse(answer)
        return
    raw = _vlm_format(pattern="final_score").parse(answer)
    assert raw == pytest.approx(extracted) and raw / 5 == pytest.approx(reward)
    out = _vlm_format(pattern="final_score").read_texts([answer])
    assert out["vlm_judge"].item() == pytest.approx((extracted - 1) / 4)


@pytest.mark.parametrize("i", range(len(VLM["flow_grpo_score_tag"]["answers"])))
def test_score_tag_parsing_matches_flow_grpo(i):
    """flow_grpo's <Score> regex takes integers only ("4.5" scores 0 there); ours reads it."""
    from rewards.vlm_answers import VLMAnswerError

    answer, reward = VLM["flow_grpo_score_tag"]["answers"][i], VLM["flow_grpo_score_tag"]["reward"][i]
    if "4.5" in answer:
        assert reward == 0 and _vlm_format(pattern="score_tag").parse(answer) == 4.5
    elif reward == 0:
        with pytest.raises(VLMAnswerError, match="does not match pattern"):
            _vlm_format(pattern="score_tag").parse(answer)
    else:
        assert _vlm_format(pattern="score_tag").parse(answer) / 5 == pytest.approx(reward)


@pytest.mark.parametrize("i", range(len(VLM["verl_omni_axes"]["answers"])))
def test_axis_scores_match_verl_omni(i):
    """verl-omni's (mean - 1) / 4 over the last score per axis; where it falls back to any
    three numbers, clips an out-of-range mean, or returns 0, we raise."""
    from rewards.vlm_answers import VLMAnswerError

    case = VLM["verl_omni_axes"]
    answer, parsed, (normalized, raw) = case["answers"][i], case["parsed"][i], case["normalized_raw"][i]
    if not parsed or "score" not in answer.lower() or not all(1 <= v <= 5 for v in parsed.values()):
        with pytest.raises(VLMAnswerError, match="does not match pattern|outside the scale"):
            _vlm_format(pattern="axes").parse(answer)
        return
    out = _vlm_format(pattern="axes").read_texts([answer])
    assert out["vlm_judge_raw"].item() == pytest.approx(raw, rel=1e-6)
    assert out["vlm_judge"].item() == pytest.approx(normalized, rel=1e-6)


@pytest.mark.parametrize("canonicalize", [False, True])
def test_yes_probability_from_top_logprobs_matches_flow_factory(canonicalize):
    """Flow-Factory's P(Yes) / (P(Yes) + P(No)) from a server's top logprobs (canonicalize:
    every case and spacing of yes / no, which our yes / no lists spell out); where neither
    answer is listed it returns 0 and we raise."""
    from rewards.vlm_openai import answer_probs

    case = VLM["flow_factory_yes_prob"]
    yes = ["Yes", "yes", " yes", " Yes", "YES"] if canonicalize else ["Yes"]
    no = ["No", "no", " no", " No", "NO"] if canonicalize else ["No"]
    fmt = _vlm_format("yes_no", yes=yes, no=no)
    expected = case["reward_canonicalize" if canonicalize else "reward"]
    for top, reference in zip(case["top_logprobs"], expected, strict=True):
        probs = answer_probs([{"token": t, "logprob": lp} for t, lp in top], fmt.answers)
        if not any(probs):
            assert reference == 0.0  # the openai backend raises VLMAnswerError here
            continue
        score = fmt.read_probs(torch.tensor([probs], dtype=torch.float64))["vlm_judge"].item()
        assert score == pytest.approx(reference, rel=1e-9, abs=1e-12)


def test_geneval_colour_crops_match_genevals_image_crops_inside_the_image():
    from rewards.geneval_models import colour_crop
    from rewards.geneval_rules import Found

    fix = OCR_GENEVAL["geneval_crops"]
    image = torch.tensor(fix["image"], dtype=torch.float32).permute(2, 0, 1) / 255
    mask = torch.tensor(fix["mask"])
    h, w = mask.shape
    for box, masked, plain in zip(fix["boxes"], fix["masked_crops"], fix["box_crops"]):
        for ref, ours in (
            (masked, colour_crop(image, Found(tuple(box[:4]), mask=mask))),
            (plain, colour_crop(image, Found(tuple(box[:4])))),
        ):
            ref = torch.tensor(ref, dtype=torch.float32).permute(2, 0, 1)
            ours = (ours * 255).round()
            # PIL pads a box reaching past the image with black; we clip it (rewards/geneval_models.py)
            top, left = max(0, -round(box[1])), max(0, -round(box[0]))
            inside = ref[:, top : top + ours.shape[1], left : left + ours.shape[2]]
            torch.testing.assert_close(ours, inside, atol=0, rtol=0)
            outside = ref.clone()
            outside[:, top : top + ours.shape[1], left : left + ours.shape[2]] = 0
            assert outside.eq(0).all()
            reaches_out = box[0] < 0 or box[1] < 0 or box[2] > w or box[3] > h
            assert (ours.shape == ref.shape) != reaches_out

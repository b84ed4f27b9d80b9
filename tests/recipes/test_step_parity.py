"""Step-level parity of the flow_grpo recipes (issue 60, item 2): one whole iteration of
``sd35_flowgrpo``, ``sd35_flowgrpo_geneval`` and ``sd35_flowgrpo_ocr`` on the SD3 tiny twin,
held against an oracle of flow_grpo's training step written from ``scripts/train_sd3.py`` at
ac4c86e, line by line (the line numbers are that file's). Same rollout and rewards in; out:
the same trained samples, the same loss of every forward to 1e-6, the same gradient at every
optimizer step and the same EMA weights to 1e-5. The oracle shares nothing with diffrl's
update but the transformer call (``adapter._forward``, the ``transformer(...)`` of the
script).

Two draws of the reference are random (``torch.randperm``): which zero-advantage samples
come back to fill the micro-batches (line 805) and each inner epoch's shuffle (line 824).
Any draw is the reference's; the oracle takes diffrl's keyed draws and checks that they are
draws of the reference's kind (how many come back, from where; a permutation of the kept
samples)."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.config import load_config
from diffrl.twin import tiny_twin_overrides
from tests.helpers import adapters_off, rollout_with_rewards

# 2 prompts x 6 samples, micro-batches of 4 (3 optimizer steps of 1 micro-batch), an EMA
# updated at every step; the rest is sd35_flowgrpo as shipped (CFG 4.5 in training with
# the unconditional branch detached, global std, kl 0.01 in flow_grpo's form, 9 of 10 steps)
SETUP = [
    "rollout.prompts_per_step=2",
    "rollout.group_size=6",
    "rollout.batch_size=12",
    "train.micro_batch_size=4",
    "train.gradient_accumulation=1",
    "train.ema_update_every=1",
    "train.ema_repeats=1",
    "model.guidance_scale=4.5",
]
# one group all equal (every advantage 0), one with two rewards at the group mean
REWARDS = [1.0] * 6 + [0.1, 0.3, 0.5, 0.5, 0.7, 0.9]


FLOW_GRPO_RECIPES = ["sd35_flowgrpo", "sd35_flowgrpo_geneval", "sd35_flowgrpo_ocr"]


def _config(tmp_path, *extra, recipe: str = "sd35_flowgrpo"):
    shipped = load_config(recipe)
    return load_config(recipe, [*tiny_twin_overrides(shipped), f"output_dir={tmp_path}", *SETUP, *extra])


# -- the oracle: flow_grpo's scripts/train_sd3.py --------------------------------------------
def _advantages(rewards: torch.Tensor, prompt_ids: list[int]) -> torch.Tensor:
    """flow_grpo/stat_tracking.py, PerPromptStatTracker.update with global_std (lines
    19-31): (r - the prompt's mean) / (np.std of all rewards + 1e-4), in float64."""
    r = rewards.double()
    std = r.std(unbiased=False) + 1e-4
    out = torch.empty_like(r)
    for p in set(prompt_ids):
        rows = [i for i, q in enumerate(prompt_ids) if q == p]
        out[rows] = (r[rows] - r[rows].mean()) / std
    return out


def _kept(advantages: torch.Tensor, num_batches: int, refilled: list[int]) -> torch.Tensor:
    """Lines 796-816: the samples whose advantages are not all zero, topped up to a multiple
    of num_batches_per_epoch with ``refilled`` (the reference's randperm picks among the
    False entries; the test checks diffrl's picks are such a draw)."""
    mask = advantages != 0
    short = (num_batches - int(mask.sum()) % num_batches) % num_batches
    false_indices = torch.where(~mask)[0].tolist()
    if short and len(false_indices) >= short:
        assert len(refilled) == short and set(refilled) <= set(false_indices)
        mask[refilled] = True
    else:
        assert refilled == []
    return mask


def _sde_step(v, x, x_next, sigma, sigma_next, sigma_max, noise_level):
    """flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, sde_step_with_logprob (lines
    34-70) with prev_sample given: (log_prob, prev_sample_mean, std_dev_t)."""
    v, x, x_next = v.float(), x.float(), x_next.float()
    dt = sigma_next - sigma
    std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * noise_level
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_dev_t * math.sqrt(-dt)
    log_prob = (
        -((x_next.detach() - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    )
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_dev_t


def _compute_log_prob(adapter, model, x, x_next, sigmas, j, cond, cfg):
    """Lines 180-215, compute_log_prob: the CFG batch [negative; positive] in one call, the
    unconditional half detached (line 190), guidance scale s (lines 191-195)."""
    keys = adapter.cond_keys
    both = {k: torch.cat([cond.tensors[f"negative_{k}"], cond.tensors[k]]) for k in keys}
    sigma = torch.full((len(x),), float(sigmas[j]))
    out = adapter._forward(model, torch.cat([x, x]), torch.cat([sigma, sigma]), both).float()
    noise_pred_uncond, noise_pred_text = out.chunk(2)
    noise_pred_uncond = noise_pred_uncond.detach()
    noise_pred = noise_pred_uncond + cfg.model.guidance_scale * (noise_pred_text - noise_pred_uncond)
    return _sde_step(
        noise_pred,
        x,
        x_next,
        float(sigmas[j]),
        float(sigmas[j + 1]),
        float(sigmas[1]),
        cfg.sampling.noise_level,
    )


class _Ema:
    """flow_grpo/ema.py, EMAModuleWrapper (lines 8-53)."""

    def __init__(self, params, decay, interval):
        self.ema = [p.detach().clone() for p in params]
        self.decay, self.interval = decay, interval

    @torch.no_grad()
    def step(self, params, optimization_step):
        one_minus_decay = 1 - min((1 + optimization_step) / (10 + optimization_step), self.decay)
        if (optimization_step + 1) % self.interval == 0:
            for e, p in zip(self.ema, params):
                e.add_(one_minus_decay * (p - e))


def flow_grpo_iteration(adapter, model, traj, cond, rewards, prompt_ids, cfg, kept_order, refilled):
    """One iteration of scripts/train_sd3.py from the advantages on (lines 738-957), for
    one process: the trained micro-batches, every forward's loss, the gradient at every
    optimizer step, the EMA weights after the iteration."""
    params = [p for p in model.parameters() if p.requires_grad]
    o, t = cfg.objective, cfg.train
    optimizer = torch.optim.AdamW(
        params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay,
        eps=cfg.optim.eps,
    )  # fmt: skip
    ema = _Ema(params, t.ema_decay, t.ema_update_every)
    num_batches = math.ceil(len(rewards) / t.micro_batch_size)  # the config's num_batches_per_epoch
    num_train_timesteps = int(cfg.sampling.num_steps * o.timestep_fraction)  # line ~380
    accumulation = t.gradient_accumulation * num_train_timesteps  # line 365
    mask = _kept(_advantages(rewards, prompt_ids), num_batches, refilled)
    advantages = _advantages(rewards, prompt_ids).float()
    assert sorted(kept_order) == torch.where(mask)[0].tolist()  # line 824: a permutation of the kept
    size = len(kept_order) // num_batches  # lines 827-830
    batches = [kept_order[k * size : (k + 1) * size] for k in range(num_batches)]
    losses, grads, global_step, backwards = [], [], 0, 0
    for rows in batches:  # line 838
        c = cond.select(rows)
        for j in range(num_train_timesteps):  # lines 855-862
            x, x_next = traj.latents[rows, j], traj.latents[rows, j + 1]
            log_prob, mean, std_dev_t = _compute_log_prob(adapter, model, x, x_next, traj.sigmas, j, c, cfg)
            with torch.no_grad(), adapters_off(model):  # lines 866-868
                _, mean_ref, _ = _compute_log_prob(adapter, model, x, x_next, traj.sigmas, j, c, cfg)
            adv = torch.clamp(advantages[rows], -o.adv_clip_max, o.adv_clip_max)  # lines 871-875
            ratio = torch.exp(log_prob - traj.log_probs[rows, j])
            unclipped = -adv * ratio
            clipped = -adv * torch.clamp(ratio, 1.0 - o.clip_range, 1.0 + o.clip_range)
            policy_loss = torch.mean(torch.maximum(unclipped, clipped))
            kl = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
            loss = policy_loss + o.kl_coef * torch.mean(kl)  # lines 883-887
            losses.append(loss.item())
            (loss / accumulation).backward()  # line 933: accelerate divides by the accumulation
            backwards += 1
            if backwards % accumulation == 0:  # sync_gradients: lines 934-940
                torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm)
                grads.append(torch.cat([p.grad.flatten() for p in params]).clone())
                optimizer.step()
                optimizer.zero_grad()
                global_step += 1  # line 952
        ema.step(params, global_step)  # line 955: once per micro-batch
    return {"batches": batches, "losses": losses, "grads": grads, "ema": ema.ema, "params": params}


# -- diffrl's iteration, recorded -------------------------------------------------------------
def diffrl_iteration(trainer, r):
    """One update of diffrl on rollout ``r``: the passes' rows, losses and the gradient at
    every optimizer step (as the optimizer sees it, after clipping)."""
    updater, seen = trainer.updater, {"rows": [], "losses": [], "grads": []}
    objective, step_batch, opt_step = updater.objective, updater._step_batch, trainer.optimizer.step
    params = trainer.policy.trainable_parameters()

    def recorded_objective(ctx, batch):
        loss, stats = objective(ctx, batch)
        seen["losses"].append(loss.item())
        return loss, stats

    def recorded_batch(traj, cond, advantages, p):
        seen["rows"].append((list(p.rows), p.t))
        return step_batch(traj, cond, advantages, p)

    def recorded_step(*args, **kwargs):
        seen["grads"].append(torch.cat([p.grad.flatten() for p in params]).clone())
        return opt_step(*args, **kwargs)

    updater.objective, updater._step_batch, trainer.optimizer.step = (
        recorded_objective,
        recorded_batch,
        recorded_step,
    )
    updater.run(r.traj, r.cond, trainer.credit(r, 0), 0)
    return seen


def _compare(tmp_path, *extra, recipe: str = "sd35_flowgrpo"):
    cfg = _config(tmp_path, *extra, recipe=recipe)
    trainer, r, oracle_model = rollout_with_rewards(cfg, REWARDS)
    ours = diffrl_iteration(trainer, r)
    rows = [rows for rows, t in ours["rows"] if t == 0]  # each micro-batch's samples, in order
    kept_order = [i for batch in rows for i in batch]
    refilled = sorted(
        set(kept_order) - set(torch.where(_advantages(r.total, r.groups.tolist()) != 0)[0].tolist())
    )
    theirs = flow_grpo_iteration(
        trainer.adapter, oracle_model, r.traj, r.cond, r.total, r.groups.tolist(), cfg, kept_order, refilled
    )
    return trainer, ours, theirs, rows


# the recorder wraps optimizer.step after the LR scheduler was built, which torch notes
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step")


@pytest.mark.parametrize("recipe", FLOW_GRPO_RECIPES)
def test_the_flow_grpo_recipes_train_what_flow_grpo_trains_step_by_step(tmp_path, recipe):
    """Each of the three recipes on its own settings (KL, clip, EMA) with the designed
    rewards in place of its reward (the tiny twin's stand-in)."""
    trainer, ours, theirs, rows = _compare(tmp_path, recipe=recipe)
    assert rows == theirs["batches"]  # the same samples, in the same micro-batches
    assert len(rows) == 3 and all(len(b) == 2 for b in rows)  # 4 nonzero + 2 refilled over 3
    torch.testing.assert_close(
        torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=0, atol=1e-6
    )
    assert len(ours["grads"]) == len(theirs["grads"]) == 3
    for g_ours, g_theirs in zip(ours["grads"], theirs["grads"]):
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-5, atol=1e-7)
    for ours_p, theirs_p in zip(trainer.policy.trainable_parameters(), theirs["params"]):
        torch.testing.assert_close(ours_p.detach(), theirs_p.detach(), rtol=1e-5, atol=1e-7)
    for ours_e, theirs_e in zip(trainer.ema.shadow, theirs["ema"]):
        torch.testing.assert_close(ours_e, theirs_e, rtol=1e-5, atol=1e-7)


def test_the_rollout_stores_the_log_probs_flow_grpo_samples_with(tmp_path):
    """The rollout half of the iteration: every stored old log-prob is what flow_grpo's
    pipeline_with_logprob computes for that transition with the sampling policy (CFG batch,
    sde_step_with_logprob), so the update's first ratio is flow_grpo's."""
    cfg = _config(tmp_path)
    trainer, r, oracle_model = rollout_with_rewards(cfg, REWARDS)
    traj = r.traj
    with torch.no_grad():
        for j in range(cfg.sampling.num_steps):
            x, x_next = traj.latents[:, j], traj.latents[:, j + 1]
            log_prob, _, _ = _compute_log_prob(
                trainer.adapter, oracle_model, x, x_next, traj.sigmas, j, r.cond, cfg
            )
            torch.testing.assert_close(traj.log_probs[:, j], log_prob, rtol=0, atol=1e-5)
    assert traj.latents.shape[1] == cfg.sampling.num_steps + 1


@pytest.mark.parametrize(
    "broken,what",
    [
        ("objective.detach_uncond=false", "grads"),  # issue 60, item 1
        ("advantage.drop_zero=false", "batches"),  # issue 60, item 2
    ],
)
def test_the_oracle_sees_each_behaviour_broken(tmp_path, broken, what):
    """The same comparison with one of the reference's behaviours switched off in diffrl
    fails: the test can tell."""
    if what == "grads":
        _, ours, theirs, _ = _compare(tmp_path, broken)
        pairs = zip(ours["grads"], theirs["grads"])
        assert not all(torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in pairs)
        return
    trainer, r, _ = rollout_with_rewards(_config(tmp_path, broken), REWARDS)
    seen = diffrl_iteration(trainer, r)
    trained = {i for batch, t in seen["rows"] if t == 0 for i in batch}
    nonzero = set(torch.where(_advantages(r.total, r.groups.tolist()) != 0)[0].tolist())
    assert trained == set(range(len(REWARDS))) and trained != nonzero  # every sample forwarded

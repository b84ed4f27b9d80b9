"""The refiner's update: one GRPO step on its rewrites' tokens per iteration, from the
advantages the flow model trains on (PromptRL; UniRL's joint step: the LM's loss and the
diffusion loss from one rollout, one optimizer step each iteration, no inner epochs).

The LM is replicated on every process (not wrapped by ``accelerate.prepare``): each
process computes its rewrites' gradient and the gradients are averaged over processes
before the step, so every copy stays identical. A non-finite loss or gradient on any
process skips the step everywhere and is counted (``skipped/refiner_nonfinite``). The
trained weights and the optimizer's state are checkpointed (:meth:`state_dict`, registered
with accelerate as ``refiner``).
"""

from __future__ import annotations

import torch

from diffrl.algorithms.refiner_grpo import refiner_loss


class RefinerUpdater:
    def __init__(self, acc, refiner, settings, micro_batch_size: int, max_grad_norm: float):
        self.acc, self.refiner, self.settings = acc, refiner, settings
        self.micro_batch_size, self.max_grad_norm = micro_batch_size, max_grad_norm
        self.optimizer = torch.optim.AdamW(refiner.trainable_parameters(), lr=settings.lr, weight_decay=0.0)
        self.steps = 0
        self.skipped_nonfinite = 0

    def run(self, rewrites, advantages: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        """One step on this process's rewrites with their samples' advantages (0 where the
        credit stage left a sample out). Every process calls it (the gradient average is a
        collective)."""
        adv = torch.where(keep.bool(), advantages.float(), torch.zeros_like(advantages.float())).cpu()
        trained = rewrites.completion.any(1)
        total = max(1, int(self._sum_over_processes(float(trained.sum()))))
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {}
        rows = torch.nonzero(trained).flatten().tolist()
        for start in range(0, len(rows), self.micro_batch_size):
            chunk = rows[start : start + self.micro_batch_size]
            seq, mask = rewrites.sequences[chunk], rewrites.completion[chunk]
            logp = self.refiner.token_logprobs(seq, mask)
            ref = self.refiner.token_logprobs(seq, mask, reference=True)
            loss, chunk_stats = refiner_loss(
                logp,
                rewrites.old_logprobs[chunk].to(logp.device),
                ref,
                mask.to(logp.device),
                adv[chunk].to(logp.device),
                self.settings.clip_range,
                self.settings.kl_coef,
            )
            # the mean over every process's rewrites: this chunk's share of it
            (loss * len(chunk) * self.acc.num_processes / total).backward()
            for k, v in chunk_stats.items():
                stats[k] = stats.get(k, 0.0) + v * len(chunk) / max(1, len(rows))
        return {**stats, **self._step()}

    def _step(self) -> dict[str, float]:
        params = self.refiner.trainable_parameters()
        for p in params:  # every process's copy takes the same step
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.acc.num_processes > 1:
                p.grad = self.acc.reduce(p.grad, reduction="mean")
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm or float("inf"))
        if not bool(torch.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_nonfinite += 1
        else:
            self.optimizer.step()
            self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "refiner/grad_norm": float(norm),
            "refiner/optimizer_steps": self.steps,
            "skipped/refiner_nonfinite": self.skipped_nonfinite,
        }

    def _sum_over_processes(self, value: float) -> float:
        if self.acc.num_processes == 1:
            return value
        return float(self.acc.reduce(torch.tensor(value, device=self.acc.device), reduction="sum"))

    # -- checkpointing (registered with accelerate as ``refiner``) ---------------------------
    def state_dict(self) -> dict:
        return {
            "weights": self.refiner.trained_state(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            "skipped_nonfinite": self.skipped_nonfinite,
        }

    def load_state_dict(self, state: dict) -> None:
        self.refiner.load_trained_state(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps, self.skipped_nonfinite = state["steps"], state["skipped_nonfinite"]

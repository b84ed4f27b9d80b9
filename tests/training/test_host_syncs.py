"""No host read per denoising step (issue 37, defect 5).

Every ``.item()``, ``bool(t)``, ``int(t)`` and ``float(t)`` on a tensor runs
``aten._local_scalar_dense``; on a GPU each is a device sync that stalls the host until
the queued kernels finish. One training iteration is run under a dispatch-mode counter at
T and 2T denoising steps: the reads must not grow with the steps (measured on
tiny_flux_flowgrpo before the fix: 137 at 4 steps, 233 at 8).

What the counter cannot see: ``.tolist()`` on a device tensor (a copy to the CPU, not a
scalar read). The code keeps those to one per decision (the Wan2.2 route is one per
forward, the trainable-steps check one per trajectory), not one per step.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffrl.training.trainer import Trainer
from tests.helpers import quick_config


class ScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _reads_in_one_iteration(config: str, run_dir, steps: int, *overrides) -> int:
    trainer = Trainer(quick_config(config, run_dir, f"sampling.num_steps={steps}", *overrides))
    trainer.train_step(0)  # the first iteration builds lazily (schedulers, caches): not counted
    with ScalarReads() as reads:
        trainer.train_step(1)
    return reads.count


@pytest.mark.parametrize(
    ("config", "steps", "overrides"),
    [
        ("tiny_flux_flowgrpo", 4, ()),  # independent rollouts, flow-GRPO
        ("tiny_wan22_flowgrpo", 4, ()),  # two experts routed by timestep
        ("tiny_flux_branchgrpo", 6, ("sampling.sde_window=[0,{last}]",)),  # a BranchGRPO tree
    ],
)
def test_scalar_reads_do_not_grow_with_the_denoising_steps(tmp_path, config, steps, overrides):
    counts = []
    for t in (steps, 2 * steps):
        sets = [o.format(last=t - 1) for o in overrides]
        counts.append(_reads_in_one_iteration(config, tmp_path / str(t), t, *sets))
    assert counts[1] - counts[0] < steps, f"{counts}: a host read per denoising step"

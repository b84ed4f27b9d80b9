"""End to end through the real entry point: ``accelerate launch scripts/train.py`` as a
subprocess, the CLI's error paths, and two gloo processes against one."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffrl.training.setup import FSDP_LAUNCH_ENV

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = [
    sys.executable,
    "-m",
    "accelerate.commands.launch",
    "--cpu",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]
# `accelerate launch --cpu` starts one process; multi-process CPU (gloo) goes through torchrun
# with ACCELERATE_USE_CPU, which accelerate turns into a MULTI_CPU (DDP over gloo) state.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node"]


TRAIN = str(ROOT / "scripts" / "train.py")


def _run(args, timeout=300, cwd=None, **extra_env):
    """``args`` as a subprocess from ``cwd``, by default a fresh empty directory: never the
    checkout, whose outputs/ holds the user's own runs (the default output_dir,
    outputs/<run_name>, is relative to the working directory)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **extra_env}
    with tempfile.TemporaryDirectory(prefix="diffrl-cwd-") as fresh:
        return subprocess.run(
            args, cwd=cwd or fresh, env=env, capture_output=True, text=True, timeout=timeout
        )


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_accelerate_launch_two_steps(tmp_path):
    out = _run(
        LAUNCH
        + [
            "--num_processes",
            "1",
            TRAIN,
            "--config",
            "tiny_flux_flowgrpo.yaml",
            "--set",
            "train.max_steps=2",
            "--set",
            f"output_dir={tmp_path}",
            "--set",
            "logging.trackers=[tensorboard]",
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "checkpoints" / "step-2" / "pytorch_lora_weights.safetensors").is_file()
    assert any((tmp_path / "logs").rglob("events.out.tfevents*")), "no TensorBoard events written"


# a real config's prompt sets are fetched at run time; offline, the toy files stand in
TOY_PROMPTS = [
    "--set",
    "data.train_prompts=assets/prompts/tiny_train.txt",
    "--set",
    "data.eval_prompts=assets/prompts/tiny_eval.txt",
    "--set",
    "data.allow_toy_prompts=true",
]


def test_dry_run_prints_plan_and_builds_nothing(tmp_path):
    missing = _run(
        [sys.executable, TRAIN, "--config", "flux_flowgrpo", "--dry-run"], DIFFRL_DATA=str(tmp_path)
    )
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    fetch = "(with network; --dir DIR or DIFFRL_DATA=DIR for another folder), or give a file path"
    assert missing.stderr.strip().splitlines() == [  # both sets named in one run, each with its key
        f"error: data.train_prompts: prompt set 'pickscore/train' is not fetched in {tmp_path}: run "
        f"`diffrl-data fetch pickscore/train` {fetch}",
        f"data.eval_prompts: prompt set 'pickscore/test' is not fetched in {tmp_path}: run "
        f"`diffrl-data fetch pickscore/test` {fetch}",
    ]
    out = _run([sys.executable, TRAIN, "--config", "flux_flowgrpo", "--dry-run", *TOY_PROMPTS])
    assert out.returncode == 0, out.stderr
    for key in ("samples_per_iteration", "rollout_nfe_per_iteration", "optimizer_steps_per_iteration"):
        assert key in out.stdout
    assert "samples_per_iteration                    1152" in out.stdout


@pytest.fixture(scope="module")
def after_a_readme_run(tmp_path_factory):
    """A directory where the user ran ``diffrl-train --config tiny_flux_flowgrpo`` (the
    README's kind of run, cut to one iteration), as in a checkout after it: the run sits
    in the default output_dir, outputs/tiny_flux_flowgrpo, relative to the working
    directory. In process (the CLI's own main, as diffrl-train runs it): a few seconds."""
    from diffrl.cli import main
    from diffrl.training.run_dir import RunDirInUseError, ensure_fresh

    home = tmp_path_factory.mktemp("after_a_readme_run")
    quick = ["train.max_steps=1", "eval.every=0", "logging.progress_bar=false", "logging.trackers=[]"]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(home)
        assert main(["--config", "tiny_flux_flowgrpo", *[a for s in quick for a in ("--set", s)]]) == 0
    with pytest.raises(RunDirInUseError):  # what the error tests met in the checkout before
        ensure_fresh(home / "outputs" / "tiny_flux_flowgrpo")
    return home


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--config", "no_such_config"], "Shipped configs:"),
        (
            ["--config", "tiny_flux_flowgrpo", "--set", "train.max_stepz=2"],
            "--set train.max_stepz: unknown key 'train.max_stepz'. Did you mean 'train.max_steps'",
        ),
        (["--config", "tiny_flux_flowgrpo", "--set", "rewards=[{name: hpsv9}]"], "unknown reward 'hpsv9'"),
        (["--config", "tiny_flux_flowgrpo", "--set", "data.train_prompts=missing.txt"], "does not exist"),
        (
            ["--config", "tiny_flux_flowgrpo", "--resume", "latest", "--set", "output_dir=/nonexistent/x"],
            "no checkpoints under",
        ),
    ],
)
def test_cli_errors_are_one_clear_line(args, expected, after_a_readme_run, tmp_path):
    """Each bad input gets its own error, also where the user already ran the config into
    its default run directory (issue 40): a case writes to a fresh output_dir of its own
    (a case naming one keeps it: the later --set wins)."""
    own = ["--set", f"output_dir={tmp_path / 'run'}"]
    out = _run([sys.executable, TRAIN, *own, *args], cwd=after_a_readme_run)
    assert out.returncode == 2
    assert expected in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "already holds a run" not in out.stderr


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path):
    """One group of 4 split over 2 processes is normalised over the whole group: rewards,
    their std and the updated weights equal the 1-process run over the same samples."""
    common = [
        TRAIN,
        "--config",
        "tiny_flux_flowgrpo",
        "--set",
        "train.max_steps=1",
        "--set",
        "rollout.prompts_per_step=1",
        "--set",
        "rollout.group_size=4",
        "--set",
        "checkpoint.every=1",
    ]
    one = _run(
        TORCHRUN
        + [
            "1",
            *common,
            "--set",
            "train.micro_batch_size=4",
            "--set",
            "train.gradient_accumulation=1",
            "--set",
            f"output_dir={tmp_path / 'one'}",
        ],
        ACCELERATE_USE_CPU="true",
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run(
        TORCHRUN
        + [
            "2",
            *common,
            "--set",
            "train.micro_batch_size=2",
            "--set",
            "train.gradient_accumulation=1",
            "--set",
            f"output_dir={tmp_path / 'two'}",
        ],
        ACCELERATE_USE_CPU="true",
    )
    assert "processes                                2" in two.stdout, "the run did not start 2 processes"
    assert two.returncode == 0, two.stderr[-3000:]
    r1, r2 = _rows(tmp_path / "one")[-1], _rows(tmp_path / "two")[-1]
    for key in ("reward/mean", "reward/std"):
        assert r1[key] == pytest.approx(r2[key], rel=1e-6, abs=1e-9), key
    w1 = load_file(str(tmp_path / "one" / "checkpoints" / "step-1" / "trainable.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "checkpoints" / "step-1" / "trainable.safetensors"))
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_the_refiner_over_two_gloo_processes_equals_one_process(tmp_path):
    """PromptRL over gloo: one group of 4 split over 2 processes draws the rewrites one
    process draws (each process samples the whole group and takes its members), and the LM's
    gradient averaged over the processes is the one-process gradient: the refiner's trained
    weights and the flow model's agree after one step."""
    sets = ["train.max_steps=1", "checkpoint.every=1", "rollout.prompts_per_step=1", "rollout.group_size=4",
            "rollout.batch_size=1", "train.gradient_accumulation=1", "refiner.model=tiny", "refiner.lr=1e-2",
            "refiner.max_new_tokens=6"]  # fmt: skip
    common = [TRAIN, "--config", "tiny_flux_flowgrpo", *[a for s in sets for a in ("--set", s)]]
    runs = {}
    for n, micro in (("1", "4"), ("2", "2")):
        out = tmp_path / f"p{n}"
        own = ["--set", f"train.micro_batch_size={micro}", "--set", f"output_dir={out}"]
        done = _run(TORCHRUN + [n, *common, *own], ACCELERATE_USE_CPU="true")
        assert done.returncode == 0, done.stderr[-3000:]
        runs[n] = out
    r1, r2 = _rows(runs["1"])[-1], _rows(runs["2"])[-1]
    assert r1["refiner/optimizer_steps"] == r2["refiner/optimizer_steps"] == 1 and r1["refiner/grad_norm"] > 0
    for key in ("reward/mean", "reward/std", "refiner/tokens_per_rewrite", "refiner/grad_norm"):
        assert r1[key] == pytest.approx(r2[key], rel=1e-5, abs=1e-9), key
    for file in ("refiner/trained.safetensors", "trainable.safetensors"):
        w1 = load_file(str(runs["1"] / "checkpoints" / "step-1" / file))
        w2 = load_file(str(runs["2"] / "checkpoints" / "step-1" / file))
        for name in w1:
            torch.testing.assert_close(w1[name], w2[name], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_two_gloo_processes_grow_the_same_trees_as_one(tmp_path):
    """BranchGRPO over gloo: each process holds whole trees; one tree per process gives
    the same rewards and updated weights as both trees in one process (every edge in the
    one optimizer step, edge-weighted loss: DDP's mean of per-process means is the mean).
    One row per rollout forward in both runs: batching 2 trees or 1 moves latents by ~5e-7,
    enough to flip a pixel's rounding and the JPEG reward."""
    common = [
        TRAIN,
        "--config",
        "tiny_flux_branchgrpo",
        "--set",
        "train.max_steps=1",
        "--set",
        "checkpoint.every=1",
        "--set",
        "train.gradient_accumulation=1",
        "--set",
        "rollout.batch_size=1",
    ]
    one = _run(
        TORCHRUN
        + ["1", *common, "--set", "train.micro_batch_size=16", "--set", f"output_dir={tmp_path / 'one'}"],
        ACCELERATE_USE_CPU="true",
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run(
        TORCHRUN
        + ["2", *common, "--set", "train.micro_batch_size=8", "--set", f"output_dir={tmp_path / 'two'}"],
        ACCELERATE_USE_CPU="true",
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "processes                                2" in two.stdout, "the run did not start 2 processes"
    r1, r2 = _rows(tmp_path / "one")[-1], _rows(tmp_path / "two")[-1]
    assert r1["optimizer_steps"] == r2["optimizer_steps"] == 1 and r1["grad_norm"] > 0
    for key in ("reward/mean", "reward/std", "rollout/nfe"):
        assert r1[key] == pytest.approx(r2[key], rel=1e-6, abs=1e-9), key
    w1 = load_file(str(tmp_path / "one" / "checkpoints" / "step-1" / "trainable.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "checkpoints" / "step-1" / "trainable.safetensors"))
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], atol=1e-6, rtol=1e-5)


def test_card_command_flux_solrl_parses_dry_runs_and_starts(tmp_path):
    """The product card's `train.py --config flux_solrl.yaml`: the dry run prints the
    Sol-RL plan; a real start offline stops at its preflight, before any model is built,
    with everything missing listed at once (the HPSv2.1 weights and FLUX.1-dev's folders,
    each with its download command); with that reward swapped for a weight-free one, the
    model alone."""
    dry = _run([sys.executable, TRAIN, "--config", "flux_solrl.yaml", "--dry-run", *TOY_PROMPTS])
    assert dry.returncode == 0, dry.stderr
    assert "solrl_explore_nfe_per_iteration          3248" in dry.stdout  # 16 trees x 203 NFE
    start = _run(
        [
            sys.executable,
            TRAIN,
            "--config",
            "flux_solrl.yaml",
            "--set",
            f"output_dir={tmp_path}",
            *TOY_PROMPTS,
        ]
    )
    assert start.returncode == 2 and "Traceback" not in start.stderr
    assert start.stderr.count("error: preflight:") == 1
    assert "hf download xswu/HPSv2 HPS_v2.1_compressed.pt" in start.stderr
    assert 'hf download black-forest-labs/FLUX.1-dev --include "model_index.json"' in start.stderr
    model = _run(
        [
            sys.executable,
            TRAIN,
            "--config",
            "flux_solrl.yaml",
            "--set",
            f"output_dir={tmp_path}",
            "--set",
            "rewards=[{name: jpeg_compressibility}]",
            *TOY_PROMPTS,
        ]
    )
    assert model.returncode == 2 and "Traceback" not in model.stderr
    assert "MISSING  model black-forest-labs/FLUX.1-dev (flux)" in model.stderr
    assert "hpsv21" not in model.stderr


def test_under_accelerate_launch_q_our_error_is_the_last_line():
    """accelerate launch adds its own CalledProcessError traceback when the script fails;
    with -q (what the README uses) the user's last line is ours."""
    script = [TRAIN, "--config", "tiny_flux_flowgrpo", "--set", "train.max_stepz=2"]
    out = _run([*LAUNCH, "-q", "--num_processes", "1", *script])
    assert out.returncode != 0
    last = [line for line in out.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: --set train.max_stepz: unknown key") and "Traceback" not in out.stderr


def test_shipped_accelerate_configs_load_as_accelerate_reads_them():
    """accelerate_configs/*.yaml are what `accelerate launch --config_file` reads: each
    loads through accelerate's own loader, and a multi-node file spreads its processes
    evenly over its machines."""
    from accelerate.commands.config.config_args import load_config_from_file

    files = sorted((ROOT / "accelerate_configs").glob("*.yaml"))
    assert files, "no shipped accelerate configs"
    for path in files:
        cfg = load_config_from_file(str(path))
        assert cfg.num_processes % cfg.num_machines == 0, path.name
        if cfg.num_machines > 1:
            assert cfg.main_process_port and cfg.rdzv_backend == "static", path.name


FSDP_ENV = {"ACCELERATE_USE_CPU": "true", **FSDP_LAUNCH_ENV}


def _has_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


needs_fsdp2 = pytest.mark.skipif(
    not _has_fsdp2(), reason="this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)"
)
ONE_GROUP = ["rollout.prompts_per_step=1", "rollout.group_size=4", "train.gradient_accumulation=1"]


def _train(processes: int, run_dir, *assignments, resume=None, config="tiny_flux_flowgrpo", **env):
    """scripts/train.py on ``config`` over ``processes`` gloo processes; one group of 4
    split evenly (micro-batches of 4 / processes)."""
    sets = [*ONE_GROUP, f"train.micro_batch_size={4 // processes}", f"output_dir={run_dir}", *assignments]
    args = [TRAIN, "--config", config, *[a for s in sets for a in ("--set", s)]]
    args += ["--resume", str(resume)] if resume else []
    run = _run(TORCHRUN + [str(processes), *args], **({"ACCELERATE_USE_CPU": "true"} | env))
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _trainable(run_dir, step):
    return load_file(str(Path(run_dir) / "checkpoints" / f"step-{step}" / "trainable.safetensors"))


@pytest.mark.slow
@needs_fsdp2
def test_fsdp_over_two_gloo_processes_equals_one_process_and_resumes_exactly(tmp_path):
    """FSDP2 through accelerate, sharded on CPU: DiffusionNFT sampling with its old policy
    and evaluating with the EMA (both swap weights into the sharded transformer) equals
    one process over the same samples; a run resumed from its step-1 checkpoint ends on
    the same weights; checkpoints hold the gathered trainable weights, not the model."""
    nft = ["train.max_steps=2", "checkpoint.every=1", "objective.name=nft", "objective.args.sample_with=old"]
    nft.append("train.ema_decay=0.9")
    _train(1, tmp_path / "one", *nft)
    fsdp = _train(2, tmp_path / "fsdp", *nft, **FSDP_ENV)
    assert "FSDP: the transformer is sharded over 2 processes" in fsdp.stdout
    step1 = tmp_path / "fsdp" / "checkpoints" / "step-1"
    _train(2, tmp_path / "resumed", *nft, resume=step1, **FSDP_ENV)
    r1, r2 = _rows(tmp_path / "one"), _rows(tmp_path / "fsdp")
    for a, b in zip(r1, r2, strict=True):
        for key in ("reward/mean", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), key
    key = "eval/jpeg_incompressibility/mean"  # the EMA's evaluation
    assert r1[-1][key] == pytest.approx(r2[-1][key])
    w1, w2 = _trainable(tmp_path / "one", 2), _trainable(tmp_path / "fsdp", 2)
    for name in w1:  # all-reduce and reduce-scatter sum in different orders: ~6e-8 measured
        torch.testing.assert_close(w1[name], w2[name], atol=1e-6, rtol=1e-5)
    w3 = _trainable(tmp_path / "resumed", 2)
    assert all(torch.equal(w2[name], w3[name]) for name in w2)  # resume is exact
    assert not any(p.name.startswith("pytorch_model_fsdp") for p in step1.iterdir())  # no frozen base


@pytest.mark.slow
@needs_fsdp2
def test_wan22_two_experts_under_fsdp_equal_one_process(tmp_path):
    """Wan2.2's routed experts sharded with FSDP2: passes that run one expert leave the
    other's units ungathered, and its zero-gradient link must still work there; the
    weights equal one process's."""
    wan22 = ["train.max_steps=1", "checkpoint.every=1", "eval.every=0"]
    _train(1, tmp_path / "one", *wan22, config="tiny_wan22_flowgrpo")
    fsdp = _train(2, tmp_path / "fsdp", *wan22, config="tiny_wan22_flowgrpo", **FSDP_ENV)
    assert "FSDP: the transformer is sharded over 2 processes" in fsdp.stdout
    a, b = _rows(tmp_path / "one")[0], _rows(tmp_path / "fsdp")[0]
    assert a["reward/mean"] == pytest.approx(b["reward/mean"], rel=1e-6)
    w1, w2 = _trainable(tmp_path / "one", 1), _trainable(tmp_path / "fsdp", 1)
    assert {n.split(".")[0] for n in w1} == {"high", "low"}
    for expert in ("high", "low"):  # the 4-step schedule puts 3 steps on high, 1 on low: both trained
        assert any(w1[n].abs().sum() > 0 for n in w1 if n.startswith(expert) and "lora_B" in n), expert
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
@needs_fsdp2
def test_fsdp_full_fine_tune_shards_the_reference_and_exports_a_loadable_transformer(tmp_path):
    """Full fine-tuning under FSDP (every weight trained, the KL's frozen reference sharded
    too) equals one process, and its checkpoint's transformer/ folder, written from the
    gathered weights, loads with diffusers' from_pretrained."""
    from diffusers import FluxTransformer2DModel

    full = ["train.max_steps=1", "checkpoint.every=1", "model.full_finetune=true", "objective.kl_coef=0.01"]
    _train(1, tmp_path / "one", *full)
    _train(2, tmp_path / "fsdp", *full, **FSDP_ENV)
    assert _rows(tmp_path / "one")[0]["reward/mean"] == _rows(tmp_path / "fsdp")[0]["reward/mean"]
    w1, w2 = _trainable(tmp_path / "one", 1), _trainable(tmp_path / "fsdp", 1)
    for name in w1:  # ~8e-7 measured over two steps
        torch.testing.assert_close(w1[name], w2[name], atol=1e-5, rtol=1e-5)
    exported = FluxTransformer2DModel.from_pretrained(
        tmp_path / "fsdp" / "checkpoints" / "step-1" / "transformer"
    )
    state = exported.state_dict()
    assert all(torch.equal(state[name], w2[name]) for name in w2)


SOLRL = ["rollout.batch_size=1", "rollout.prompts_per_step=4", "checkpoint.every=1", "eval.every=0"]


def _solrl(processes: int, run_dir, resume=None, **env):
    """tiny_flux_solrl (an NVFP4 tree pool, BF16 sub-tree regeneration) for 2 steps."""
    sets = ["train.max_steps=2", *SOLRL, f"output_dir={run_dir}"]
    args = [TRAIN, "--config", "tiny_flux_solrl", *[a for s in sets for a in ("--set", s)]]
    args += ["--resume", str(resume)] if resume else []
    run = _run(TORCHRUN + [str(processes), *args], **({"ACCELERATE_USE_CPU": "true"} | env))
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.slow
@needs_fsdp2
def test_solrl_sub_trees_over_two_processes_under_ddp_and_fsdp(tmp_path):
    """Sol-RL with a tree pool over gloo: each process regenerates sub-trees whose shapes
    depend on its own selection, so node and edge counts differ between processes.

    * DDP: gathers are ragged-safe and passes padded to one structure, so the run ends
      (instead of hanging in a collective) and its rollouts equal one process's.
    * FSDP: the exploration copy is synced from the shards one block at a time, and the
      regeneration's sharded forwards are aligned across processes (idle forwards); the
      run equals the DDP run (weights within ~6e-8 measured: reduce-scatter and
      all-reduce sum in different orders), and a run resumed from step 1 ends on the
      same weights exactly."""
    _solrl(1, tmp_path / "one")
    ddp = _solrl(2, tmp_path / "ddp")
    assert "processes                                2" in ddp.stdout
    r1, r2 = _rows(tmp_path / "one")[0], _rows(tmp_path / "ddp")[0]
    for key in ("reward/mean", "solrl/pool_reward_mean", "rollout/nfe", "tree/edges"):
        assert r1[key] == pytest.approx(r2[key], rel=1e-6, abs=1e-9), key
    fsdp = _solrl(2, tmp_path / "fsdp", **FSDP_ENV)
    assert "FSDP: the transformer is sharded over 2 processes" in fsdp.stdout
    _solrl(2, tmp_path / "resumed", resume=tmp_path / "fsdp" / "checkpoints" / "step-1", **FSDP_ENV)
    for a, b in zip(_rows(tmp_path / "ddp"), _rows(tmp_path / "fsdp"), strict=True):
        for key in ("reward/mean", "solrl/pool_reward_mean", "solrl/kendall_tau", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), key
        assert a["rollout/nfe"] == b["rollout/nfe"]  # idle forwards are not counted
    w_ddp, w_fsdp = _trainable(tmp_path / "ddp", 2), _trainable(tmp_path / "fsdp", 2)
    for name in w_ddp:
        torch.testing.assert_close(w_ddp[name], w_fsdp[name], atol=1e-6, rtol=1e-5)
    w_resumed = _trainable(tmp_path / "resumed", 2)
    assert all(torch.equal(w_fsdp[name], w_resumed[name]) for name in w_fsdp)


@pytest.mark.slow
def test_an_evaluation_protocol_over_two_gloo_processes_gives_one_process_s_table(tmp_path):
    """scripts/evaluate.py --protocol under torchrun: the prompts' chunks are dealt to the
    processes, every chunk is the batch one process runs, so the table, every image's
    scores and the settings are those of the 1-process run; only one process writes."""
    evaluate = str(ROOT / "scripts" / "evaluate.py")
    common = [
        evaluate,
        "--protocol",
        "shapeworld",
        "--config",
        "toy_flowgrpo",
        "--limit",
        "5",
        "--images",
        "2",
    ]
    common += ["--set", "rollout.batch_size=3", "--set", "sampling.eval_num_steps=4"]
    results = {}
    for n in ("1", "2"):
        out = _run(TORCHRUN + [n, *common, "--out", str(tmp_path / n)], ACCELERATE_USE_CPU="true")
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.count("| shapeworld_strict |") == 1  # one process printed it
        results[n] = json.loads((tmp_path / n / "shapeworld.json").read_text())
    assert results["2"]["rows"] == results["1"]["rows"]
    assert len(results["1"]["samples"]) == 10  # every image's scores, NaN included (hence as text):
    assert json.dumps(results["2"]["samples"]) == json.dumps(results["1"]["samples"])


@pytest.mark.slow
def test_a_start_up_error_on_two_processes_is_said_once(tmp_path):
    """The same bad input on every process of a launch: one error line, not one per
    process (issue 52, item 5)."""
    out = _run(
        TORCHRUN + ["2", TRAIN, "--config", "tiny_flux_flowgrpo", "--set", "data.train_prompts=nope.txt",
                    "--set", f"output_dir={tmp_path}"],
        ACCELERATE_USE_CPU="true",
    )  # fmt: skip
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "prompt file 'nope.txt' does not exist" in errors[0]

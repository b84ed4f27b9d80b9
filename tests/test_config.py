"""Config loading: shipped configs validate; bad input names file, key and choices."""

from pathlib import Path

import pytest

from diffrl.config import CONFIG_DIR, ConfigError, describe, load_config, resolve_config_path, with_overrides

SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))


def test_configs_are_shipped():
    assert SHIPPED, "configs/ must ship YAML files"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_validates(path):
    """Its prompts are a shipped file, or a registered prompt set (fetched at run time)."""
    from diffrl.data import is_set_name

    cfg = load_config(str(path))
    assert cfg.run_name and cfg.rewards
    for prompts in (cfg.data.train_prompts, cfg.data.eval_prompts):
        assert is_set_name(prompts) or Path(prompts).is_file(), f"{path.name}: {prompts} is neither"


def _write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_bare_name_resolves_to_configs_dir():
    name = SHIPPED[0].stem
    assert resolve_config_path(name) == SHIPPED[0]
    assert resolve_config_path(name + ".yaml") == SHIPPED[0]


def test_unknown_config_name_lists_shipped():
    with pytest.raises(ConfigError, match="Shipped configs:"):
        resolve_config_path("no_such_config")


def test_unknown_key_names_file_key_and_suggestion(tmp_path):
    path = _write(tmp_path, "train:\n  max_stepz: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert path in msg and "train.max_stepz" in msg and "max_steps" in msg


def test_wrong_type_names_key_and_type(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.max_steps: expected int, got str 'many'"):
        load_config(_write(tmp_path, "train:\n  max_steps: many\n"))


def test_bad_choice_lists_valid_choices(tmp_path):
    with pytest.raises(
        ConfigError, match=r"sampling\.sde_type.*one of 'sde', 'cps', 'dance', 'consistency', 'ode'"
    ):
        load_config(_write(tmp_path, "sampling:\n  sde_type: euler\n"))


def test_overrides_apply_with_yaml_types(tmp_path):
    cfg = load_config(
        _write(tmp_path, "run_name: x\n"),
        ["train.max_steps=7", "optim.lr=1e-5", "model.lora.target_modules=[to_q, to_k]"],
    )
    assert cfg.train.max_steps == 7 and cfg.optim.lr == pytest.approx(1e-5)
    assert cfg.model.lora.target_modules == ["to_q", "to_k"]


def test_yaml_boolean_words_reach_literal_choices(tmp_path):
    """YAML 1.1 reads `no` as False; `mixed_precision: no` still means the word."""
    cfg = load_config(_write(tmp_path, "train:\n  mixed_precision: no\n"), ["train.mixed_precision=bf16"])
    assert cfg.train.mixed_precision == "bf16"
    cfg = load_config(_write(tmp_path, "train:\n  mixed_precision: bf16\n"), ["train.mixed_precision=no"])
    assert cfg.train.mixed_precision == "no"
    with pytest.raises(ConfigError, match="True is not one of"):  # no choice is a yes-word
        load_config(_write(tmp_path, "run_name: x\n"), ["train.mixed_precision=yes"])


def test_bad_override_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(_write(tmp_path, "run_name: x\n"), ["train.max_steps"])
    with pytest.raises(ConfigError, match="unknown key 'train.nope'"):
        load_config(_write(tmp_path, "run_name: x\n"), ["train.nope=1"])


def test_cross_field_validation(tmp_path):
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        load_config(_write(tmp_path, "rollout:\n  group_size: 1\n"))
    with pytest.raises(ConfigError, match="sde_window"):
        load_config(_write(tmp_path, "sampling:\n  num_steps: 4\n  sde_window: [2, 9]\n"))
    with pytest.raises(ConfigError, match="guidance_scale_2 is the CFG scale of Wan2.2's low-noise expert"):
        load_config(_write(tmp_path, "model:\n  family: wan\n  guidance_scale_2: 3.0\n"))
    with pytest.raises(ConfigError, match="guidance_scale_2 only applies when model.guidance_scale > 1"):
        load_config(
            _write(tmp_path, "model:\n  family: wan22\n  guidance_scale: 1.0\n  guidance_scale_2: 3.0\n")
        )
    with pytest.raises(
        ConfigError, match="'flash' takes no attention mask.*'qwenimage' masks its padded text"
    ):
        load_config(_write(tmp_path, "model:\n  family: qwenimage\nperf:\n  attention_backend: flash\n"))
    load_config(
        _write(tmp_path, "model:\n  family: flux\nperf:\n  attention_backend: flash\n")
    )  # no mask: fine
    with pytest.raises(ConfigError, match="full_finetune is not supported for wan22"):
        load_config(_write(tmp_path, "model:\n  family: wan22\n  full_finetune: true\n"))


def test_invalid_yaml_names_file(tmp_path):
    path = _write(tmp_path, "train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_every_field_has_help():
    lines = describe()
    assert len(lines) > 40
    assert all(line.split(": ", 1)[1].strip() for line in lines), "a config field lacks a help text"


def test_set_errors_name_the_set_not_the_config_file():
    with pytest.raises(
        ConfigError,
        match=r"^--set train.max_stepz: unknown key 'train.max_stepz'\. "
        r"Did you mean 'train.max_steps'\?",
    ):
        load_config("tiny_flux_flowgrpo", ["train.max_stepz=3"])
    with pytest.raises(ConfigError, match=r"^--set train.max_steps=abc: expected int, got str 'abc'$"):
        load_config("tiny_flux_flowgrpo", ["train.max_steps=abc"])
    with pytest.raises(
        ConfigError, match=r"^--set rewards: the value '\[\{name: x' is not valid YAML .*quotes"
    ):
        load_config("tiny_flux_flowgrpo", ["rewards=[{name: x"])
    # below a free-form mapping any key is allowed (a reward's args are checked by the reward)
    cfg = load_config("tiny_flux_flowgrpo", ["rewards=[{name: jpeg_compressibility, args: {quality: 80}}]"])
    assert cfg.rewards[0].args == {"quality": 80}


def test_bad_reward_args_are_one_error_that_names_the_valid_ones():
    import rewards

    with pytest.raises(
        rewards.RewardArgsError,
        match="reward 'shapeworld' has no argument 'scor'. Did you mean "
        "'score'.*Its arguments: score, fg_threshold",
    ):
        rewards.build("shapeworld", scor="strict")
    with pytest.raises(rewards.RewardArgsError, match="reward 'shapeworld', args .*score must be 'partial'"):
        rewards.build("shapeworld", score="bogus")


def test_the_cli_prints_bad_reward_args_and_bad_set_values_as_one_line(tmp_path, capsys):
    from diffrl.cli import main

    for extra, words in (
        (["rewards=[{name: shapeworld, args: {score: bogus}}]"], "score must be"),
        (["rewards=[{name: x"], "not valid YAML"),
        (["optim.lrr=1"], "unknown key 'optim.lrr'"),
    ):
        args = ["--config", "tiny_toy_flowgrpo", "--set", f"output_dir={tmp_path / 'r'}"]
        for o in extra:
            args += ["--set", o]
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and words in err, err


def test_dry_run_checks_reward_names_arguments_and_prompt_files_without_loading_weights(capsys):
    from diffrl.cli import main

    base = ["--config", "tiny_flux_flowgrpo", "--dry-run"]
    for override, words in (
        ("rewards=[{name: pickscor}]", "Did you mean 'pickscore'"),
        ("rewards=[{name: hpsv21, args: {checkpont: x.pt}}]", "has no argument 'checkpont'"),
        ("data.train_prompts=nope.txt", "'nope.txt' does not exist"),
        ("model.family=flux_kontext", "'flux_kontext' edits images, but prompt file"),
        ("data.train_prompts=assets/shapeworld/edit/train.jsonl", "'flux' generates from text only"),
    ):
        assert main(base + ["--set", override]) == 2
        assert words in capsys.readouterr().err
    # a model reward whose weights are not here still passes a dry run: nothing is loaded
    assert main(base + ["--set", "rewards=[{name: hpsv21, args: {checkpoint: /nowhere/hps.pt}}]"]) == 0


@pytest.mark.parametrize("mode", ["--dry-run", "--preflight"])
def test_dry_run_and_preflight_run_each_rewards_prompt_check_without_its_weights(mode, tmp_path, capsys):
    """GenEval's captions and OCR's quotes are checked before any reward loads (the GenEval
    detector and CLIP named here do not exist: a check that loaded them would fail on
    that instead); a GenEval metadata line is scored from its fields, so its wording passes."""
    import json

    from diffrl.cli import main

    captions, meta = tmp_path / "captions.txt", tmp_path / "meta.jsonl"
    captions.write_text("A photo of four knives.\na photo of three dragons\n")
    line = {"tag": "counting", "include": [{"class": "knife", "count": 4}], "prompt": "four knives, please"}
    meta.write_text(json.dumps(line) + "\n")
    geneval = "rewards=[{name: geneval, args: {detector: /nowhere/m2f, clip: /nowhere/clip}}]"
    base = ["--config", "tiny_flux_flowgrpo", mode, "--set", geneval, "--set", "eval.every=0"]
    assert main([*base, "--set", f"data.train_prompts={captions}"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1 and "1 prompt(s) have no GenEval task: 'a photo of three dragons'" in err
    )
    code = main([*base, "--set", f"data.train_prompts={meta}"])
    assert "no GenEval task" not in capsys.readouterr().err
    assert code == (0 if mode == "--dry-run" else 2)  # the preflight still lists the missing weights
    ocr = ["--set", "rewards=[{name: ocr, args: {pretrained: /nowhere/trocr}}]"]
    assert main([*base[:3], *ocr, "--set", f"data.train_prompts={captions}", "--set", "eval.every=0"]) == 2
    assert "quote no text to render" in capsys.readouterr().err


# -- real models on real prompts (issue 51, item 2) ------------------------------------------
def test_a_real_model_on_the_toy_prompts_is_refused_in_one_line():
    sets = ["model.pretrained=black-forest-labs/FLUX.1-dev"]
    with pytest.raises(ConfigError) as err:
        load_config("tiny_flux_flowgrpo", sets)
    assert str(err.value).endswith(  # after the config file's path
        "tiny_flux_flowgrpo.yaml: data.train_prompts 'assets/prompts/tiny_train.txt' is a shipped toy prompt "
        "file, and model.pretrained 'black-forest-labs/FLUX.1-dev' is a real model: name a prompt set "
        "(diffrl-data list; e.g. pickscore/train, geneval/train, hpdv2/train) or your own file, or set "
        "data.allow_toy_prompts: true to run on the toy prompts anyway"
    )
    with pytest.raises(ConfigError, match="data.eval_prompts 'assets/prompts/tiny_eval.txt'"):
        load_config("tiny_flux_flowgrpo", [*sets, "data.train_prompts=pickscore/train"])
    load_config("tiny_flux_flowgrpo", [*sets, "data.allow_toy_prompts=true"])  # said explicitly: runs
    load_config(
        "tiny_flux_flowgrpo", [*sets, "data.train_prompts=geneval/train", "data.eval_prompts=geneval/eval"]
    )


@pytest.mark.parametrize("pretrained", ["tiny", "shapeworld", "random:flux1-dev"])
def test_twins_toys_and_random_weights_may_use_the_toy_prompts(pretrained):
    from diffrl.data.checks import is_real_model

    assert not is_real_model(pretrained)
    assert is_real_model("black-forest-labs/FLUX.1-dev") and is_real_model("/models/my-flux")


def test_every_real_model_config_trains_and_evaluates_on_registered_sets():
    """Except where it says, with a reason in the file, that the toy task is its point."""
    from diffrl.data import is_set_name
    from diffrl.data.checks import is_real_model

    for path in SHIPPED:
        cfg = load_config(str(path))
        if not is_real_model(cfg.model.pretrained):
            continue
        if cfg.data.allow_toy_prompts:
            assert "allow_toy_prompts: true  # " in path.read_text(), path.name
            continue
        assert is_set_name(cfg.data.train_prompts), path.name
        # evaluates on a registered set, or on prompts held out of its training set
        assert cfg.data.eval_holdout or is_set_name(cfg.data.eval_prompts), path.name


def test_overrides_reach_list_items():
    """--set rewards.0.args.checkpoint=... (issue 52, item 5): an item of a list by its
    index, checked against the item's schema, with one line for a bad index."""
    cfg = load_config("tiny_flux_flowgrpo", ["rewards.0.args.quality=80", "rewards.0.weight=2.5"])
    assert cfg.rewards[0].args == {"quality": 80} and cfg.rewards[0].weight == 2.5
    with pytest.raises(ConfigError, match=r"'3' is not an item of this list of 1: use an index from 0 to 0"):
        load_config("tiny_flux_flowgrpo", ["rewards.3.args.checkpoint=/w/x.pt"])
    with pytest.raises(
        ConfigError, match=r"unknown key 'rewards.0.wieght'. Did you mean 'rewards.0.weight'\?"
    ):
        load_config("tiny_flux_flowgrpo", ["rewards.0.wieght=2"])


def test_an_error_is_said_by_the_main_process_only(capsys, monkeypatch):
    from diffrl.cli import say_error

    for rank, said in (("1", ""), ("0", "error: bad input\n")):
        monkeypatch.setenv("RANK", rank)
        say_error(ValueError("bad input"))
        assert capsys.readouterr().err == said
    monkeypatch.delenv("RANK")
    say_error(ValueError("alone"))
    assert capsys.readouterr().err == "error: alone\n"


def test_renamed_objective_keys_still_load_with_one_line(tmp_path, capsys):
    """Issue 59: the per-objective keys moved into objective.args; the old names keep working
    for a while, each read as its new key and said once, in one line."""
    import diffrl.config as config

    config._SAID.clear()
    old = tmp_path / "old.yaml"
    old.write_text(
        "objective: {name: nft, nft_beta: 0.3, nft_old_decay_max: 0.4, dgpo_beta: 7.0, awm_ema_beta: 1.0}\n"
    )
    cfg = load_config(str(old))
    again = load_config(str(old))
    assert cfg.objective.args.beta == 0.3 and cfg.objective.args.old_decay_max == 0.4
    assert again.objective.args == cfg.objective.args
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"note: {old}: objective.nft_beta is objective.args.beta; objective.nft_old_decay_max is "
        "objective.args.old_decay_max; objective.dgpo_beta (objective nft does not read it) ignored "
        "(the old names go in a later release; rename them)"
    ]  # awm_ema_beta at its old default is dropped without a word; said once for two loads
    assert (
        load_config("toy_flowgrpo", ["objective.name=dgpo", "objective.dgpo_beta=3"]).objective.args.beta == 3
    )
    with pytest.raises(ConfigError, match="objective.nft_beta and objective.args.beta are one setting"):
        load_config(str(old), ["objective.args.beta=0.5"])


def test_each_objective_reads_its_own_args_and_help_lists_them():
    from diffrl.algorithms.awm import AwmArgs
    from diffrl.algorithms.objective import NoArgs

    assert load_config("toy_awm").objective.args == AwmArgs(old_decay_max=0.3)
    assert load_config("toy_flowgrpo").objective.args == NoArgs()
    saved = load_config("toy_awm", ["objective.args.ema_beta=0.5"])
    assert with_overrides(saved, []).objective.args == saved.objective.args  # a round trip
    lines = describe()
    assert any(line.startswith("  objective.args.huber_power [awm] (float): Power p") for line in lines)
    assert any(line.startswith("  objective.args.kl_threshold [flow_dppo]") for line in lines)

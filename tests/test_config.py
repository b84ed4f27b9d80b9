"""Config loading: shipped configs validate; bad input names file, key and choices."""

from pathlib import Path

import pytest

from diffrl.config import CONFIG_DIR, ConfigError, describe, load_config, resolve_config_path

SHIPPED = sorted(CONFIG_DIR.glob("*.yaml"))


def test_configs_are_shipped():
    assert SHIPPED, "configs/ must ship YAML files"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_config_validates(path):
    cfg = load_config(str(path))
    assert cfg.run_name and cfg.rewards
    assert Path(cfg.data.train_prompts).is_file(), f"{path.name}: train prompt file missing"


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
    with pytest.raises(ConfigError, match=r"sampling\.sde_type.*one of 'sde', 'cps', 'dance', 'ode'"):
        load_config(_write(tmp_path, "sampling:\n  sde_type: euler\n"))


def test_overrides_apply_with_yaml_types(tmp_path):
    cfg = load_config(_write(tmp_path, "run_name: x\n"), ["train.max_steps=7", "optim.lr=1e-5",
                                                          "model.lora.target_modules=[to_q, to_k]"])
    assert cfg.train.max_steps == 7 and cfg.optim.lr == pytest.approx(1e-5)
    assert cfg.model.lora.target_modules == ["to_q", "to_k"]


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


def test_invalid_yaml_names_file(tmp_path):
    path = _write(tmp_path, "train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_every_field_has_help():
    lines = describe()
    assert len(lines) > 40
    assert all(line.split(": ", 1)[1].strip() for line in lines), "a config field lacks a help text"

"""The one registry helper behind rewards, model families, rollout strategies and objectives."""

import pytest

import rewards
from diffrl import models
from diffrl.algorithms import available_objectives, get_objective
from diffrl.sampling import get_strategy
from rewards.registry import Registry


def test_lazy_targets_import_on_first_use_and_objects_pass_through():
    reg = Registry("widget", {"path": "os.path:join", "direct": len})
    assert reg.get("direct") is len
    import os.path

    assert reg.get("path") is os.path.join
    assert reg.available() == ["direct", "path"] and "path" in reg
    reg.unregister("path")
    assert "path" not in reg


@pytest.mark.parametrize(
    "lookup, typo, suggestion, kind",
    [
        (rewards.build, "pickscor", "pickscore", "reward"),
        (models.adapter_class, "flx", "flux", "model family"),
        (get_strategy, "treee", "tree", "rollout strategy"),
        (get_objective, "nf", "nft", "objective"),
    ],
)
def test_every_registry_names_the_closest_name_and_all_valid_ones(lookup, typo, suggestion, kind):
    with pytest.raises((KeyError, ValueError)) as err:
        lookup(typo)
    message = str(err.value)
    assert message.startswith(f"unknown {kind} '{typo}'. Did you mean '{suggestion}'? Valid ")
    assert suggestion in message.split("Valid", 1)[1]


def test_objectives_declare_what_they_train_on():
    assert available_objectives() == ["awm", "dgpo", "flow_dppo", "flow_grpo", "grpo_guard", "nft", "rlcm"]
    declared = {
        name: (o.trains_on, o.needs_old_policy, o.forward_process, o.whole_groups)
        for name in available_objectives()
        for o in [get_objective(name)]
    }
    assert declared == {
        "flow_grpo": ("transitions", False, False, False),
        "rlcm": ("transitions", False, False, False),
        "grpo_guard": ("transitions", False, False, False),
        "flow_dppo": ("transitions", False, False, False),
        "nft": ("clean_samples", True, True, False),
        "awm": ("clean_samples", True, True, False),  # its EMA anchor is the old policy
        "dgpo": ("clean_samples", False, True, True),
    }

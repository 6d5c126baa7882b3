"""Every unknown name is refused with the closest known names (nest_fx.common.names.close_matches)."""

import pytest

from nest_fx.cluster import Cluster, ClusterError, load_cluster
from nest_fx.common.errors import ModelError
from nest_fx.common.names import close_matches
from nest_fx.models.plain import parse_plain
from nest_fx.models.zoo import get_config
from nest_fx.plan import PlanError, uniform_plan
from nest_fx.plan.constraints import Constraints, ConstraintError


def test_close_matches_lists_the_nearest_names_or_nothing():
    assert close_matches("llama2-7", ["llama2-7b", "gpt3-175b"]) == " (close matches: llama2-7b)"
    assert close_matches("zzz", ["llama2-7b"]) == ""
    assert close_matches(3, ["3"]) == " (close matches: 3)"  # any value a user file may hold


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: get_config("llama2-7"), ModelError, r"unknown model 'llama2-7' \(close matches: llama2-7b"),
        (lambda: get_config("lama:hidden=8"), ModelError, r"unknown model family 'lama' .*\(close matches: llama\)"),
        (lambda: parse_plain("mpl:in=4"), ModelError, r"unknown plain model 'mpl' \(close matches: mlp\)"),
        (
            lambda: load_cluster("dgx-a10:8"),
            ClusterError,
            r"unknown cluster preset 'dgx-a10' .*\(close matches: dgx-a100",
        ),
        (
            lambda: Cluster.preset("dgx-h10", 8),
            ClusterError,
            r"unknown cluster preset 'dgx-h10' \(close matches: dgx-h100",
        ),
        (lambda: Constraints(schedules=["1f1c"]), ConstraintError, r"'1f1c' is not a schedule \(close matches: 1f1b\)"),
        (lambda: Constraints(recompute=["selectve"]), ConstraintError, r"\(close matches: selective\)"),
        (lambda: Constraints(optimizer="adamm"), ConstraintError, r"got 'adamm' \(close matches: adam, adamw\)"),
        (lambda: Constraints(fix={"tpp": 2}), ConstraintError, r"unknown degree 'tpp' \(close matches: tp, pp"),
        (
            lambda: Constraints.from_dict({"fixx": {}}),
            ConstraintError,
            r"unknown key\(s\) \['fixx'\] \(close matches: fix\)",
        ),
        (lambda: uniform_plan(4, schedule="gpip").validate(), PlanError, r"schedule: 'gpip' \(close matches: gpipe\)"),
    ],
)
def test_unknown_names_come_with_close_matches(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_the_zoo_message_names_what_exists_today():
    with pytest.raises(ModelError) as info:
        get_config("no-such-model")
    text = str(info.value)
    assert "hf:gpt2|llama|mixtral|bert" not in text and "hf:<model_type>" in text and "hf-config:PATH" in text
    assert "mlp:" in text and "close matches" not in text  # nothing close: no empty suggestion

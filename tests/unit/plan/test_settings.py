"""The settings declaration (nest_fx.plan.settings): one declaration per plan setting, from which
the plan's fields and checks, the constraints' vocabulary, the planner's options and the
command-line flags are made."""

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from nest_fx.plan import Plan, StagePlan, uniform_plan
from nest_fx.plan.constraints import ConstraintError, Constraints, parse_assignments, parse_fraction, parse_list
from nest_fx.plan.settings import (
    CHOICES,
    COSTED_FLAGS,
    DEGREES,
    FLAGS,
    OPTIONS,
    PLAN_SETTINGS,
    SEARCHED,
    SETTINGS,
    STAGE_SETTINGS,
    UNSEARCHED,
    Setting,
    add_fields,
    default,
    setting,
)
from nest_fx.plan.setting_flags import add_constraint_flags, constraints_data
from nest_fx.solver.constraints import NEVER_RELAXED
from nest_fx.solver.space import SolverOptions
from repo_root import ROOT


def test_plan_fields_are_the_declared_settings_in_order():
    names = [f.name for f in dataclasses.fields(Plan)]
    assert names == ["stages"] + [s.name for s in PLAN_SETTINGS]
    assert [f.name for f in dataclasses.fields(StagePlan)] == ["start", "end"] + [s.name for s in STAGE_SETTINGS]
    plan = Plan(stages=[StagePlan(0, 4)])
    for s in PLAN_SETTINGS:
        assert getattr(plan, s.name) == default(s.name), s.name


def test_one_spelling_for_every_setting():
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    for short in ("lp", "mbs", "sp", "usable_memory_fraction", "headroom"):
        assert short not in names
    assert set(DEGREES) == {"tp", "pp", "dp", "ep", "cp", "dp_shard"}
    assert set(FLAGS) == {"sequence_parallel", "loss_parallel", "compile", "float8", "async_tp", "pp_shard_grads"}
    assert {s.name for s in OPTIONS} == {
        "precision",
        "kernels",
        "attention_kernel",
        "norm_kernel",
        "loss_kernel",
        "optimizer",
        "optimizer_kernel",
        "allocator_segments",
        "memory_headroom",
        "overlap_tp_comm",
        "overlap_ep_comm",
        "expert_routing",
        "expert_dispatch",
        "stage_outputs",
        "state_buffers",
        "overlap_cp_comm",
        "overlap_grad_sync",
        "overlap_p2p",
    }


def test_constraints_vocabulary_is_made_from_the_declarations():
    names = {f.name for f in dataclasses.fields(Constraints)}
    assert names == {"fix", "min", "max"} | {s.allowed for s in CHOICES} | {s.name for s in OPTIONS}
    with pytest.raises(ConstraintError, match="precision: must be one of"):
        Constraints(precision="fp8")
    c = Constraints(precision="fp32", zero_stages=[1])
    assert ("precision", "--precision fp32") in c.items()
    assert Constraints.from_dict(c.to_dict()) == c


@pytest.mark.parametrize(
    "name, good, bad, message",
    [
        ("precision", "bf16-mixed", "fp16", "use one of"),
        ("zero", 3, 4, "use 0, 1, 2 or 3"),
        ("dp", 2, 0, "must be >= 1"),
        ("schedule", "gpipe", "zigzag", "use one of"),
        ("loss_parallel", True, "yes", "must be true or false"),
    ],
)
def test_each_setting_checks_its_values(name, good, bad, message):
    assert setting(name).check(good) == ""
    assert message in setting(name).check(bad)
    plan = uniform_plan(4, **{name: good})
    plan.validate()
    data = plan.to_dict()
    data[name] = bad
    with pytest.raises(Exception, match=name):
        Plan.from_dict(data)


def test_command_line_flags_come_from_the_declarations():
    p = argparse.ArgumentParser()
    add_constraint_flags(p)
    flags = {a.option_strings[0] for a in p._actions if a.option_strings}
    for s in SETTINGS:
        if s.flag:
            assert s.flag in flags
    args = p.parse_args(
        [
            "--fix",
            "tp=2",
            "--zero",
            "1,2",
            "--precision",
            "fp32",
            "--compile",
            "--memory-headroom",
            "10%",
            "--optimizer",
            "sgd",
            "--schedule",
            "gpipe",
        ]
    )
    data = constraints_data(args, parse_assignments, parse_list, parse_fraction)
    c = Constraints(**data)
    assert c.fix == {"tp": 2, "compile": True} and c.zero_stages == [1, 2] and c.precision == "fp32"
    assert c.memory_headroom == pytest.approx(0.1) and c.optimizer == "sgd" and c.schedules == ["gpipe"]
    with pytest.raises(SystemExit):
        p.parse_args(["--precision", "fp8"])


def test_the_planner_options_are_made_from_the_declarations():
    """SolverOptions has one field per setting with a ``search``, named and defaulted as declared."""
    made = {f.name: f.default for f in dataclasses.fields(SolverOptions)}
    for s in SEARCHED:
        assert made[s.search_name()] == s.search, s.name
    assert {s.search_name() for s in SEARCHED} == {
        "tp_degrees",
        "ep_degrees",
        "cp_degrees",
        "zero_stages",
        "microbatch_sizes",
        "schedules",
        "placements",
        "recompute",
        "loss_parallel",
        "sequence_parallel",
        "compile",
        "float8",
        "async_tp",
        "pp_shard_grads",
        "precision",
        "kernels",
        "attention_kernel",
        "norm_kernel",
        "loss_kernel",
    }
    assert {s.name for s in SETTINGS if s.search is UNSEARCHED and s.role == "degree"} == {"pp", "dp", "dp_shard"}
    # never searched: costed when the user sets them
    assert COSTED_FLAGS == ("compile", "float8", "async_tp", "pp_shard_grads")
    assert {"fix.compile", "fix.float8", "fix.async_tp", "fix.pp_shard_grads", "optimizer", "precision"} <= set(
        NEVER_RELAXED
    )
    assert "memory_headroom" not in NEVER_RELAXED and "fix.sequence_parallel" not in NEVER_RELAXED


def test_a_new_declaration_gets_its_planner_field():
    degree = Setting("xp", int, 1, "a new degree", "degree", minimum=1, search=(1, 2))
    choice = Setting("mode", str, "a", "a new choice", "choice", values=("a", "b"), allowed="modes", search=("a",))
    flag = Setting("turbo", bool, False, "a new flag", "flag", search=False)

    @dataclasses.dataclass
    @add_fields((degree, choice, flag), search=True)
    class Options:
        pass

    assert Options() == Options(xp_degrees=(1, 2), modes=("a",), turbo=False)
    assert [f.type for f in dataclasses.fields(Options)] == ["Sequence[int]", "Sequence[str]", "bool"]


def test_old_plan_files_load():
    folder = os.path.join(ROOT, "examples", "plans")
    files = [f for f in os.listdir(folder) if f.endswith(".json")]
    assert files
    for name in files:
        plan = Plan.load(os.path.join(folder, name))
        assert plan.precision in ("", "fp32", "bf16-mixed", "bf16-true")


def test_the_declarations_import_no_torch():
    code = (
        "import sys, types, os\n"
        "pkg = types.ModuleType('nest_fx'); pkg.__path__ = [os.path.join(sys.argv[1], 'nest_fx')]\n"
        "sys.modules['nest_fx'] = pkg  # a lazy nest_fx/__init__.py\n"
        "import nest_fx.plan, nest_fx.plan.settings, nest_fx.plan.setting_flags, nest_fx.plan.constraints\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'networkx')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, ROOT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

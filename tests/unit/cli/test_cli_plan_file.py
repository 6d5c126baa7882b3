"""Plans record what they were planned for (model spec, cluster, sequence length, precision,
optimizer, global batch); ``simulate`` and ``explain`` use it without flags, a differing flag says
it overrides the plan, and ``plan`` ends with the next step."""

import contextlib
import dataclasses
import io
import json

import pytest
import transformers

from nest_fx.cli import main
from nest_fx.cluster import load_cluster
from nest_fx.models.inputs import PLAN_SEQ_CAP
from nest_fx.plan import Plan, uniform_plan
from nest_fx.plan.constraints import Constraints
from nest_fx.report.plan_file import next_step_lines, plan_inputs
from nest_fx.workload import workload_for_model

MODEL = "llama:hidden=256,layers=4,heads=4,seq=128,vocab=512"  # rotary positions: longer sequences are fine
SEQ = 512  # not the model's own 128


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A plan made with --seq SEQ (and what `plan` printed)."""
    folder = tmp_path_factory.mktemp("planned")
    path = str(folder / "plan.json")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(
            [
                "plan",
                "--model",
                MODEL,
                "--cluster",
                "dgx-a100",
                "--devices",
                "8",
                "--seq",
                str(SEQ),
                "--global-batch",
                "32",
                "--optimizer",
                "sgd",
                "--no-baselines",
                "--quiet",
                "--json",
                path,
            ]
        )
    assert rc == 0
    return path, out.getvalue()


def test_the_plan_file_records_what_it_was_planned_for(planned):
    path, printed = planned
    plan = Plan.load(path)
    assert plan.model == MODEL  # the spec as given
    assert plan.cluster == "dgx-a100:8"  # the preset and the --devices count
    assert plan.seq_len == SEQ and plan.precision == "bf16-mixed"
    assert plan.constraints.optimizer == "sgd" and plan.global_batch == 32
    data = json.load(open(path))
    assert data["seq_len"] == SEQ and data["derived"]["global_batch"] == 32
    assert f"sequence length {SEQ} (--seq); precision bf16-mixed" in printed
    assert f"x {SEQ} tokens" in printed


def test_plan_ends_with_the_next_step(planned):
    path, printed = planned
    tail = printed.rstrip().splitlines()[-7:]
    assert tail[0] == f"next: nest-fx simulate --plan {path}            # step time and memory of each stage"
    assert tail[1].startswith(f"      nest-fx explain {path} --png timeline.png")
    assert tail[2] == "train with it (torchrun --nproc_per_node=8 --standalone train.py):"
    assert f"Plan.load({path!r})" in tail[4] and f"{MODEL}, 32 x {SEQ} tokens per step" in tail[4]
    assert "auto_parallelize(model, batch, plan=plan, global_batch_size=plan.global_batch" in tail[5]
    assert "no plan file written" not in printed


def test_simulate_and_explain_report_the_plans_figures_without_flags(planned, tmp_path, capsys):
    """The issue's example: a plan made with --seq is simulated at that sequence length (it was
    simulated at the model's default, with other figures, before)."""
    path, _ = planned
    plan = Plan.load(path)
    out = tmp_path / "sim.json"
    assert main(["simulate", "--plan", path, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "note:" not in printed
    result = json.loads(out.read_text())["result"]
    assert result["tokens_per_s"] == pytest.approx(plan.predicted["tokens_per_s"], rel=1e-9)
    peak = max(s["memory"]["total"] for s in result["stages"])
    assert peak == pytest.approx(plan.predicted["peak_memory_bytes"], rel=1e-9)

    assert main(["explain", path]) == 0
    text = capsys.readouterr().out
    assert f"global batch 32 x {SEQ} tokens; precision bf16-mixed" in text and "note:" not in text


def test_a_flag_that_differs_from_the_plan_says_it_overrides_it(planned, tmp_path, capsys):
    path, _ = planned
    plan = Plan.load(path)
    out = tmp_path / "sim.json"
    assert main(["simulate", "--plan", path, "--seq", "128", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0] == f"note: --seq 128 overrides the plan's sequence length {SEQ}"
    shorter = json.loads(out.read_text())["result"]
    assert shorter["tokens_per_s"] != pytest.approx(plan.predicted["tokens_per_s"], rel=1e-3)
    # the same value as the plan's: no note
    assert main(["simulate", "--plan", path, "--seq", str(SEQ), "--cluster", "dgx-a100:8", "--model", MODEL]) == 0
    assert "note:" not in capsys.readouterr().out
    assert main(["explain", path, "--cluster", "dgx-a100:16", "--dtype", "fp32"]) == 0
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note:")]
    assert notes == [
        "note: --cluster dgx-a100:16 overrides the plan's cluster dgx-a100:8",
        "note: --dtype fp32 overrides the plan's precision bf16-mixed",
    ]


def test_plan_says_when_no_file_was_written(capsys):
    assert (
        main(["plan", "--model", MODEL, "--cluster", "dgx-a100:8", "--global-batch", "16", "--no-baselines", "--quiet"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "sequence length 128 (the model's; --seq to change)" in printed
    assert "no plan file written: add --json PLAN.json to keep this plan, then" in printed
    assert "nest-fx simulate --plan PLAN.json" in printed


def test_hf_models_plan_at_their_configs_sequence_capped(tmp_path, capsys):
    """An hf-config: model takes its positions as the default sequence (at most PLAN_SEQ_CAP),
    `plan` prints it, and `explain` rebuilds the model from the plan alone."""
    config = transformers.AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=4 * PLAN_SEQ_CAP,
        use_cache=False,
    )
    config.save_pretrained(tmp_path)
    spec = f"hf-config:{tmp_path}"
    path = str(tmp_path / "plan.json")
    assert (
        main(
            [
                "plan",
                "--model",
                spec,
                "--cluster",
                "dgx-a100:8",
                "--global-batch",
                "8",
                "--no-baselines",
                "--quiet",
                "--json",
                path,
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"sequence length {PLAN_SEQ_CAP} (the model config's positions, at most {PLAN_SEQ_CAP}" in printed
    plan = Plan.load(path)
    assert plan.model == spec and plan.seq_len == PLAN_SEQ_CAP
    assert main(["explain", path]) == 0
    assert f"x {PLAN_SEQ_CAP} tokens" in capsys.readouterr().out


def test_hf_default_sequence_is_the_configs_when_shorter():
    cluster = load_cluster("dgx-a100:8")
    short = workload_for_model("hf:qwen2:hidden_size=64,num_hidden_layers=2,max_position_embeddings=256", cluster)
    assert short.dims.seq_len == 256
    given = workload_for_model(
        "hf:qwen2:hidden_size=64,num_hidden_layers=2,max_position_embeddings=256", cluster, seq=64
    )
    assert given.dims.seq_len == 64


def test_a_recorded_model_that_cannot_be_built_names_the_way_out(tmp_path, capsys):
    plan = uniform_plan(6, pp=1, dp=8, model="my-private-model", cluster="dgx-a100:8")
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert main(["explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert "the plan's model 'my-private-model' cannot be built here" in err and "give --model NAME" in err
    assert main(["explain", str(path), "--model", "my-other-model"]) == 2  # a flag's own error stays its own
    err = capsys.readouterr().err
    assert "unknown model 'my-other-model'" in err and "the plan's model" not in err
    plan.model = ""
    plan.save(str(path))
    assert main(["simulate", "--plan", str(path)]) == 2
    assert "the plan does not record its model" in capsys.readouterr().err


def test_plan_inputs_fill_and_name_overrides():
    plan = uniform_plan(4, dp=8, model="llama2-7b", cluster="dgx-a100:8", seq_len=2048, precision="fp32", world_size=8)
    got = plan_inputs(plan, model=None, workload=None, cluster=None, devices=None, seq=None, dtype=None)
    assert (got.model, got.cluster, got.devices, got.seq, got.dtype, got.notes) == (
        "llama2-7b",
        "dgx-a100:8",
        None,
        2048,
        "fp32",
        [],
    )
    got = plan_inputs(plan, model=None, workload=None, cluster="dgx-a100", devices=8, seq=None, dtype="fp32")
    assert got.notes == []  # the same cluster spelled with --devices
    got = plan_inputs(plan, model=None, workload=None, cluster=None, devices=16, seq=None, dtype=None)
    assert (got.cluster, got.devices) == ("dgx-a100", 16)
    assert got.notes == ["--devices 16 overrides the plan's cluster dgx-a100:8"]
    got = plan_inputs(plan, model=None, workload="w.json", cluster=None, devices=None, seq=None, dtype=None)
    assert got.model is None and got.notes == ["--workload w.json replaces the plan's model llama2-7b"]
    unrecorded = uniform_plan(4, dp=8, cluster="dgx-a100:8")  # an older plan file: no seq_len, no model
    got = plan_inputs(unrecorded, model="gpt2", workload=None, cluster=None, devices=None, seq=1024, dtype=None)
    assert (got.model, got.seq, got.notes) == ("gpt2", 1024, [])


def test_next_step_names_the_launch_for_the_plans_world():
    plan = uniform_plan(4, dp=16, model="llama2-7b", seq_len=4096, world_size=16, microbatch_size=2)
    lines = next_step_lines("runs/my plan.json", plan, nproc_per_node=8)
    assert lines[0].startswith("next: nest-fx simulate --plan 'runs/my plan.json'  ")  # quoted for the shell
    assert lines[2] == "train with it (torchrun --nproc_per_node=8 --nnodes=2 train.py):"
    assert "32 x 4096 tokens per step" in lines[4]


def test_a_plan_priced_for_another_system_is_not_offered_for_training():
    plan = uniform_plan(4, dp=16, model="llama2-7b", seq_len=4096, world_size=16, microbatch_size=2)
    for priced in (
        dataclasses.replace(plan, kernels="fused"),
        dataclasses.replace(plan, constraints=Constraints(expert_dispatch="per-rank")),
    ):
        lines = next_step_lines("p.json", priced, nproc_per_node=8)
        assert not any(line.startswith("train with it") for line in lines), lines
        assert lines[-1].startswith("not for training with nest-fx: ") and "fix:" in lines[-1]
    assert any(line.startswith("train with it") for line in next_step_lines("p.json", plan, nproc_per_node=8))

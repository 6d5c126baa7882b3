"""``hf:<model_type>`` for any transformers architecture, ``hf-config:PATH``, the plain models, the
example inputs each takes, and the names kept from before (single process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from nest_fx.cli import main
from nest_fx.common.errors import ModelError
from nest_fx.graph import trace
from nest_fx.models import TransformerConfig, build_any
from nest_fx.models.build import model_example
from nest_fx.models.inputs import make_batch, with_loss_fn

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "name,cls,inputs",
    [
        ("hf:qwen2", "Qwen2ForCausalLM", {"input_ids": (2, 32)}),
        ("hf:t5", "T5ForConditionalGeneration", {"input_ids": (2, 32), "decoder_input_ids": (2, 32)}),
        ("hf:bert:class=BertForSequenceClassification", "BertForSequenceClassification", {"input_ids": (2, 32)}),
        ("hf:vit", "ViTForImageClassification", {"pixel_values": (2, 3, 32, 32)}),
        ("hf:qwen3_moe", "Qwen3MoeForCausalLM", {"input_ids": (2, 32)}),
    ],
)
def test_any_model_type_builds_a_tiny_model_with_its_inputs(name, cls, inputs):
    model, cfg, args, kwargs = build_any(name, batch=2)
    assert type(model).__name__ == cls and args == ()
    assert {k: tuple(v.shape) for k, v in kwargs.items()} == inputs
    assert sum(p.numel() for p in model.parameters()) < 500_000  # shrunk: hidden 64, 2 layers, vocab 128
    assert model.config.model_type == cfg.model_type


def test_overrides_set_config_fields_and_accept_the_spec_aliases():
    model, cfg, _, kwargs = build_any("hf:qwen2:hidden_size=96,num_hidden_layers=3,vocab=256", batch=1)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (96, 3, 256)
    assert len(model.model.layers) == 3 and kwargs["input_ids"].shape == (1, 32)
    _, full, _, _ = build_any("hf:qwen2:shrink=false,num_hidden_layers=1")  # default sizes, on meta
    assert full.hidden_size == transformers.AutoConfig.for_model("qwen2").hidden_size


def test_names_from_before_keep_their_shapes():
    for name in ("hf:gpt2", "hf:llama", "hf:mixtral", "hf:bert", "hf:llama:hidden=32,layers=3,heads=2,seq=16,vocab=64"):
        _, cfg, _, kwargs = build_any(name)
        assert isinstance(cfg, TransformerConfig) and set(kwargs) == {"input_ids"}
    _, cfg, _, _ = build_any("hf:llama2-7b")
    assert (cfg.hidden, cfg.layers) == (4096, 32)


@pytest.mark.parametrize(
    "name,message",
    [
        ("hf:qwen22", r"unknown HuggingFace model type 'qwen22'.*close matches: qwen2"),
        ("hf:qwen2:hiden_size=3", r"Qwen2Config has no field 'hiden_size' \(close matches: hidden_size"),
        ("hf:qwen2:hidden_size=abc", r"cannot parse .*hidden_size=abc': 'abc' is not an integer like its default 4096"),
        ("hf:qwen2:hidden_size", r"bad override 'hidden_size'.*expected key=value"),
        ("hf:bert:class=NoSuchModel", r"class=NoSuchModel: transformers has no model class of that name"),
        ("mlp:layers=1", r"an MLP needs layers >= 2"),
        ("cnn:depth=2", r"bad field 'depth=2'.*\['blocks', 'channels', 'classes', 'image'\]"),
    ],
)
def test_bad_names_say_what_is_wrong(name, message):
    with pytest.raises(ModelError, match=message):
        build_any(name)


def test_hf_config_file_as_given(tmp_path):
    config = transformers.AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=50,
        max_position_embeddings=64,
    )
    config.save_pretrained(tmp_path)
    model, cfg, _, kwargs = build_any(f"hf-config:{tmp_path}", batch=2, seq=8)
    assert type(model).__name__ == "LlamaForCausalLM" and cfg.hidden_size == 32 and cfg.vocab_size == 50
    assert kwargs["input_ids"].shape == (2, 8)
    _, cfg, _, _ = build_any(f"hf-config:{tmp_path / 'config.json'}:num_hidden_layers=1")
    assert cfg.num_hidden_layers == 1 and cfg.hidden_size == 32
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(ModelError, match=r"needs a \"model_type\" string"):
        build_any(f"hf-config:{tmp_path / 'bad.json'}")
    with pytest.raises(ModelError, match=r"cannot read HuggingFace config file"):
        build_any(f"hf-config:{tmp_path / 'missing.json'}")


def test_examples_say_how_each_model_trains():
    model, cfg, _, _ = build_any("hf:t5", device="cpu", dtype=torch.float32)
    example = model_example("hf:t5", model, cfg, batch=4, seq=8)
    assert [s.name for s in example.inputs] == ["input_ids", "decoder_input_ids"] and example.loss == "model"
    inputs, target = make_batch(example, generator=torch.Generator().manual_seed(0))
    assert target is None and inputs["labels"].shape == (4, 8) and int(inputs["labels"].max()) < cfg.vocab_size
    out = model(**inputs)
    assert out.loss.dim() == 0
    vit, vcfg, _, _ = build_any("hf:vit", device="cpu", dtype=torch.float32)
    classify = with_loss_fn(model_example("hf:vit", vit, vcfg, batch=4))
    assert classify.loss == "classify" and classify.target.shape == (4,) and classify.target.high == vcfg.num_labels
    _, ccfg, args, _ = build_any("cnn:channels=8,image=8", batch=3)
    assert args[0].shape == (3, 3, 8, 8) and ccfg.channels == 8


@pytest.mark.slow
def test_hf_mixtral_8x7b_plans_like_the_zoo_model():
    """The workload sees HF Mixtral's stacked experts as expert parameters (divided by ep) and its
    grouped matmuls at their real FLOPs, so it plans on 64 H100s like the zoo model."""
    from nest_fx.cluster import load_cluster
    from nest_fx.solver import SolverOptions, solve
    from nest_fx.workload import workload_for_model

    cluster = load_cluster("dgx-h100:64", None)
    hf = workload_for_model("hf:mixtral-8x7b", cluster)
    zoo = workload_for_model("mixtral-8x7b", cluster)
    block = next(i for i, layer in enumerate(hf.layers) if layer.is_moe)
    for ep in (1, 8):
        assert hf.cost(block, 1, ep).num_params == pytest.approx(zoo.cost(block, 1, ep).num_params, rel=1e-3)
        assert hf.cost(block, 1, ep).expert_params == pytest.approx(zoo.cost(block, 1, ep).expert_params, rel=1e-3)
    assert hf.layers[block].flops_per_sample == pytest.approx(zoo.layers[block].flops_per_sample, rel=0.05)
    found = solve(hf, cluster, 4096, SolverOptions(time_budget=20.0))
    assert found.result.feasible and found.plan.ep > 1


def test_cli_trace_any_model_type_and_one_line_errors(capsys, monkeypatch):
    # ``python -m nest_fx`` (the module entry) in a fresh process; the refusal in this one (a second
    # interpreter start took half this test's time, the same main() answers)
    ok = subprocess.run(
        [sys.executable, "-m", "nest_fx", "trace", "hf:qwen2:hidden_size=64,num_hidden_layers=2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert "model.layers.0 .. 1" in ok.stdout
    monkeypatch.delenv("NEST_FX_DEBUG", raising=False)  # the one line users see, not the debug traceback
    assert main(["trace", "hf:qwen22"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: unknown HuggingFace model type 'qwen22'")


def test_traced_graph_records_inputs_and_expert_modules():
    from nest_fx.cluster import Cluster
    from nest_fx.workload import analytical_workload, dims_from_config

    model, cfg, args, kwargs = build_any("hf:qwen2_moe", batch=2, seq=8)
    graph = trace(model, args, kwargs)
    assert graph.input_names == ["input_ids"]
    assert graph.expert_modules == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    workload = analytical_workload(
        graph, dims_from_config(cfg, seq_len=8), Cluster.preset("cpu-gloo", 4), torch.float32
    )
    block = next(i for i, layer in enumerate(workload.layers) if layer.is_moe)
    stacked = sum(p.numel() for p in model.model.layers[0].mlp.experts.parameters())
    shared = sum(p.numel() for p in model.model.layers[0].mlp.shared_expert.parameters())
    assert shared > 0
    # only the stacked experts are split by expert parallelism; the shared expert stays whole
    assert workload.cost(block, 1, 1).expert_params == stacked
    assert workload.cost(block, 1, 2).expert_params == stacked / 2
    assert workload.cost(block, 1, 1).num_params - workload.cost(block, 1, 2).num_params == stacked / 2

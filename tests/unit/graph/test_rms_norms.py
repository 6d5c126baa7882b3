"""The RMSNorm recognizer (nest_fx/graph/rms_norms.py): which modules F.rms_norm computes.

Accepted: the zoo's, HF Llama/Qwen2/Mistral/T5's, Meta's reference (testing_styles), on CPU or on
meta; torch.nn.RMSNorm as native. Rejected: Gemma's (1 + weight), LayerNorm (with or without a
bias: it subtracts the mean), a norm whose forward uses another epsilon than it declares, modules
with more parameters or another output."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from nest_fx.graph import trace
from nest_fx.graph.rms_norms import MODEL, NATIVE, rms_norm_kind, rms_norm_modules
from nest_fx.models import build_seeded
from nest_fx.models.layers import RMSNorm as ZooRMSNorm
from nest_fx.testing_styles import RMSNorm as MetaRMSNorm
from nest_fx.testing_styles import build_style


class OtherEps(ZooRMSNorm):
    """Declares eps=1e-5 but normalises with 1e-6: only the probe's small rows tell them apart."""

    def forward(self, x):
        norm = x.float().pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
        return (x.float() * norm).type_as(x) * self.weight


class WithBias(ZooRMSNorm):
    def __init__(self, dim):
        super().__init__(dim)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return super().forward(x) + self.bias


class TupleOut(ZooRMSNorm):
    def forward(self, x):
        return super().forward(x), x


D = 32


@pytest.mark.parametrize(
    "module, kind",
    [
        (ZooRMSNorm(D), MODEL),
        (LlamaRMSNorm(D), MODEL),
        (Qwen2RMSNorm(D, eps=1e-5), MODEL),
        (MistralRMSNorm(D), MODEL),
        (T5LayerNorm(D), MODEL),
        (MetaRMSNorm(D), MODEL),
        (nn.RMSNorm(D), NATIVE),
        (nn.RMSNorm(D, eps=1e-5), NATIVE),
        (nn.RMSNorm(D, elementwise_affine=False), ""),
        (GemmaRMSNorm(D), ""),
        (nn.LayerNorm(D), ""),
        (nn.LayerNorm(D, bias=False), ""),
        (OtherEps(D), ""),
        (WithBias(D), ""),
        (TupleOut(D), ""),
        (nn.Linear(D, D, bias=False), ""),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else repr(v),
)
def test_the_recognizer_accepts_what_f_rms_norm_computes(module, kind):
    before = {k: v.clone() for k, v in module.state_dict().items()}
    assert rms_norm_kind(module) == kind
    for k, v in module.state_dict().items():  # the probe ran on a copy
        assert torch.equal(v, before[k])


def test_the_recognizer_probes_a_meta_or_bf16_module_on_a_copy():
    with torch.device("meta"):
        meta = LlamaRMSNorm(D, eps=1e-5)
        gemma = GemmaRMSNorm(D)
    assert rms_norm_kind(meta) == MODEL and rms_norm_kind(gemma) == ""
    assert meta.weight.is_meta
    assert rms_norm_kind(ZooRMSNorm(D).to(torch.bfloat16)) == MODEL


def test_every_norm_of_the_test_models_is_found():
    zoo, _ = build_seeded("llama:hidden=64,layers=2,heads=4,seq=32,vocab=128")
    assert rms_norm_modules(zoo) == {
        "layers.0.attn_norm": MODEL,
        "layers.0.mlp_norm": MODEL,
        "layers.1.attn_norm": MODEL,
        "layers.1.mlp_norm": MODEL,
        "norm": MODEL,
    }
    hf, _ = build_seeded("hf:llama:hidden=64,layers=2,heads=4,kv=2,seq=32,vocab=128")
    assert sorted(rms_norm_modules(hf)) == [
        "model.layers.0.input_layernorm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.norm",
    ]
    assert len(rms_norm_modules(build_style("meta-llama")[0])) == 5
    assert rms_norm_modules(build_style("nanogpt")[0]) == {}  # LayerNorms


def test_the_trace_tags_the_norms_nodes():
    model, _ = build_seeded("llama:hidden=64,layers=2,heads=4,seq=32,vocab=128")
    graph = trace(model, torch.zeros(2, 32, dtype=torch.long))
    tagged = {d["module"] for _, d in graph.graph.nodes(data=True) if d.get("rms_norm") == MODEL}
    assert tagged == set(rms_norm_modules(model))
    # every op of a norm's forward (the fp32 casts, pow, mean, add, rsqrt, the products)
    ops = [d["op"] for _, d in graph.graph.nodes(data=True) if d.get("module") == "layers.0.attn_norm"]
    assert {"pow", "mean", "rsqrt", "mul"} <= set(ops)

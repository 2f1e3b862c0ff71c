"""Tracing: what the eager engine really runs, labelled by provenance, with no per-model code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dooly.core.errors import DoolyError
from dooly.engines import RequestShape, get_engine
from dooly.trace.signature import ModelTrace
from dooly.trace.tracer import overlap_matrix, trace_model

SRC = Path(__file__).resolve().parents[2] / "src" / "dooly"

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}


@pytest.fixture(scope="module")
def tiny_prefill() -> ModelTrace:
    return trace_model(TINY, "prefill", name="tiny")


@pytest.fixture(scope="module")
def tiny_decode() -> ModelTrace:
    return trace_model(TINY, "decode", name="tiny")


def _ops(trace: ModelTrace, name: str) -> list:
    return [r for r in trace.records if r.signature.op == name]


def test_prefill_records_real_kernels_with_request_expressions(tiny_prefill: ModelTrace) -> None:
    mms = _ops(tiny_prefill, "aten.mm.default")
    # q, k, v, o, gate, up, down per layer + lm_head
    assert len(mms) == 7 * 2 + 1
    q = mms[0].signature.inputs
    assert q[0].shape == ("requests*tokens", 64) and q[1].shape == (64, 64)
    assert q[1].stride == (1, 64)  # the transposed weight view the linear kernel really receives
    assert mms[0].module == "model.layers.0.self_attn.q_proj" and mms[0].layer == 0
    # like generate(): only the last position reaches the LM head
    assert mms[-1].signature.inputs[0].shape == ("requests", 64)
    attn = _ops(tiny_prefill, "aten._scaled_dot_product_flash_attention_for_cpu.default")
    assert len(attn) == 2
    # what a real CPU run does: the padding mask is read (all ones), skipped, and sdpa runs causal with
    # grouped-query attention on the 2 KV heads (no repeat_kv, no materialised mask)
    assert [t.shape for t in attn[0].signature.inputs] == [("requests", 4, "tokens", 16)] + [
        ("requests", 2, "tokens", 16)
    ] * 2
    assert attn[0].signature.args.startswith('{"args":[{"tensor":0},{"tensor":1},{"tensor":2},0.0,true]')  # is_causal
    assert any(r.signature.op == "aten._local_scalar_dense.default" for r in tiny_prefill.records)
    assert tiny_prefill.unique()[mms[1].signature] == 4  # k_proj and v_proj of both layers: one signature
    assert tiny_prefill.hints == {"requests": 3, "tokens": 37}
    assert all("kv_len" not in r.signature.symbols() for r in tiny_prefill.records)


def test_decode_attends_over_the_cache(tiny_decode: ModelTrace) -> None:
    attn = _ops(tiny_decode, "aten._scaled_dot_product_flash_attention_for_cpu.default")
    assert len(attn) == 2
    k = attn[0].signature.inputs[1]
    assert "kv_len + 1" in k.shape
    cats = [r for r in _ops(tiny_decode, "aten.cat.default") if "kv_len" in r.signature.symbols()]
    assert len(cats) == 4  # DynamicCache appends k and v in each layer
    assert all("tokens" not in r.signature.symbols() for r in tiny_decode.records)


@pytest.fixture(scope="module")
def tiny_chunk() -> ModelTrace:
    return trace_model(TINY, "chunk", name="tiny")


def test_chunked_prefill_uses_both_symbols(tiny_chunk: ModelTrace) -> None:
    tr = tiny_chunk
    attn = _ops(tr, "aten._scaled_dot_product_flash_attention_for_cpu.default")
    assert len(attn) == 2
    q, k = attn[0].signature.inputs[:2]
    assert q.shape == ("requests", 4, "tokens", 16) and k.shape == ("requests", 4, "kv_len + tokens", 16)
    # a cached prefix needs a real mask, so the engine builds one and (with a mask) repeats the KV heads
    assert len(attn[0].signature.inputs) == 4


def test_config_value_equal_to_the_dummy_request_size_stays_model() -> None:
    # intermediate_size == tokens and num_attention_heads == requests at the dummy values
    cfg = dict(TINY, intermediate_size=37, num_attention_heads=3, num_key_value_heads=3, hidden_size=48)
    tr = trace_model(cfg, "prefill", hints={"requests": 3, "tokens": 37})
    mms = _ops(tr, "aten.mm.default")
    up = [r for r in mms if r.module.endswith("up_proj")][0].signature
    assert up.inputs[0].shape == ("requests*tokens", 48)
    assert up.inputs[1].shape == (48, 37)  # 37 is the MLP width: an int, not "tokens"
    down = [r for r in mms if r.module.endswith("down_proj")][0].signature
    assert down.inputs[0].shape == ("requests*tokens", 37)
    attn = _ops(tr, "aten._scaled_dot_product_flash_attention_for_cpu.default")[0].signature
    assert attn.inputs[0].shape == ("requests", 3, "tokens", 16)  # heads 3 == requests 3, still a constant


def test_mlp_width_changes_only_mlp_signatures(tiny_prefill: ModelTrace) -> None:
    other = trace_model(dict(TINY, intermediate_size=160), "prefill")

    def part(tr: ModelTrace, key: str) -> set:
        return {r.signature for r in tr.records if f".{key}" in r.module}

    a_attn, b_attn = part(tiny_prefill, "self_attn"), part(other, "self_attn")
    a_mlp, b_mlp = part(tiny_prefill, "mlp"), part(other, "mlp")
    assert a_attn and a_attn == b_attn
    assert a_mlp and b_mlp
    a_mm = {s for s in a_mlp if s.op == "aten.mm.default"}
    b_mm = {s for s in b_mlp if s.op == "aten.mm.default"}
    assert len(a_mm) == 2 and not (a_mm & b_mm)  # gate+up share one signature, down another; all differ
    m = overlap_matrix([tiny_prefill, other])
    assert m[0][0] == 1.0 and 0.5 < m[0][1] < 1.0


class _RealOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func.namespace != "prim":
            flat, _ = tree_flatten((args, kwargs))
            seen: dict[int, tuple[int, ...]] = {}
            for t in flat:
                if isinstance(t, torch.Tensor):
                    seen.setdefault(id(t), tuple(t.shape))
            self.ops.append((str(func), list(seen.values())))
        return func(*args, **kwargs)


def traced_and_real_ops(engine, model, trace: ModelTrace):  # type: ignore[no-untyped-def]
    """The trace's ops with their input shapes at its dummy values, and the ops (with input shapes) that a real
    ``engine`` step of ``model`` at those values dispatches. Also used by the vLLM engine's tests."""
    h = trace.hints
    inputs = engine.prepare(model, RequestShape(h["requests"], h.get("tokens", 1), h.get("kv_len", 0)))
    rec = _RealOps()
    with rec:
        engine.forward(model, inputs)
    traced = [(r.signature.op, [s for s, _ in r.signature.concrete(h)[0]]) for r in trace.records]
    return traced, rec.ops


@pytest.mark.parametrize("phase", ["prefill", "decode", "chunk"])
def test_trace_matches_a_real_eager_run(
    phase: str, tiny_prefill: ModelTrace, tiny_decode: ModelTrace, tiny_chunk: ModelTrace
) -> None:
    trace = {"prefill": tiny_prefill, "decode": tiny_decode, "chunk": tiny_chunk}[phase]
    engine = get_engine()
    torch.manual_seed(0)
    model = engine.build_model(TINY)
    traced, real = traced_and_real_ops(engine, model, trace)
    assert [o for o, _ in traced] == [o for o, _ in real]
    assert traced == real


_BASE = {k: v for k, v in TINY.items() if k != "model_type"}
OTHER_ARCHS = {
    # (config, phase): a learned-position-embedding model, a sliding-window + softcapping model decoding past its
    # window, and a mixture of experts
    "opt": (
        {"model_type": "opt", "hidden_size": 64, "ffn_dim": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 128, "word_embed_proj_dim": 64, "max_position_embeddings": 256},
        "prefill",
    ),
    "gemma2": ({**_BASE, "model_type": "gemma2", "head_dim": 16, "sliding_window": 64}, "decode"),
    "mixtral": ({**_BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, "prefill"),
}  # fmt: skip


# gemma2's decode traces four branches (~6-15 s): its every branch is matched to a real run, at sizes inside and at
# the edges of its window, by test_tracer_branches.py::test_each_branch_matches_a_real_run_inside_its_region (the
# same config and phase); here it runs in `make test-all`
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a == "gemma2" else a
                                  for a in sorted(OTHER_ARCHS)])  # fmt: skip
def test_other_architectures_match_a_real_eager_run(arch: str) -> None:
    cfg, phase = OTHER_ARCHS[arch]
    trace = trace_model(cfg, phase)
    engine = get_engine()
    torch.manual_seed(0)
    model = engine.build_model(cfg)
    traced, real = traced_and_real_ops(engine, model, trace)
    # the one known difference: real indexing turns a whole-tensor slice (x[:, 0:]) into one `alias` view,
    # symbolic indexing into no-op slices the recorder drops; neither launches a kernel
    assert traced == [op for op in real if op[0] != "aten.alias.default"]


def test_no_architecture_names_in_tracer_sources() -> None:
    names = r"llama|qwen|mistral|mixtral|gemma|phi|opt|gpt|falcon|bloom|deepseek|olmo|smollm"
    pattern = re.compile(rf"\b({names})[\w.-]*", re.IGNORECASE)
    files = [*sorted((SRC / "trace").glob("*.py")), *sorted((SRC / "engines").glob("*.py"))]
    assert len(files) >= 5
    hits = []
    for f in files:
        for n, line in enumerate(f.read_text().splitlines(), 1):
            for m in pattern.finditer(line):
                hits.append(f"{f.name}:{n}: {m.group(0)}")
    assert not hits, "architecture-specific names in the tracer: " + "; ".join(hits)


def test_bad_phase_and_bad_config_are_clear_errors() -> None:
    with pytest.raises(DoolyError, match="phase"):
        trace_model(TINY, "train")
    with pytest.raises(DoolyError, match="model_type"):
        trace_model({"hidden_size": 8}, "prefill")
    with pytest.raises(DoolyError, match="nonexistent_arch"):
        trace_model({"model_type": "nonexistent_arch"}, "prefill")


# A latent-attention (MLA) model: its rotary embedding runs torch.polar, whose fake kernel fixes the sizes
# unless the recorder computes it symbolically; and a hybrid SSM (mamba2-style mixers + attention) whose chunked
# scan pads the sequence to a multiple of the chunk size (constant_pad_nd with a symbolic pad).
MLA = {**_BASE, "model_type": "deepseek_v2", "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None,
       "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
       "n_shared_experts": 1}  # fmt: skip
HYBRID_SSM = {**_BASE, "model_type": "bamba", "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 1,
              "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 16,
              "attn_layer_indices": [1]}  # fmt: skip


# the hybrid SSM's symbolic scan is the costliest trace here (40-70 s a phase): it runs in `make test-all`
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("arch", "phase"),
    [("mla", "decode"), pytest.param("ssm", "prefill", marks=SLOW), pytest.param("ssm", "decode", marks=SLOW)],
)
def test_latent_attention_and_hybrid_ssm_match_a_real_eager_run(arch: str, phase: str) -> None:
    cfg = {"mla": MLA, "ssm": HYBRID_SSM}[arch]
    trace = trace_model(cfg, phase)
    engine = get_engine()
    torch.manual_seed(0)
    model = engine.build_model(cfg)
    traced, real = traced_and_real_ops(engine, model, trace)
    assert traced == [op for op in real if op[0] != "aten.alias.default"]
    if arch == "ssm":
        # the SSM state is a model constant, the sequence a request size: the padded chunk count is an expression
        pads = [r.signature for r in trace.records if r.signature.op == "aten.constant_pad_nd.default"]
        assert (phase == "prefill") == bool(pads)
        assert all(any("tokens" in str(d) for d in p.inputs[0].shape) for p in pads)


def _shrunk(model_type: str, **extra) -> dict:
    """transformers' default config of `model_type`, shrunk (sub-configs too) so it builds in a moment."""
    from transformers import AutoConfig

    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=16, vocab_size=128)  # fmt: skip
    doc = AutoConfig.for_model(model_type).to_dict()
    for d in (doc, *(v for v in doc.values() if isinstance(v, dict) and "model_type" in v)):
        d.update({k: v for k, v in small.items() if k in d})
        if isinstance(d.get("layer_types"), list):
            d["layer_types"] = d["layer_types"][:2]
    doc.update(extra)
    return doc


def test_a_multimodal_model_traces_without_running_its_weight_init() -> None:
    # gemma3's vision tower initialises weights with a truncated normal, which fake tensors cannot draw
    tr = trace_model(_shrunk("gemma3"), "prefill", engine=get_engine(dtype="float32"))
    assert len(tr.records) > 100


def test_configs_and_models_the_engine_cannot_build_or_run_are_refused_in_one_line() -> None:
    from transformers import AutoConfig

    engine = get_engine(dtype="float32")
    bad = AutoConfig.for_model("ministral").to_dict()
    bad["num_hidden_layers"] = 2  # its layer_types keep the default depth: transformers' validator refuses it
    with pytest.raises(DoolyError, match=r"cannot build a 'ministral' config: StrictDataclass\w+: .*layer_type"):
        trace_model(bad, "prefill", engine=engine)
    # a model whose own code fails on real tensors too (xlnet in bfloat16): one line, not a tracer traceback
    xlnet = {"model_type": "xlnet", "d_model": 64, "n_layer": 2, "n_head": 4, "d_inner": 96, "vocab_size": 128}
    with pytest.raises(DoolyError, match=r"cannot run this model's prefill even on real tensors \(RuntimeError"):
        trace_model(xlnet, "prefill", engine=get_engine(dtype="bfloat16"))


def test_a_model_that_builds_only_on_real_tensors_is_refused_in_one_line(monkeypatch) -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    engine = get_engine(dtype="float32")
    build = engine.build_model

    def reads_a_constant(config, **kw):  # an engine that computes a constant with torch and reads it back
        model = build(config, **kw)
        p = next(model.parameters())
        if isinstance(p, FakeTensor):
            float(torch.ones(2).sum() * p.new_ones(()).sum())  # a value fake tensors do not hold
        return model

    monkeypatch.setattr(engine, "build_model", reads_a_constant)
    with pytest.raises(DoolyError, match=r"builds on real tensors but not on fake ones.* at test_tracer\.py:\d+\)$"):
        trace_model(TINY, "prefill", engine=engine)

    lib = torch.library.Library("dooly_test_nofake", "DEF")  # a compiled kernel with no shape-only version
    lib.define("pack(Tensor x) -> Tensor")
    lib.impl("pack", lambda x: x.clone(), "CPU")

    def packs_a_weight(config, **kw):
        model = build(config, **kw)
        torch.ops.dooly_test_nofake.pack(next(model.parameters()))
        return model

    monkeypatch.setattr(engine, "build_model", packs_a_weight)
    with pytest.raises(DoolyError, match=r"calls dooly_test_nofake\.pack\.default in building the model, .*no fake"):
        trace_model(TINY, "prefill", engine=engine)

"""One rank of a tensor- or pipeline-parallel vLLM replica, traced in one process with vLLM's own parallel layers.

The shards (heads, intermediate size, vocabulary; a stage's layers) come from vLLM's code; each collective is a
``dooly_vllm`` op whose signature is its tensor (bytes) and the group size. A tiny llama keeps each test to seconds.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter

import pytest

# found, not imported: collecting the suite must not pay vLLM's import in every worker
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (the vLLM engine is optional)", allow_module_level=True)

import torch  # noqa: E402
from test_tracer import traced_and_real_ops  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from dooly.core.errors import DoolyError  # noqa: E402
from dooly.engines import get_engine  # noqa: E402
from dooly.trace.tracer import trace_model  # noqa: E402

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "max_position_embeddings": 512}  # fmt: skip
ATTENTION = "dooly_vllm.cpu_attention_with_kv_cache.default"
ALL_REDUCE = "dooly_vllm.all_reduce.default"
ALL_GATHER = "dooly_vllm.all_gather.default"
SEND = "dooly_vllm.send.default"


@pytest.fixture(scope="module")
def tp2():  # type: ignore[no-untyped-def]
    return get_engine("vllm", tp=2)


@pytest.fixture(scope="module")
def traces(tp2):  # type: ignore[no-untyped-def]
    """The prefill of the same model on one device and as rank 0 of two."""
    return trace_model(LLAMA, "prefill", engine=get_engine("vllm")), trace_model(LLAMA, "prefill", engine=tp2)


def _gemms(trace) -> dict[str, tuple[int, int]]:  # type: ignore[no-untyped-def]
    """(N, K) of each linear layer's GEMM by module: oneDNN's (out, x, handle) or torch's mm(x, w^T)."""
    out = {}
    for r in trace.kernels():
        s = r.signature
        if s.op == "dooly_vllm.onednn_mm.default":
            out[r.module] = (s.inputs[0].shape[-1], s.inputs[1].shape[-1])
        elif s.op == "aten.mm.default":
            out[r.module] = (s.inputs[1].shape[-1], s.inputs[0].shape[-1])
    return out


def test_column_layers_split_their_outputs_and_row_layers_their_inputs(traces) -> None:  # type: ignore[no-untyped-def]
    one, two = (_gemms(t) for t in traces)
    assert one.keys() == two.keys()
    for module, (n, k) in one.items():
        if module.endswith(("qkv_proj", "gate_up_proj", "logits_processor")):  # column parallel (the vocab too)
            assert two[module] == (n // 2, k), module
        elif module.endswith(("o_proj", "down_proj")):  # row parallel
            assert two[module] == (n, k // 2), module
    assert one["model.layers.0.self_attn.qkv_proj"] == (4 * 32 + 2 * 2 * 32, 128)


def test_a_rank_holds_half_of_the_attention_heads(traces) -> None:  # type: ignore[no-untyped-def]
    (q1, k1, *_), (q2, k2, *_) = (next(r.signature.inputs for r in t.records if r.signature.op == ATTENTION)
                                  for t in traces)  # fmt: skip
    assert (q1.shape[1], k1.shape[1]) == (4, 2)  # query heads, KV heads (the paged cache's)
    assert (q2.shape[1], k2.shape[1]) == (2, 1)


def test_each_layer_all_reduces_after_attention_and_mlp(traces) -> None:  # type: ignore[no-untyped-def]
    one, two = traces
    assert not [r for r in one.records if r.signature.op.startswith("dooly_vllm.all_")]
    reduces = [r for r in two.records if r.signature.op == ALL_REDUCE]
    by_layer = Counter(r.module.rsplit(".", 1)[-1] for r in reduces if r.layer is not None)
    assert by_layer == {"o_proj": 2, "down_proj": 2}  # two layers, one after each row-parallel layer
    # the vocabulary-parallel embedding masks the ids outside its shard (vLLM's compiled function, one op), looks
    # up the rest and sums the shards; the logits are gathered
    embed = [r.signature.op.split(".")[1] for r in two.kernels() if r.module == "model.embed_tokens"]
    assert embed == ["vocab_parallel_mask", "embedding", "masked_fill_", "all_reduce"]
    gather = next(r.signature for r in two.records if r.signature.op == ALL_GATHER)
    assert json.loads(gather.args)["args"][1:] == [1, 2]  # along the vocabulary, over two ranks
    for r in reduces:
        (x,) = r.signature.inputs
        # a signature over the bytes moved (a function of the tokens) and the group size
        assert x.shape == ("requests*tokens", 128) and json.loads(r.signature.args)["args"][1] == 2
    assert len({r.signature for r in reduces}) == 1  # every all-reduce of the step is one signature


def test_the_rank_runs_the_ops_it_traced(tp2) -> None:  # type: ignore[no-untyped-def]
    trace = trace_model(LLAMA, "decode", engine=tp2)
    assert trace.meta["tensor_parallel_size"] == 2 and tp2.trace_context == "vllm/cpu/tp2"
    torch.manual_seed(0)
    traced, real = traced_and_real_ops(tp2, tp2.build_model(LLAMA), trace)
    kernels = [op for op in real if op[0] != "aten.alias.default"]  # as in test_vllm_engine: a view either side
    assert [op for op in traced if op[0] != "aten.alias.default"] == kernels


def test_heads_that_do_not_divide_are_refused_in_one_line(tp2) -> None:  # type: ignore[no-untyped-def]
    cfg = {**LLAMA, "hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 3}
    with pytest.raises(DoolyError, match=r"attention heads \(3\) must be divisible by tensor parallel size \(2\)") as e:
        trace_model(cfg, "decode", engine=tp2)
    assert "\n" not in str(e.value)


def test_a_moe_rank_splits_its_experts_and_all_reduces_their_sum(tp2) -> None:  # type: ignore[no-untyped-def]
    moe = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
    trace = trace_model(moe, "decode", engine=tp2)
    experts = [r for r in trace.records if r.module == "model.layers.0.block_sparse_moe.experts"]
    fused = next(r.signature for r in experts if r.signature.op == "_C.cpu_fused_moe.default")
    assert fused.inputs[2].shape == (4, 2 * 256 // 2, 128)  # gate and up projections of half the intermediate size
    assert experts[-1].signature.op == ALL_REDUCE


def test_the_first_pipeline_stage_holds_half_the_layers_and_sends_its_hidden_states() -> None:
    engine = get_engine("vllm", pp=2)
    trace = trace_model({**LLAMA, "num_hidden_layers": 4}, "decode", engine=engine)
    assert {r.layer for r in trace.records if r.layer is not None} == {0, 1}
    kernels = trace.kernels()
    # the step ends in sending the hidden states and the residual on: no final norm, no logits
    assert [r.signature.op for r in kernels[-2:]] == [SEND, SEND]
    assert all(r.signature.inputs[0].shape == ("requests", 128) for r in kernels[-2:])
    assert not [r for r in kernels if r.module in ("model.norm", "logits_processor")]
    assert engine.trace_context == "vllm/cpu/pp2s0"


def test_the_last_stage_receives_the_hidden_states_and_computes_the_logits() -> None:
    engine = get_engine("vllm", tp=2, pp=2, pp_stage=1)  # rank 0 of the second stage's tensor-parallel group
    cfg = {**LLAMA, "num_hidden_layers": 4}
    trace = trace_model(cfg, "prefill", engine=engine)
    assert engine.trace_context == "vllm/cpu/tp2/pp2s1"
    assert {r.layer for r in trace.records if r.layer is not None} == {2, 3}
    kernels = trace.kernels()
    assert [r.signature.op for r in kernels[:2]] == ["dooly_vllm.recv.default"] * 2  # hidden states and residual
    assert kernels[0].signature.inputs[0].shape == ("requests*tokens", 128)
    assert [r.signature.op for r in kernels[-2:]] == [ALL_GATHER, "aten.argmax.default"]  # the logits, sampled
    assert not [r for r in kernels if r.module == "model.embed_tokens"]
    torch.manual_seed(0)
    traced, real = traced_and_real_ops(engine, engine.build_model(cfg), trace)
    assert [op for op in traced if op[0] != "aten.alias.default"] == [
        op for op in real if op[0] != "aten.alias.default"
    ]


def test_only_the_vllm_engine_takes_a_parallel_layout() -> None:
    with pytest.raises(DoolyError, match="engine hf-eager: no tensor or pipeline parallelism"):
        get_engine("hf-eager", tp=2)
    with pytest.raises(DoolyError, match="pipeline stage 2 of 2 stages"):
        get_engine("vllm", pp=2, pp_stage=2)


def test_trace_cli_takes_the_tensor_parallel_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dooly.cli import app

    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    res = CliRunner().invoke(app, ["trace", str(path), "--engine", "vllm", "--tp", "2", "--phase", "decode", "--ops"])
    assert res.exit_code == 0, res.output
    assert "vllm/cpu/tp2" in res.output and "dooly_vllm.all_reduce" in res.output


def test_a_hybrid_ssm_rank_runs_the_ops_it_traced(tp2) -> None:  # type: ignore[no-untyped-def]
    # the Mamba2 mixer replaces its parameters' weight loaders while it is built at TP > 1 (kept on fake tensors
    # too), and its state cache is unpacked by the rank's shard sizes when bound
    cfg = {"model_type": "falcon_h1", "vocab_size": 128, "hidden_size": 128, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
           "max_position_embeddings": 512}  # fmt: skip
    trace = trace_model(cfg, "prefill", engine=tp2)
    assert Counter(r.signature.op for r in trace.records)[ALL_REDUCE] > 2 * 2  # the mixers' too
    torch.manual_seed(0)
    traced, real = traced_and_real_ops(tp2, tp2.build_model(cfg), trace)
    kernels = [op for op in real if op[0] != "aten.alias.default"]
    assert [op for op in traced if op[0] != "aten.alias.default"] == kernels


def test_the_trace_cache_keeps_a_rank_apart_from_the_whole_model(tp2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dooly.db.store import ProfileStore
    from dooly.profile.traces import model_traces

    with ProfileStore(tmp_path / "p.db") as store:
        for _ in range(2):  # traced, then read back from the cache
            one = model_traces("tiny", LLAMA, get_engine("vllm"), store)["decode"]
            two = model_traces("tiny", LLAMA, tp2, store)["decode"]
            assert not [r for r in one.records if r.signature.op == ALL_REDUCE]
            assert [r for r in two.records if r.signature.op == ALL_REDUCE]

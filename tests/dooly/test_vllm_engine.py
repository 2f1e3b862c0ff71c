"""The vLLM engine: vLLM's own model, KV cache, attention metadata and CPU kernels, traced and profiled like HF's.

Skipped where vllm is not importable (it is an optional, heavy install). One module-wide engine and a two-layer
model keep the whole file within about a minute (importing vLLM alone takes ~30 s here).
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
from dooly.core.zoo import resolve_model  # noqa: E402
from dooly.db.store import ProfileStore  # noqa: E402
from dooly.engines import RequestShape, get_engine  # noqa: E402
from dooly.profile import GridSpec, make_plan, run_plan  # noqa: E402
from dooly.profile.runner import _Pool  # noqa: E402
from dooly.trace.tracer import trace_model  # noqa: E402

ATTENTION = "dooly_vllm.cpu_attention_with_kv_cache.default"


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    return get_engine("vllm")


@pytest.fixture(scope="module")
def config() -> dict:
    _, cfg = resolve_model("smollm2-135m")
    return {**cfg, "num_hidden_layers": 2}  # per-layer shapes unchanged, two layers: fast and still repeated


@pytest.fixture(scope="module")
def model(engine, config):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return engine.build_model(config)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_trace_is_the_real_step_op_by_op(engine, config, model, phase) -> None:  # type: ignore[no-untyped-def]
    trace = trace_model(config, phase, engine=engine)
    assert trace.engine == "vllm/cpu" and not trace.guards
    traced, real = traced_and_real_ops(engine, model, trace)
    # as with HF, a whole-tensor slice is an `alias` view (no kernel) on one side and a dropped no-op on the other
    # (here the logits' vocabulary slice, which symbolic sizes cannot prove whole)
    kernels = [op for op in traced if op[0] != "aten.alias.default"]
    assert kernels == [op for op in real if op[0] != "aten.alias.default"]
    ops = Counter(r.signature.op for r in trace.records)
    # vLLM's own kernels, one call per layer (attention, KV-cache write, rotary) or per linear layer (oneDNN)
    assert ops[ATTENTION] == ops["dooly_vllm.cpu_attn_reshape_and_cache.default"] == 2
    # every linear layer is a oneDNN GEMM, or torch's where oneDNN cannot build it (bf16 without AVX-512/AMX),
    # as in the real model (compared above)
    gemms = ops["dooly_vllm.onednn_mm.default"] or ops["aten.mm.default"]
    assert ops["_C.rotary_embedding.default"] == 2 and gemms == 2 * 4 + 1
    attn = next(r.signature for r in trace.records if r.signature.op == ATTENTION)
    # the paged cache and the batch are request sizes: labelled, not frozen at the dummy values
    assert attn.symbols() == ({"requests", "tokens"} if phase == "prefill" else {"requests", "kv_len"})


def test_a_step_runs_on_the_cache_its_prefill_filled_and_grows_a_block(engine, model) -> None:  # type: ignore[no-untyped-def]
    block = model._dooly_vllm.groups[0][0].block_size
    inputs = engine.prepare(model, RequestShape.decode(2, block - 1))  # the step fills the last slot of a block
    cache = next(iter(inputs["kv_caches"].values()))
    assert cache.shape[0] == 2 and cache.abs().sum() > 0  # one block per sequence, written by the prefill
    nxt = engine.forward(model, inputs)
    assert nxt.shape == (2,)
    step = engine.advance(inputs, nxt)  # the next token needs a second block per sequence
    grown = next(iter(step["kv_caches"].values()))
    assert grown.shape[0] == 4 and step["shape"] == (2, 1, block)
    assert torch.equal(grown[step["block_tables"][0][:, 0].long()], cache[inputs["block_tables"][0][:, 0].long()])
    assert engine.forward(model, step).shape == (2,)


def test_a_mixed_step_runs_decodes_and_a_later_prefill_chunk_in_one_forward(engine, model) -> None:  # type: ignore[no-untyped-def]
    from dooly.core.batch import Batch

    inputs = engine.prepare_batch(model, Batch(prefill=((7, 130),), decode=(5, 300)))
    assert inputs["input_ids"].shape == (2 + 7,)  # one token per decode, then the chunk's new tokens
    assert inputs["positions"].tolist() == [5, 300, *range(130, 137)]
    assert inputs["logits_indices"].tolist() == [0, 1, 8]  # each request's last token
    pool = _Pool()
    with pool:
        nxt = engine.forward(model, inputs)
    assert nxt.shape == (3,)
    call = next(iter(pool.calls[ATTENTION].values()))
    seq_lens = pool.call_inputs(ATTENTION, [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in call])[5]
    assert seq_lens.tolist() == [6, 301, 137]  # attention saw each request's cached prefix
    with pytest.raises(DoolyError, match="empty batch"):
        engine.prepare_batch(model, Batch())


def test_the_context_pool_hands_an_op_its_own_call_inputs(engine, model) -> None:  # type: ignore[no-untyped-def]
    inputs = engine.prepare(model, RequestShape.decode(3, 40))
    pool = _Pool()
    with pool:
        engine.forward(model, inputs)
    call = next(iter(pool.calls[ATTENTION].values()))
    layouts = [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in call]
    found = pool.call_inputs(ATTENTION, layouts)
    seq_lens = found[5]
    assert seq_lens.tolist() == [41, 41, 41]  # the real lengths, not a fresh tensor of zeros


def test_profiling_times_every_signature_on_vllm_kernels(engine, config, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with ProfileStore(tmp_path / "p.db") as store:
        plan = make_plan([config], store, engine, GridSpec((1, 2), (4, 16), (1, 2), (8, 130, 2050)), threads=1)
        stats = run_plan(plan, store, engine, threads=1)
        assert stats["failed"] == 0 and stats["points"] == plan.todo_points > 0
        assert stats["completed"] == len(plan.grid_size)
        attn = [k for k, v in plan.models[0].needs["decode"].items() if v.signature.op == ATTENTION]
        pts = {(int(p["requests"]), int(p["kv_len"])): m.median_s for p, m in store.points(plan.ctx, attn[0])}
    # every length was timed on vLLM's kernel, over one block, two and many (no timing is compared here: a busy
    # machine may reorder them; the bench scripts compare)
    assert {kv for _, kv in pts} == {8, 130, 2050} and min(pts.values()) > 0


def test_trace_cli_takes_the_engine_by_name(config, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dooly.cli import app

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    res = CliRunner().invoke(app, ["trace", str(path), "--engine", "vllm", "--phase", "decode"])
    assert res.exit_code == 0, res.output
    assert "vllm/cpu" in res.output


def test_only_the_cpu_backend_is_wired() -> None:
    with pytest.raises(DoolyError, match="only vLLM's CPU backend"):
        get_engine("vllm", device="cuda")


def test_a_moe_model_builds_after_a_dense_one(engine, config, model) -> None:  # type: ignore[no-untyped-def]
    # vLLM makes its expert-parallel group only when the process's first model is a MoE one
    assert model is not None  # the dense model of this module is built first
    moe = {**config, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
           "num_experts_per_tok": 2}  # fmt: skip
    tr = trace_model(moe, "prefill", engine=engine)
    assert any("experts" in r.module for r in tr.records)


def test_layers_are_bound_by_vllm_layer_names(engine) -> None:  # type: ignore[no-untyped-def]
    # hrm_text holds its attention under `attn_per_step.N` while the layer registers as `...self_attn.attn`: the
    # step's KV caches and metadata go by vLLM's name, which its attention looks up
    cfg = {"model_type": "hrm_text", "vocab_size": 128, "hidden_size": 128, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32,
           "max_position_embeddings": 512}  # fmt: skip
    tr = trace_model(cfg, "prefill", engine=engine)
    assert any(r.signature.op == ATTENTION for r in tr.records)


LATENT = {"model_type": "deepseek_v3", "vocab_size": 128, "hidden_size": 128, "intermediate_size": 96,
          "num_hidden_layers": 1, "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
          "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
          "q_lora_rank": None, "max_position_embeddings": 512}  # fmt: skip


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_latent_attention_model_traces_as_its_real_step(engine, phase) -> None:  # type: ignore[no-untyped-def]
    # DeepSeek-style MLA: vLLM's CPU backend runs it as an opaque op on the new tokens only (whose prefill and
    # metadata loop over the requests in Python); the trace holds dooly's op around it, which also takes the cache
    # and the lengths, so the request sizes (the context length too) are labelled in its signature
    trace = trace_model(LATENT, phase, engine=engine)
    assert not trace.guards
    torch.manual_seed(0)
    traced, real = traced_and_real_ops(engine, engine.build_model(LATENT), trace)
    kernels = [op for op in real if op[0] != "aten.alias.default"]
    assert [op for op in traced if op[0] != "aten.alias.default"] == kernels
    attn = next(r.signature for r in trace.records if r.signature.op == "dooly_vllm.mla_attention.default")
    assert attn.symbols() == ({"requests", "tokens"} if phase == "prefill" else {"requests", "kv_len"})


@pytest.mark.slow
def test_latent_attention_is_profiled_at_each_context_length(engine, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # the point of dooly's op around vLLM's: a decode over 2050 cached tokens is timed apart from one over 8
    mla = "dooly_vllm.mla_attention.default"
    cfg = {**LATENT, "max_position_embeddings": 4096}  # the grid stops at the model's context
    with ProfileStore(tmp_path / "p.db") as store:
        plan = make_plan([cfg], store, engine, GridSpec((2,), (4,), (1, 2), (8, 2050)), threads=1)
        stats = run_plan(plan, store, engine, threads=1)
        assert stats["failed"] == 0
        sig = next(k for k, v in plan.models[0].needs["decode"].items() if v.signature.op == mla)
        pts = {int(p["kv_len"]): m.median_s for p, m in store.points(plan.ctx, sig) if int(p["requests"]) == 2}
    assert set(pts) == {8, 2050} and min(pts.values()) > 0  # each length timed on its own (no timing compared)


def test_a_latent_head_size_without_a_cpu_kernel_is_refused_in_one_line(engine) -> None:  # type: ignore[no-untyped-def]
    # vLLM builds it, but its CPU MLA decode kernel exists for 512 + 64 only
    with pytest.raises(DoolyError, match="head sizes") as err:
        engine.build_model({**LATENT, "kv_lora_rank": 16, "qk_rope_head_dim": 8})
    assert "\n" not in str(err.value)


def test_the_conv_weight_prepack_fake_has_the_real_layout(engine) -> None:  # type: ignore[no-untyped-def]
    import vllm._custom_ops as ops
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert engine is not None  # its construction registers the fake
    if not hasattr(torch.ops._C, "causal_conv1d_weight_pack"):
        pytest.skip("this vLLM build has no conv-weight prepack")
    w = torch.randn(96, 4, dtype=torch.bfloat16)
    try:
        real = ops.causal_conv1d_weight_pack(w)
    except RuntimeError as exc:  # a CPU without its kernel (vLLM never calls it there)
        pytest.skip(str(exc))
    with FakeTensorMode() as mode:
        fake = ops.causal_conv1d_weight_pack(mode.from_tensor(w))
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


HYBRID = {
    "model_type": "falcon_h1",
    "vocab_size": 128,
    "hidden_size": 128,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}


def test_a_hybrid_ssm_model_runs_steps_longer_than_a_state_block(engine) -> None:  # type: ignore[no-untyped-def]
    # with prefix caching on (vLLM's default) an SSM's state blocks follow the attention pages: a request holds
    # one per block of tokens, and the step's state is the one of its last token's block
    model = engine.build_model(HYBRID)
    spec = next(s for s, _, _ in model._dooly_vllm.groups if type(s).__name__ == "MambaSpec")
    block = spec.block_size
    inputs = engine.prepare(model, RequestShape(2, block + 3, block + 5))  # a chunk past a cached block
    assert engine.forward(model, inputs).shape == (2,)
    step = engine.advance(inputs, engine.forward(model, inputs))  # a decode, with the SSM's decode kernels
    assert engine.forward(model, step).shape == (2,)


def test_a_constant_vllm_builds_on_the_meta_device_traces(engine) -> None:  # type: ignore[no-untyped-def]
    # vLLM's Transformers backend builds transformers' model on the meta device, where a torch.tensor(x) constant
    # (here an embedding scale) stays a plain meta tensor; the trace takes it in as a fake one
    cfg = {
        "model_type": "vaultgemma",
        "vocab_size": 128,
        "hidden_size": 128,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "layer_types": ["full_attention"],
    }
    trace = trace_model(cfg, "prefill", engine=engine)
    traced, real = traced_and_real_ops(engine, engine.build_model(cfg), trace)
    assert [op for op in traced if op[0] != "aten.alias.default"] == [
        op for op in real if op[0] != "aten.alias.default"
    ]


def test_values_vllm_reads_back_while_building_are_refused_in_one_line(engine) -> None:  # type: ignore[no-untyped-def]
    # vLLM's CPU attention turns the ALiBi slopes the model computes with torch into a Python list
    cfg = {"model_type": "bloom", "vocab_size": 128, "hidden_size": 128, "n_head": 4, "n_layer": 1}
    with pytest.raises(DoolyError, match="reads values it computes with torch back into Python") as err:
        trace_model(cfg, "prefill", engine=engine)
    assert "\n" not in str(err.value)


def test_a_metadata_builder_reading_lengths_as_values_is_refused_in_one_line(engine) -> None:  # type: ignore[no-untyped-def]
    # vLLM's chunked local attention splits each request into virtual batches with numpy, from its lengths' values
    cfg = {
        "model_type": "llama4_text",
        "vocab_size": 128,
        "hidden_size": 128,
        "intermediate_size": 96,
        "intermediate_size_mlp": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "moe_layers": [0],
        "no_rope_layers": [1],
        "layer_types": ["chunked_attention"],
    }
    with pytest.raises(DoolyError, match="reads the requests' lengths as values") as err:
        trace_model(cfg, "prefill", engine=engine)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_run_leaves_no_temporary_directory(config, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A `dooly trace --engine vllm` in its own process (vLLM's start-up again: slow) removes its model and process
    group directories at exit, and first sweeps those a killed run left."""
    import os
    import subprocess
    import sys

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp / f"dooly-vllm-{int(dead.stdout)}-killed").mkdir()  # a killed run's, its process gone
    (tmp / f"dooly-vllm-dist-{int(dead.stdout)}-killed").mkdir()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "dooly", "trace", str(path), "--engine", "vllm", "--phase", "prefill"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert [p.name for p in tmp.glob("dooly-*")] == []

"""Hand-written traces of tiny llama configs, so profiler/predictor tests need not run the (slow) tracer.

The signatures are spelled exactly as the tracer writes them (see dooly.trace.signature); they are put in the
store's trace cache under the key the profiler looks up, so ``make_plan`` finds them instead of tracing.
"""

from __future__ import annotations

from pathlib import Path

from dooly.db.store import ProfileStore
from dooly.profile import trace_cache_key
from dooly.trace.signature import ModelTrace, OpRecord, Signature, TensorSpec, canonical_json
from dooly.trace.tracer import config_hash

ENGINE = "hf-eager/cpu"


def tiny_config(name: str, intermediate: int = 128, layers: int = 2) -> dict:
    return {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 2048,
        "_name_or_path": name,
    }  # fmt: skip


def _sig(op: str, shapes: list[tuple], args: list, kwargs: dict | None = None, dtype: str = "bfloat16") -> Signature:
    specs = tuple(TensorSpec(tuple(s), d if isinstance(d, str) else dtype) for s, d in shapes)
    return Signature(op, specs, canonical_json({"args": args, "kwargs": kwargs or {}}), ENGINE)


def T(i: int) -> dict:
    return {"tensor": i}


def tiny_traces(cfg: dict) -> dict[str, ModelTrace]:
    """A prefill and a decode trace with the ops that dominate a llama pass (per layer, with multiplicities)."""
    inter, layers = cfg["intermediate_size"], cfg["num_hidden_layers"]
    pre_layer = [
        _sig("aten.linear.default", [(("requests", "tokens", 64), 0), ((64, 64), 0)], [T(0), T(1)]),
        _sig("aten.linear.default", [(("requests", "tokens", 64), 0), ((inter, 64), 0)], [T(0), T(1)]),
        _sig("aten.linear.default", [(("requests", "tokens", inter), 0), ((64, inter), 0)], [T(0), T(1)]),
        _sig("aten.silu.default", [(("requests", "tokens", inter), 0)], [T(0)]),
        _sig(
            "aten.scaled_dot_product_attention.default",
            [(("requests", 4, "tokens", 16), 0)] * 3,
            [T(0), T(1), T(2)],
            {"is_causal": True},
        ),
    ]
    dec_layer = [
        _sig("aten.linear.default", [(("requests", 1, 64), 0), ((64, 64), 0)], [T(0), T(1)]),
        _sig("aten.linear.default", [(("requests", 1, 64), 0), ((inter, 64), 0)], [T(0), T(1)]),
        _sig("aten.linear.default", [(("requests", 1, inter), 0), ((64, inter), 0)], [T(0), T(1)]),
        _sig(
            "aten.cat.default", [(("requests", 2, "kv_len", 16), 0), (("requests", 2, 1, 16), 0)], [[T(0), T(1)], -2]
        ),  # fmt: skip
        _sig(
            "aten.scaled_dot_product_attention.default",
            [(("requests", 4, 1, 16), 0)] + [(("requests", 4, "kv_len + 1", 16), 0)] * 2,
            [T(0), T(1), T(2)],
        ),
        # a kwargs dict whose only key is a tag name: must not be decoded as a tag itself
        _sig("aten.ones.default", [], [[{"sym": "requests"}, {"sym": "kv_len + 1"}]], {"dtype": {"dtype": "bool"}}),
    ]
    emb = {
        "prefill": _sig("aten.embedding.default", [((256, 64), 0), (("requests", "tokens"), "int64")], [T(0), T(1)]),
        "decode": _sig("aten.embedding.default", [((256, 64), 0), (("requests", 1), "int64")], [T(0), T(1)]),
    }
    out = {}
    for phase, per_layer in (("prefill", pre_layer), ("decode", dec_layer)):
        recs = [OpRecord(emb[phase], 0, "model.embed_tokens", None)]
        for layer in range(layers):
            for s in per_layer:
                recs.append(OpRecord(s, len(recs), f"model.layers.{layer}", layer))
        out[phase] = ModelTrace(cfg["_name_or_path"], config_hash(cfg), phase, ENGINE, recs)
    return out


def seed_traces(db: Path, cfg: dict, dtype: str = "bfloat16") -> dict[str, ModelTrace]:
    """Put the tiny traces in the store's trace cache (the key ``dooly.profile.model_traces`` reads)."""
    traces = tiny_traces(cfg)
    with ProfileStore(db) as st:
        for phase, tr in traces.items():
            st.put_trace(f"{ENGINE}:{dtype}", trace_cache_key(cfg["_name_or_path"], cfg), phase, tr.to_json())
    return traces

"""Export a model's profiles in Vidur's profiling CSV layout, so Vidur can simulate models it has no class for.

Vidur reads ``data/profiling/compute/<device>/<model>/mlp.csv`` (one row per ``num_tokens``: per-layer times
of ``emb, input_layernorm, attn_pre_proj, attn_rope, attn_post_proj, post_attention_layernorm, mlp_up_proj,
mlp_act, mlp_down_proj, add`` as ``time_stats.<op>.{min,max,mean,median,std}`` in milliseconds, plus the
model's ``n_head, n_kv_head, n_embd, n_expanded_embd, vocab_size, use_gated_mlp, num_tensor_parallel_workers``)
and ``attention.csv`` (one row per prefill chunk or decode batch: ``time_stats.attn_{prefill,decode,
kv_cache_save,input_reshape,output_reshape}.*`` with ``n_embd, n_q_head, n_kv_head, block_size,
num_tensor_parallel_workers, max_model_len, batch_size, prefill_chunk_size, kv_cache_size, is_prefill,
attention_backend``).

dooly has no per-model classes, so the rows are assembled from the traced operators of *one* decoder layer
(Vidur's times are per layer): each record is assigned to a Vidur operation by the module that ran it
(``...q_proj`` -> ``attn_pre_proj``, ``...mlp.down_proj`` -> ``mlp_down_proj``, the attention module's own
ops -> ``attn_prefill``/``attn_decode`` ...), and its latency at the row's request values comes from the
profile DB through dooly's per-signature predictor. Only medians are predicted, so ``min``/``max``/``mean``
repeat the median and ``std`` is 0.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from atomicio import atomic_path
from dooly.core.errors import DoolyError

MLP_OPS = (
    "emb",
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)
ATTN_OPS = ("attn_kv_cache_save", "attn_input_reshape", "attn_prefill", "attn_decode", "attn_output_reshape")
STATS = ("min", "max", "mean", "median", "std")

# (pattern on the module path, Vidur op); first match wins. Attention projections and the MLP are named the
# same way by nearly every transformers decoder; anything else in the attention module is attention proper.
_RULES: tuple[tuple[str, str], ...] = (
    (r"embed_tokens$|\.wte$|embed_in$", "emb"),
    (r"input_layernorm$|\.ln_1$|attention_norm$", "input_layernorm"),
    (r"post_attention_layernorm$|pre_feedforward_layernorm$|\.ln_2$|ffn_norm$", "post_attention_layernorm"),
    (r"(q_proj|k_proj|v_proj|qkv_proj|query_key_value|c_attn|Wqkv)$", "attn_pre_proj"),
    (r"(o_proj|out_proj|dense|c_proj)$", "attn_post_proj"),
    (r"rotary_emb$", "attn_rope"),
    (r"(mlp|feed_forward|block_sparse_moe)\.(gate_proj|up_proj|fc1|gate_up_proj|w1|w3|c_fc)$", "mlp_up_proj"),
    (r"(mlp|feed_forward|block_sparse_moe)\.(down_proj|fc2|w2|c_proj)$", "mlp_down_proj"),
    (r"(mlp|feed_forward)\.(act_fn|act|activation_fn)$", "mlp_act"),
    (r"(self_attn|attention|attn)$", "attn"),
    (r"(mlp|feed_forward|block_sparse_moe)$", "mlp_act"),  # elementwise glue inside the MLP
    (r"layers\.\d+$|\.h\.\d+$", "add"),  # residual adds at the layer level
)


def vidur_op(module: str) -> str | None:
    """The Vidur operation a record of ``module`` belongs to (``attn`` = attention proper), or None."""
    for pattern, op in _RULES:
        if re.search(pattern, module):
            return op
    return None


def _model_columns(config: Mapping[str, Any]) -> dict[str, Any]:
    heads = config.get("num_attention_heads") or config.get("n_head")
    kv = config.get("num_key_value_heads") or heads
    hidden = config.get("hidden_size") or config.get("n_embd")
    inter = config.get("intermediate_size") or config.get("ffn_dim") or (4 * hidden if hidden else None)
    act = str(config.get("hidden_act", config.get("activation_function", "")))
    gated = config.get("model_type") not in ("opt", "gpt2", "gpt_neox", "phi") and act != "gelu_new"
    return {
        "n_head": heads,
        "n_kv_head": kv,
        "n_embd": hidden,
        "n_expanded_embd": inter,
        "vocab_size": config.get("vocab_size"),
        "use_gated_mlp": gated,
    }


class _Latency:
    """Per-signature latency from the profile DB (dooly's interpolating predictor)."""

    def __init__(self, points: Mapping[str, list]) -> None:
        from dooly.predict.estimators import SignatureModel

        self._points = points
        self._models: dict[str, Any] = {}
        self._cls = SignatureModel

    def __call__(self, sig, values: Mapping[str, int]) -> float:
        key = sig.key
        if key not in self._models:
            pts = self._points.get(key)
            if not pts:
                raise DoolyError(f"signature {sig} has no profile in the database: profile the model first")
            self._models[key] = self._cls(sorted(sig.symbols()), [(p, m.median_s) for p, m in pts])
        return self._models[key]({k: v for k, v in values.items() if k in sig.symbols()})


def _layer_ops(trace, lat: _Latency, values: Mapping[str, int], layer: int) -> dict[str, float]:
    """Seconds per Vidur op for one layer (plus the embedding) at the given request values."""
    times: dict[str, float] = {}
    for rec in trace.kernels():
        op = vidur_op(rec.module)
        if op is None or (op != "emb" and rec.layer != layer):
            continue
        times[op] = times.get(op, 0.0) + lat(rec.signature, values)
    return times


def _stats_cols(op: str, seconds: float | None) -> dict[str, Any]:
    ms = "" if seconds is None else seconds * 1e3
    return {f"time_stats.{op}.{s}": (0.0 if (s == "std" and ms != "") else ms) for s in STATS}


def export_vidur(
    model: str,
    db: str | Path,
    out_dir: str | Path,
    num_tokens: list[int] | None = None,
    decode_batches: list[int] | None = None,
    kv_sizes: list[int] | None = None,
    block_size: int = 16,
    max_model_len: int = 4096,
    dtype: str = "bfloat16",
    threads: int | None = None,
) -> tuple[Path, Path]:
    """Write ``out_dir/mlp.csv`` and ``out_dir/attention.csv`` for `model` from the profiles in `db`."""
    from dooly.core.zoo import resolve_model
    from dooly.db.store import ProfileStore
    from dooly.engines import get_engine
    from dooly.profile import context_for, default_threads, model_traces

    num_tokens = num_tokens or [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    decode_batches = decode_batches or [1, 2, 4, 8, 16, 32]
    kv_sizes = kv_sizes or [16, 64, 128, 256, 512, 1024, 2048]
    db = Path(db)
    if not db.exists():
        raise DoolyError(f"{db}: no such profile database")
    engine = get_engine(dtype=dtype)
    name, config = resolve_model(model)
    with ProfileStore(db, readonly=True) as store:
        traces = model_traces(name, config, engine, store)
        points = store.all_points(context_for(engine, threads if threads is not None else default_threads()))
    lat = _Latency(points)
    layers = sorted({r.layer for r in traces["prefill"].records if r.layer is not None})
    layer = layers[0] if layers else None
    cols = _model_columns(config)
    out_dir = Path(out_dir)
    with atomic_path(out_dir, directory=True, contents=("mlp.csv", "attention.csv")) as tmp:
        mlp_rows = []
        for t in num_tokens:
            ops = _layer_ops(traces["prefill"], lat, {"requests": 1, "tokens": t, "kv_len": 0}, layer)
            row: dict[str, Any] = {}
            for op in MLP_OPS:
                row.update(_stats_cols(op, ops.get(op, 0.0)))
            row.update(cols, num_tokens=t, num_tensor_parallel_workers=1)
            mlp_rows.append(row)
        attn_rows = []
        common = {
            "n_embd": cols["n_embd"],
            "n_q_head": cols["n_head"],
            "n_kv_head": cols["n_kv_head"],
            "block_size": block_size,
            "num_tensor_parallel_workers": 1,
            "max_model_len": max_model_len,
            "attention_backend": "AttentionBackend.HF_EAGER",
        }
        for t in num_tokens:
            ops = _layer_ops(traces["prefill"], lat, {"requests": 1, "tokens": t, "kv_len": 0}, layer)
            row = {op_col: v for op in ATTN_OPS for op_col, v in _stats_cols(op, None).items()}
            row.update(_stats_cols("attn_prefill", ops.get("attn", 0.0)))
            row.update(common, batch_size=1, prefill_chunk_size=t, kv_cache_size=0, is_prefill=True)
            attn_rows.append(row)
        for b in decode_batches:
            for k in kv_sizes:
                ops = _layer_ops(traces["decode"], lat, {"requests": b, "tokens": 1, "kv_len": k}, layer)
                row = {op_col: v for op in ATTN_OPS for op_col, v in _stats_cols(op, None).items()}
                row.update(_stats_cols("attn_decode", ops.get("attn", 0.0)))
                row.update(common, batch_size=b, prefill_chunk_size=0, kv_cache_size=k, is_prefill=False)
                attn_rows.append(row)
        for name, rows in (("mlp.csv", mlp_rows), ("attention.csv", attn_rows)):
            with (tmp / name).open("w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
            os.chmod(tmp / name, 0o644)
        os.chmod(tmp, 0o755)  # mkdtemp's private mode would stick after the rename
    return out_dir / "mlp.csv", out_dir / "attention.csv"

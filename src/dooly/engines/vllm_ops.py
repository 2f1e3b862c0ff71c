"""vLLM's CPU kernels made visible to dispatch modes (the tracer, the profiler's context pool) and to fake tensors.

Three of vLLM's CPU kernels are registered as catch-all (``CompositeImplicitAutograd``) C++ functions: the paged
attention (``_C::cpu_attention_with_kv_cache``), the KV-cache write (``_C::cpu_attn_reshape_and_cache``) and the
attention scheduler (``_C::get_scheduler_metadata``). A ``TorchDispatchMode`` never sees such a kernel, and under
a ``FakeTensorMode`` it would run its C++ on fake tensors. The oneDNN GEMM (``_C::onednn_mm``) and the rotary
embedding are ordinary CPU kernels but have no fake implementation, and oneDNN's weight handle is built by a
catch-all C++ function too.

So, while a dispatch mode is active (and only then: a plain forward calls vLLM's functions untouched),
``vllm._custom_ops``'s Python entry points route through thin ops of the ``dooly_vllm`` library whose CPU kernels
call vLLM's C++ kernel and whose fake kernels only compute output metadata:

* ``dooly_vllm::onednn_mm(out!, x, bias, handle)``: vLLM's oneDNN GEMM (the weight lives in the oneDNN handle,
  a 0-d int64 tensor; ``out`` and ``x`` give the GEMM's N and K).
* ``dooly_vllm::cpu_attn_reshape_and_cache(...)``: the KV-cache write, vLLM's arguments unchanged.
* ``dooly_vllm::cpu_attention_with_kv_cache(...)``: the paged attention, vLLM's arguments except the scheduler
  metadata. That metadata is an opaque work plan computed on the host from the ``seq_lens`` and
  ``query_start_loc`` values (its size depends on them, so no shape rule exists); the op builds it with vLLM's
  own function from those values and the attention's settings, once per distinct batch (memoised), as vLLM's
  metadata builder does once per step.
* ``dooly_vllm::mla_attention(...)``: vLLM's latent attention layer (its cache write, metadata and attention),
  which vLLM runs as an opaque op on the new tokens only; this one also takes the cache, the lengths and the
  block table, and builds the layer's metadata from their values with its backend's own builder.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

_LIB: Any = None
_SCHEDULE: dict[tuple, torch.Tensor] = {}  # scheduler metadata per (seq_lens, query_start_loc, settings)
_ORIGINAL: dict[str, Callable[..., Any]] = {}
_LAYERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # mla_layer's handles
_KEYS = itertools.count()


def observed(*tensors: Any) -> bool:
    """A dispatch mode is active (tracing, context pooling) or a tensor is fake."""
    return bool(_get_current_dispatch_mode_stack()) or any(isinstance(t, FakeTensor) for t in tensors)


def _schedule(q: Any, kc: Any, seq_lens: Any, qsl: Any, causal: bool, window: int, isa: str, split: bool, dyn: Any,
              kv_dtype: str) -> torch.Tensor:  # fmt: skip
    key = (seq_lens.numpy().tobytes(), qsl.numpy().tobytes(), tuple(q.shape[1:]), kc.shape[1], q.dtype, causal,
           window, isa, split, dyn is None, kv_dtype, torch.get_num_threads())  # fmt: skip
    out = _SCHEDULE.get(key)
    if out is None:
        if len(_SCHEDULE) > 256:
            _SCHEDULE.clear()
        out = _SCHEDULE[key] = _ORIGINAL["cpu_attn_get_scheduler_metadata"](
            num_reqs=seq_lens.shape[0], num_heads=q.shape[1], num_kv_heads=kc.shape[1],
            head_dim=q.shape[2], seq_lens=seq_lens, dtype=q.dtype, query_start_loc=qsl, causal=causal,
            sliding_window_size=window, isa=isa, enable_kv_split=split, dynamic_causal=dyn, kv_cache_dtype=kv_dtype,
        )  # fmt: skip
    return out


def _define() -> None:
    global _LIB
    lib = torch.library.Library("dooly_vllm", "DEF")
    lib.define("onednn_mm(Tensor(a!) out, Tensor x, Tensor? bias, Tensor handle) -> ()")
    lib.define(
        "cpu_attn_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, str isa, float k_scale, float v_scale, str kv_cache_dtype) -> ()"
    )
    lib.define(
        "cpu_attention_with_kv_cache(Tensor query, Tensor key_cache, Tensor value_cache, Tensor(a!) output, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, bool causal, Tensor? alibi_slopes, "
        "SymInt sliding_window_size, Tensor block_table, float softcap, Tensor? s_aux, Tensor? dynamic_causal, "
        "float k_scale, float v_scale, str kv_cache_dtype, str isa, bool enable_kv_split) -> ()"
    )

    def onednn_mm(out, x, bias, handle):  # type: ignore[no-untyped-def]
        if int(handle) == 0:  # a synthetic handle (no context): never hand a null pointer to oneDNN
            raise RuntimeError("onednn_mm needs the oneDNN handle of a real layer (none in this context)")
        torch.ops._C.onednn_mm(out, x, bias, handle)

    def reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale, v_scale, kv_dtype):  # type: ignore[no-untyped-def]
        torch.ops._C.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale, v_scale,
                                                kv_dtype)  # fmt: skip

    def attention(q, kc, vc, out, qsl, seq_lens, scale, causal, alibi, window, bt, softcap, s_aux, dyn,  # type: ignore[no-untyped-def]
                  k_scale, v_scale, kv_dtype, isa, split):  # fmt: skip
        sched = _schedule(q, kc, seq_lens, qsl, causal, window, isa, split, dyn, kv_dtype)
        torch.ops._C.cpu_attention_with_kv_cache(q, kc, vc, out, qsl, seq_lens, scale, causal, alibi, window, bt,
                                                 softcap, sched, s_aux, dyn, k_scale, v_scale, kv_dtype)  # fmt: skip

    # vLLM's latent attention (cache write, metadata, attention) as one op that takes the step's cache and lengths,
    # so its signature carries the context length; ``layer`` is a 0-d handle to the vLLM layer (see mla_layer)
    lib.define(
        "mla_attention(Tensor q, Tensor kv_c_normed, Tensor k_pe, Tensor(a!) output, Tensor(b!) kv_cache, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor block_table, Tensor slot_mapping, Tensor is_prefilling, "
        "Tensor layer) -> ()"
    )

    def mla_attention(q, kv_c, k_pe, out, kv_cache, seq_lens, qsl, table, slots, prefilling, layer):  # type: ignore[no-untyped-def]
        mla = _LAYERS[int(layer)]
        mla._dooly_run(mla, q, kv_c, k_pe, out, kv_cache, seq_lens, qsl, table, slots, prefilling)

    lib.impl("mla_attention", mla_attention, "CPU")
    lib.impl("onednn_mm", onednn_mm, "CPU")
    lib.impl("cpu_attn_reshape_and_cache", reshape_and_cache, "CPU")
    lib.impl("cpu_attention_with_kv_cache", attention, "CPU")
    for name in ("onednn_mm", "cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache", "mla_attention"):
        torch.library.register_fake(f"dooly_vllm::{name}", lambda *a, **k: None, lib=lib)  # they only write
    if not _has_fake("_C::rotary_embedding"):
        # vLLM's rotary embedding rotates query and key in place; its fake has nothing to compute
        torch.library.register_fake("_C::rotary_embedding", lambda *a, **k: None)
    if hasattr(torch.ops._C, "causal_conv1d_weight_pack") and not _has_fake("_C::causal_conv1d_weight_pack"):
        # the CPU conv-weight prepack (called at load for bf16 [dim, 4] weights only) keeps shape and dtype
        torch.library.register_fake("_C::causal_conv1d_weight_pack", lambda w: torch.empty_like(w).contiguous())
    _LIB = lib


def mla_layer(layer: Any, run: Callable[..., None]) -> torch.Tensor:
    """The 0-d handle ``dooly_vllm::mla_attention`` finds ``layer`` by (a tensor, so every layer's call has one
    signature and the profiler replays a call on its own layer); ``run(layer, *op inputs)`` is its kernel."""
    key = next(_KEYS)
    _LAYERS[key] = layer
    layer._dooly_run = run
    return torch.tensor(key, dtype=torch.int64)


def _has_fake(name: str) -> bool:
    from torch._library.simple_registry import singleton

    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta") or singleton.find(name).fake_impl.kernel)


def fake_layer_ops() -> None:
    """No-op fakes for vLLM's opaque layer ops that have none (an SSM mixer, the latent attention): each returns
    nothing and only writes into an output the caller allocated, so its fake has nothing to compute. Called after a
    model is built, when its modules (which register these ops on import) are loaded."""
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("vllm::") or _has_fake(name):
            continue
        op = getattr(getattr(torch.ops.vllm, name.removeprefix("vllm::")), "default", None)
        if op is None:
            continue
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)
        if not op._schema.returns and writes:
            torch.library.register_fake(name, lambda *a, **k: None)


def _onednn_error(dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
    """oneDNN's own error for a real weight of this dtype and shape (vLLM passes the transposed weight), or
    None where it builds; probed on a stand-in of the same dtype whose every dimension keeps its remainder modulo
    64 (oneDNN's blockings are powers of two up to 64), at most 127 wide: a 70B layer's real weight would take a
    GB and most of a second to pack, for each of a layout sweep's shapes."""
    return _onednn_probe(dtype, tuple(d if d < 128 else 64 + d % 64 for d in shape))


@functools.cache
def _onednn_probe(dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
    with _disable_current_modes():
        try:
            _ORIGINAL["create_onednn_mm"](torch.zeros(shape[::-1], dtype=dtype).t(), 1)
        except RuntimeError as exc:
            return str(exc)
    return None


class _Handle:
    """Stands in for vLLM's oneDNN handler while the model is built on fake weights (never executed)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.k, self.n = weight.size()
        self.handler_tensor = torch.zeros((), dtype=torch.int64)


def install() -> None:
    """Define the ``dooly_vllm`` ops and route vLLM's Python entry points through them when observed (once)."""
    if _LIB is not None:
        return
    import vllm._custom_ops as ops

    for name in ("onednn_mm", "create_onednn_mm", "cpu_attn_reshape_and_cache", "cpu_attention_with_kv_cache",
                 "cpu_attn_get_scheduler_metadata"):  # fmt: skip
        _ORIGINAL[name] = getattr(ops, name)
    _define()

    def onednn_mm(handler: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not observed(x):
            return _ORIGINAL["onednn_mm"](handler, x, bias)
        out = torch.empty((*x.shape[0:-1], handler.n), dtype=x.dtype)  # as vLLM's wrapper allocates it
        torch.ops.dooly_vllm.onednn_mm(out, x.reshape(-1, handler.k), bias, handler.handler_tensor)
        return out

    def create_onednn_mm(weight: torch.Tensor, primitive_cache_size: int = 128) -> Any:
        if isinstance(weight, FakeTensor):
            # vLLM falls back to torch's linear where oneDNN cannot build this GEMM (bf16 on a CPU without
            # AVX-512/AMX): the traced model must take the branch the real one takes
            error = _onednn_error(weight.dtype, tuple(weight.shape))
            if error is not None:
                raise RuntimeError(error)
            return _Handle(weight)
        return _ORIGINAL["create_onednn_mm"](weight, primitive_cache_size)

    def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa, k_scale=1.0, v_scale=1.0,  # type: ignore[no-untyped-def]
                          kv_cache_dtype="auto"):  # fmt: skip
        fn = (
            torch.ops.dooly_vllm.cpu_attn_reshape_and_cache
            if observed(key)
            else _ORIGINAL["cpu_attn_reshape_and_cache"]
        )
        fn(key, value, key_cache, value_cache, slot_mapping, isa, k_scale, v_scale, kv_cache_dtype)

    def attention(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal, alibi_slopes,  # type: ignore[no-untyped-def]
                  sliding_window, block_table, softcap, scheduler_metadata, s_aux, dynamic_causal=None,
                  k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"):  # fmt: skip
        if not observed(query):
            return _ORIGINAL["cpu_attention_with_kv_cache"](
                query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal, alibi_slopes,
                sliding_window, block_table, softcap, scheduler_metadata, s_aux, dynamic_causal, k_scale, v_scale,
                kv_cache_dtype,
            )  # fmt: skip
        # the settings vLLM's metadata builder plans with, derived as it derives them
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(query.dtype, key_cache.shape[2], query.shape[2], kv_cache_dtype)
        split = bool(envs.VLLM_CPU_ATTN_SPLIT_KV)
        torch.ops.dooly_vllm.cpu_attention_with_kv_cache(
            query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal, alibi_slopes,
            sliding_window, block_table, softcap, s_aux, dynamic_causal, k_scale, v_scale, kv_cache_dtype, isa, split,
        )  # fmt: skip

    def scheduler_metadata(**kw: Any) -> Any:
        # on fake tensors: a placeholder (the observed attention op rebuilds the plan from the real values)
        if isinstance(kw["seq_lens"], FakeTensor):
            return torch.empty(0, dtype=torch.int8)
        return _ORIGINAL["cpu_attn_get_scheduler_metadata"](**kw)

    # a real model's oneDNN handles may be garbage-collected while a later trace runs: release them outside it
    release = ops.CPUDNNLGEMMHandler.__del__

    def __del__(self: Any) -> None:
        try:
            with _disable_current_modes():
                release(self)
        except (ImportError, TypeError):  # the interpreter is shutting down: the process frees the handle
            pass

    ops.CPUDNNLGEMMHandler.__del__ = __del__
    ops.onednn_mm = onednn_mm
    ops.create_onednn_mm = create_onednn_mm
    ops.cpu_attn_reshape_and_cache = reshape_and_cache
    ops.cpu_attention_with_kv_cache = attention
    ops.cpu_attn_get_scheduler_metadata = scheduler_metadata


__all__ = ["fake_layer_ops", "install", "mla_layer", "observed"]

"""Page faults: what a CPU op pays for an output too large for the allocator to reuse."""

from __future__ import annotations

import functools
from collections.abc import Mapping

from dooly.trace.signature import contiguous_stride

#: Request values at which a signature's output is sized to screen it for page faults (outputs grow with them).
_SCREEN_VALUES = {"requests": 256, "tokens": 16384, "kv_len": 16384}


class _ByKey:
    """A signature hashed and compared by its key alone, so the cache below holds one entry per key."""

    __slots__ = ("sig", "key")

    def __init__(self, sig: object) -> None:
        self.sig = sig
        self.key: str = sig.key  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByKey) and other.key == self.key


def fresh_output_bytes(sig: object, values: Mapping[str, int]) -> int:
    """Bytes of new storage the op allocates for its outputs at ``values``, from a call on meta tensors; 0
    where the op has no meta implementation."""
    return _fresh_output_bytes(_ByKey(sig), tuple(sorted(values.items())))


# one entry per signature and request size: bounded for long-lived processes
@functools.lru_cache(maxsize=100_000)
def _fresh_output_bytes(keyed: _ByKey, values: tuple[tuple[str, int], ...]) -> int:
    """:func:`fresh_output_bytes`, cached by (signature key, sorted request values)."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_map

    sig = keyed.sig
    full = {"requests": 1, "tokens": 1, "kv_len": 0, **dict(values)}
    try:
        args, kwargs = sig.build_call(  # type: ignore[attr-defined]
            full,
            lambda _i, spec, shape, stride: torch.empty_strided(
                shape,
                stride if stride is not None else contiguous_stride(shape),
                dtype=getattr(torch, spec.dtype),
                device="meta",
            ),
        )
        args, kwargs = tree_map(lambda x: torch.device("meta") if isinstance(x, torch.device) else x, (args, kwargs))
        ns, op, overload = sig.op.split(".")  # type: ignore[attr-defined]
        with torch.no_grad():
            out = getattr(getattr(getattr(torch.ops, ns), op), overload)(*args, **kwargs)
        # an output sharing an input's storage (a view, _unsafe_view, an in-place op) allocates nothing
        ins = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        outs = {
            t.untyped_storage()._cdata: t.untyped_storage().nbytes()
            for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor)
        }
        return sum(b for k, b in outs.items() if k not in ins)
    except Exception:  # no meta kernel, or an op that needs real data: no fault term for it
        return 0


def can_fault(sig: object) -> bool:
    """Whether the op's outputs can outgrow the allocator's mmap ceiling (sized at :data:`_SCREEN_VALUES`)."""
    from dooly.profile.timing import MMAP_MAX_BYTES

    return fresh_output_bytes(sig, _SCREEN_VALUES) >= MMAP_MAX_BYTES


def faulting_bytes(sig: object, values: Mapping[str, int]) -> int:
    """Fresh bytes the op faults in at ``values``: its new outputs above the allocator's mmap ceiling (reused
    below it in a running engine, so free), else 0."""
    from dooly.profile.timing import MMAP_MAX_BYTES

    b = fresh_output_bytes(sig, values)
    return b if b >= MMAP_MAX_BYTES else 0


def page_cost(store, ctx) -> float:  # type: ignore[no-untyped-def]
    """Seconds per byte of fresh pages on the machine of ``ctx`` (0 where ``dooly profile`` measured none:
    a GPU, a DB profiled on a Ray cluster)."""
    from dooly.profile.timing import PAGE_COST_KEY

    rows = store.forwards(ctx, PAGE_COST_KEY[0])
    return rows[0][3].median_s / rows[0][2]["bytes"] if rows else 0.0

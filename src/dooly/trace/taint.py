"""Taint labels for the integers that reach operators, propagated by torch's own symbolic integers.

Labels
------
* ``MODEL``: a plain Python ``int``. Config numbers (hidden size, heads, vocab, ...) enter the model as ints and
  stay ints through every shape computation.
* ``REQUEST``: a torch ``SymInt`` whose sympy expression is over the request symbols (``requests``, ``tokens``,
  ``kv_len``; see :mod:`dooly.trace.signature`). The tracer creates one fresh symbol per request quantity inside a
  ``ShapeEnv`` (with duck sizing off, so two quantities that happen to have the same dummy value are still two
  symbols) and feeds the engine tensors whose sizes are those symbols.
* ``MIXED``: a ``SymInt`` whose expression mixes both (``4096*tokens``): arithmetic on a SymInt with an int
  keeps the int as a constant inside the expression.

Because the label lives in the *type* (int vs. SymInt) and not in the value, a config value that equals the
dummy request's size is never mistaken for a request quantity -- the failure mode of "sentinel size" tracing.

Tensors carry a label per dimension for free: a ``FakeTensor`` created under the ``ShapeEnv`` has SymInt sizes
and strides, and every aten op's fake kernel (meta function) computes its output sizes symbolically. So every
operator the engine dispatches is seen by :class:`OpRecorder` (a ``TorchDispatchMode`` stacked above the fake
mode) with its real input sizes as expressions -- the eager engine's own code runs, op by op, nothing compiled.

What runs is what a real eager run runs: transformers switches to a "tracing" code path when it sees fake
tensors (always materialise the mask, repeat KV heads), so the engine's ``tracing_context`` turns that detection
off, and the recorder answers the few value reads a real run makes (``attention_mask.all()``) from real values of
the request-derived tensors (see :class:`OpRecorder`). The tests compare a trace, evaluated at the dummy values,
op by op and shape by shape with a real eager run.

If the engine's code forces a request size into a concrete Python int (``int(seq_len)``, a data-dependent
branch), torch specialises that symbol; :meth:`RequestSymbols.check_specialised` turns that into an error rather
than silently mislabelling a REQUEST size as a MODEL constant.
"""

from __future__ import annotations

import enum
import math
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from dooly.core.errors import DoolyError
from dooly.trace.signature import REQUEST_SYMBOLS, Dim, Signature, TensorSpec, canonical_json


class Label(enum.Enum):
    """Where an integer came from."""

    MODEL = "model"
    REQUEST = "request"
    MIXED = "mixed"


# ---------------------------------------------------------------------------------------------------------
# sympy -> expression string (the grammar of dooly.trace.signature)
# ---------------------------------------------------------------------------------------------------------


def _fn_name(e: sympy.Basic) -> str:
    return type(e).__name__


def render(expr: sympy.Basic) -> Dim:
    """A sympy integer expression over request symbols as ``int`` or canonical expression string."""
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return int(expr)
    return _render(expr)


def _render(e: sympy.Basic) -> str:
    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        name = str(e)
        if name not in REQUEST_SYMBOLS:
            raise DoolyError(
                f"a shape depends on {name!r}, which is not a request symbol (data-dependent size in the engine's code)"
            )
        return name
    if e.is_Add:
        out = ""
        for i, term in enumerate(e.as_ordered_terms()):
            s = _render(term)
            if i == 0:
                out = s
            elif s.startswith("-"):
                out += " - " + s[1:]
            else:
                out += " + " + s
        return out
    if e.is_Mul:
        coeff, rest = e.as_coeff_Mul()
        factors = rest.as_ordered_factors()
        parts = [f"({_render(f)})" if f.is_Add else _render(f) for f in factors]
        body = "*".join(parts)
        if coeff == 1:
            return body
        if coeff == -1:
            return "-" + body
        if not coeff.is_Integer:
            raise DoolyError(f"non-integer coefficient in shape expression {e}")
        return f"{int(coeff)}*{body}"
    if e.is_Pow:
        base, exp = e.as_base_exp()
        if exp.is_Integer and int(exp) > 0:
            b = _render(base)
            return f"({b})**{int(exp)}" if not base.is_Symbol else f"{b}**{int(exp)}"
    name = _fn_name(e)
    if name == "FloorDiv":
        a, b = e.args
        return f"({_render(a)})//({_render(b)})"
    if name in ("Mod", "PythonMod"):
        a, b = e.args
        return f"({_render(a)})%({_render(b)})"
    if name in ("Max", "Min"):
        args = sorted((_render(a) for a in e.args), key=lambda s: (len(s), s))
        return f"{name.lower()}({', '.join(args)})"
    raise DoolyError(f"unsupported shape expression {e} ({name})")


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}
_REL = {
    "Equality": "==",
    "Unequality": "!=",
    "StrictLessThan": "<",
    "LessThan": "<=",
    "GreaterThan": ">=",
    "StrictGreaterThan": ">",
}


def render_guard(expr: sympy.Basic) -> str:
    """A guard (relational over request symbols, or an ``and`` / ``or`` of them) as ``<symbolic part> <op>
    <constant>`` in the expression grammar (:func:`dooly.trace.signature.eval_guard` evaluates it); DoolyError if
    it has no such form."""
    name = type(expr).__name__
    if name in ("Or", "And"):
        joined = f" {name.lower()} ".join(f"({render_guard(a)})" for a in expr.args)
        return joined
    op = _REL.get(name)
    if op is None:
        raise DoolyError(f"guard {expr} is not a comparison")
    diff = sympy.expand(expr.lhs - expr.rhs)
    const = diff.as_coeff_Add()[0]
    var = diff - const
    if var == 0:
        raise DoolyError(f"guard {expr} is a constant")
    lead = var.as_ordered_terms()[0].as_coeff_Mul()[0]
    if lead < 0:  # write "kv_len >= 50", not "-kv_len <= -50"
        var, const, op = -var, -const, _FLIP[op]
    return f"{render(var)} {op} {render(-const)}"


class SpecialisedError(DoolyError):
    """The engine's code fixed a request size to a constant (see :meth:`RequestSymbols.check_specialised`)."""


# ---------------------------------------------------------------------------------------------------------
# Request symbols inside a ShapeEnv
# ---------------------------------------------------------------------------------------------------------


class RequestSymbols:
    """A ShapeEnv + FakeTensorMode and one SymInt per request quantity (its taint source)."""

    def __init__(self) -> None:
        # duck_shape=False: equal dummy values must not be merged into one symbol
        self.shape_env = ShapeEnv(duck_shape=False)
        self.fake_mode = FakeTensorMode(shape_env=self.shape_env, allow_non_fake_inputs=False)
        self._by_symbol: dict[sympy.Symbol, sympy.Symbol] = {}  # ShapeEnv symbol -> named symbol
        self.hints: dict[str, int] = {}
        self.symints: dict[str, torch.SymInt] = {}
        self._rendered: dict[sympy.Basic, Dim] = {}  # tracing renders the same few expressions over and over
        self.int_site: str | None = None  # see int_sites
        # A branch taken at one request size only (``kv_len + 1 == window``) is traced with that size as a
        # constant: exact there, and its guards say so (see guards)
        self.allow_constants = False

    def new(self, name: str, hint: int) -> torch.SymInt:
        """A fresh REQUEST symbol called ``name`` (one of REQUEST_SYMBOLS) whose dummy value is ``hint``."""
        if name not in REQUEST_SYMBOLS:
            raise DoolyError(f"unknown request symbol {name!r}")
        if hint < 2:
            raise DoolyError(f"dummy value for {name} must be >= 2 (0 and 1 are specialised by torch), got {hint}")
        sym = self.shape_env.create_symbol(hint, ConstantSource(f"dooly_{name}"), dynamic_dim=DimDynamic.DYNAMIC)
        self._by_symbol[sym] = sympy.Symbol(name, integer=True, positive=True)
        self.hints[name] = hint
        s = self.shape_env.create_symintnode(sym, hint=hint)
        self.symints[name] = s
        return s

    def named(self, expr: sympy.Basic) -> sympy.Basic:
        """An expression over ShapeEnv symbols rewritten over the named request symbols."""
        expr = self.shape_env.replace(expr)
        return expr.xreplace(self._by_symbol)

    def dim(self, x: int | torch.SymInt | sympy.Basic) -> Dim:
        """An int (MODEL) or the expression string (REQUEST / MIXED) of one size (a SymInt or its sympy expr)."""
        if isinstance(x, torch.SymInt):
            x = x.node.expr
        elif not isinstance(x, sympy.Basic):
            return int(x)
        out = self._rendered.get(x)
        if out is None:
            out = self._rendered[x] = render(self.named(x))
        return out

    def label(self, x: int | torch.SymInt) -> Label:
        """The taint label of one integer."""
        d = self.dim(x)
        if isinstance(d, int):
            return Label.MODEL
        expr = self.named(x.node.expr)  # type: ignore[union-attr]
        const = any(a.is_Number and a not in (0, 1, -1) for a in sympy.preorder_traversal(expr))
        return Label.MIXED if const else Label.REQUEST

    def check_specialised(self, where: str = "") -> None:
        """Raise if the engine's code turned a request symbol into a constant (the trace would mislabel it).

        ``where`` says what ran when it was noticed (an op and its module); the Python line that asked for the
        symbol as an int (``range(seq_len)``, ``int(n)``), when there was one, is named too."""
        if self.allow_constants:
            return
        for sym, named in self._by_symbol.items():
            value = self.shape_env.replace(sym)
            if value.is_Integer:
                how = (
                    f"used it as a Python int at {self.int_site}"
                    if self.int_site
                    else ("converted it to a Python int or branched on its value")
                )
                at = f" in {where}" if where else ""
                raise SpecialisedError(
                    f"the engine's code specialised request size {named} to the constant {int(value)}{at} "
                    f"({how}); its shapes cannot be labelled"
                )

    @contextmanager
    def int_sites(self) -> Iterator[None]:
        """Note where Python code first asks for a request size as an int (``range(tokens)`` loops over it, an
        ``int()`` fixes it): the line a refusal names. Nothing else changes."""
        originals = torch.SymInt.__index__, torch.SymInt.__int__
        syms = self

        def noting(original: Callable[[torch.SymInt], int]) -> Callable[[torch.SymInt], int]:
            def conv(x: torch.SymInt) -> int:
                if syms.int_site is None and not x.node.expr.is_number:
                    frame = traceback.extract_stack(limit=2)[0]
                    line = (frame.line or "").strip()
                    syms.int_site = f"{Path(frame.filename).name}:{frame.lineno} `{line[:80]}`"
                return original(x)

            return conv

        torch.SymInt.__index__, torch.SymInt.__int__ = noting(originals[0]), noting(originals[1])  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.SymInt.__index__, torch.SymInt.__int__ = originals  # type: ignore[method-assign]

    def guards(self) -> list[sympy.Basic]:
        """Conditions on request symbols that the engine's control flow relied on (over the named symbols,
        deduplicated, in order)."""
        out: list[sympy.Basic] = []
        for sym, named in self._by_symbol.items():
            value = self.shape_env.replace(sym)
            if value.is_Integer:
                out.append(sympy.Eq(named, value))
        for g in self.shape_env.guards:
            expr = self.named(g.expr)
            if expr not in out and expr is not sympy.true:
                out.append(expr)
        return out


# ---------------------------------------------------------------------------------------------------------
# Recording every dispatched aten op
# ---------------------------------------------------------------------------------------------------------


def _raw(x: int | torch.SymInt) -> int | sympy.Basic:
    return x.node.expr if isinstance(x, torch.SymInt) else int(x)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


_VALUE_LIMIT = 1 << 22  # largest tensor (elements) whose real values are kept at the dummy sizes


def _hint(x: Any) -> Any:
    """A symbolic scalar's value at the dummy request (no guard added)."""
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        return x.node.hint
    return x


def _polar(abs: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    shape = torch.broadcast_shapes(abs.shape, angle.shape)
    return torch.empty(
        shape, dtype=torch.complex128 if abs.dtype == torch.float64 else torch.complex64, device=abs.device
    )


def _decomposed(op: Any) -> Callable[..., torch.Tensor]:
    from torch._decomp import decomposition_table

    return decomposition_table[op]


# Ops whose fake kernels need concrete sizes (torch's polar meta fixes them; the C++ kernels of constant_pad_nd
# and baddbmm take only ints): their outputs are computed with these instead, the op itself still recorded once as
# a real run calls it (the sub-ops here run below the recorder and are not recorded). Another op that fails the
# same way falls back to torch's decomposition of it (see OpRecorder.__torch_dispatch__).
_SYMBOLIC_IMPLS: dict[Any, Callable[..., torch.Tensor]] = {
    torch.ops.aten.polar.default: _polar,
    torch.ops.aten.constant_pad_nd.default: _decomposed(torch.ops.aten.constant_pad_nd.default),
    torch.ops.aten.baddbmm.default: _decomposed(torch.ops.aten.baddbmm.default),
}
_CONCRETE_ONLY = "expected to contain only concrete integers"


class OpRecorder(TorchDispatchMode):
    """Records each aten op the engine dispatches as a :class:`Signature` plus where it ran.

    Enter it *inside* the fake mode (so it sees each op first). ``module_of`` returns the dotted path of the module
    running now; ``engine_id`` is written into every signature; nothing is recorded while ``recording`` is False
    (the engine's own setup, e.g. filling the KV cache).

    Values. Sizes are symbolic, but the engine's code also *reads* a few tensors (``attention_mask.all()`` decides
    whether a mask is built at all; sdpa's grouped-query path depends on it). To follow the branch a real run
    takes, the recorder keeps the real values, at the dummy sizes, of every small tensor that is computed only
    from the request's inputs and constants (input ids, attention mask, positions, masks) -- never from weights.
    A read (``aten._local_scalar_dense``) of such a tensor returns its real value; a read of a value that depends
    on weights raises :class:`DoolyError` (data-dependent control flow cannot be traced without real weights).
    """

    def __init__(self, syms: RequestSymbols, engine_id: str, module_of: Callable[[], str]) -> None:
        super().__init__()
        self.syms = syms
        self.engine_id = engine_id
        self.module_of = module_of
        self.recording = False
        self._last_factory_out: int | None = None
        self.calls: list[tuple[Signature, str, bool]] = []  # (signature, module path, is_view)
        self.data_reads: list[str] = []  # values the engine read from tensors (op module: value)
        self._spec_cache: dict[Any, TensorSpec] = {}
        # id(fake tensor) -> (the fake tensor, kept alive so its id is never reused; its real value)
        self._values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._replacements = len(syms.shape_env.replacements)

    def _spec(self, t: torch.Tensor) -> TensorSpec:
        raw_shape = tuple(_raw(x) for x in t.shape)
        raw_stride = tuple(_raw(x) for x in t.stride())
        key = (raw_shape, raw_stride, t.dtype)
        spec = self._spec_cache.get(key)
        if spec is None:
            spec = self._spec_cache[key] = self._make_spec(raw_shape, raw_stride, t.dtype)
        return spec

    def _make_spec(self, raw_shape: tuple, raw_stride: tuple, dtype: torch.dtype) -> TensorSpec:
        shape = tuple(self.syms.dim(s) for s in raw_shape)
        stride = tuple(self.syms.dim(s) for s in raw_stride)
        # contiguous strides from the shape expressions (sympy, not SymInt arithmetic: no guards, no graph);
        # a size-1 dim's stride does not matter
        expected: list[Dim] = []
        acc: Any = sympy.Integer(1)
        for s in reversed(raw_shape):
            expected.append(self.syms.dim(acc))
            acc = acc * s
        expected.reverse()
        contiguous = all(sh == 1 or st == ex for sh, st, ex in zip(shape, stride, expected, strict=True))
        return TensorSpec(shape, _dtype_name(dtype), None if contiguous else stride)

    def _arg(self, x: Any, tensor_index: dict[int, int]) -> Any:
        if isinstance(x, torch.Tensor):
            return {"tensor": tensor_index[id(x)]}
        if isinstance(x, torch.SymInt):
            d = self.syms.dim(x)
            return d if isinstance(d, int) else {"sym": d}
        if isinstance(x, torch.SymFloat | torch.SymBool):
            x = x.node.hint
        if isinstance(x, bool) or x is None or isinstance(x, str | int):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {"float": repr(x)}
        if isinstance(x, torch.dtype):
            return {"dtype": _dtype_name(x)}
        if isinstance(x, torch.device):
            return {"device": str(x)}
        if isinstance(x, torch.layout):
            return {"layout": str(x)}
        if isinstance(x, torch.memory_format):
            return {"memory_format": str(x)}
        return repr(x)

    def signature(self, func: Any, args: tuple, kwargs: Mapping[str, Any]) -> Signature:
        """The signature of one call (tensors in pytree order of ``(args, kwargs)``)."""
        flat, _ = tree_flatten((args, dict(kwargs)))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        tensor_index: dict[int, int] = {}
        for t in tensors:
            tensor_index.setdefault(id(t), len(tensor_index))
        uniq = list({id(t): t for t in tensors}.values())
        specs = tuple(self._spec(t) for t in uniq)

        def conv(x: Any) -> Any:
            return self._arg(x, tensor_index)

        a = tree_map(conv, list(args))
        k = {key: tree_map(conv, v) for key, v in kwargs.items()}
        return Signature(str(func), specs, canonical_json({"args": a, "kwargs": k}), self.engine_id)

    # -- values of request-derived tensors ------------------------------------------------------------------

    def _value(self, t: torch.Tensor) -> torch.Tensor | None:
        if not isinstance(t, FakeTensor):
            return t  # a real constant being lifted into the fake world
        entry = self._values.get(id(t))
        return None if entry is None else entry[1]

    def _track_values(self, func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any) -> None:
        flat, _ = tree_flatten((args, dict(kwargs)))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        known = [self._value(t) for t in tensors]
        if any(v is None for v in known):
            # a mutated input now holds weight-derived data: forget its value
            for i, a in enumerate(func._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write and i < len(args):
                    if isinstance(args[i], torch.Tensor):
                        self._values.pop(id(args[i]), None)
            return
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        if any(math.prod(int(_hint(d)) for d in o.shape) > _VALUE_LIMIT for o in outs):
            return
        by_id = {id(t): v for t, v in zip(tensors, known, strict=True)}

        def real(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return by_id[id(x)]
            return _hint(x)

        with unset_fake_temporarily():
            r_args = tree_map(real, list(args))
            r_kwargs = {k: tree_map(real, v) for k, v in kwargs.items()}
            r_out = func(*r_args, **r_kwargs)
        r_outs = [x for x in tree_flatten(r_out)[0] if isinstance(x, torch.Tensor)]
        for o, r in zip(outs, r_outs, strict=False):
            if isinstance(o, FakeTensor):
                self._values[id(o)] = (o, r)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Mapping[str, Any] | None = None):
        kwargs = kwargs or {}
        if self.recording and func.namespace != "prim" and not self._fake_artifact(func, args, kwargs):
            sig = self.signature(func, args, kwargs)
            self.calls.append((sig, self.module_of(), bool(getattr(func, "is_view", False))))
        if func is torch.ops.aten._local_scalar_dense.default:
            value = self._value(args[0])
            if value is None:
                raise DoolyError(
                    f"the engine's code read a value computed from the weights (in {self.module_of() or 'the model'}): "
                    "data-dependent control flow cannot be traced with symbolic shapes"
                )
            with unset_fake_temporarily():
                v = value.item()
            if self.recording:
                self.data_reads.append(f"{self.module_of() or '-'}: {v!r}")
            return v
        impl = _SYMBOLIC_IMPLS.get(func)
        try:
            out = impl(*args, **kwargs) if impl is not None else func(*args, **kwargs)
        except RuntimeError as exc:
            from torch._decomp import decomposition_table

            if _CONCRETE_ONLY not in str(exc) or func not in decomposition_table:
                raise
            out = decomposition_table[func](*args, **kwargs)
        if len(self.syms.shape_env.replacements) != self._replacements:
            # noticed at once (not after the pass: an SSM's loop would run on for every position) and where
            self._replacements = len(self.syms.shape_env.replacements)
            self.syms.check_specialised(f"{func} ({self.module_of() or 'the model'})")
        self._track_values(func, args, kwargs, out)
        # remember a factory op's output: torch detaches it once more when its sizes are symbolic
        has_tensor_input = any(isinstance(x, torch.Tensor) for x in tree_flatten((args, kwargs))[0])
        self._last_factory_out = id(out) if not has_tensor_input and isinstance(out, torch.Tensor) else None
        return out

    def _fake_artifact(self, func: Any, args: tuple, kwargs: Mapping[str, Any]) -> bool:
        """Ops that only appear because sizes are symbolic, never in a real eager run (checked by the tests):
        the ``detach`` torch adds after a factory op with symbolic sizes, and the whole-dimension ``slice``
        (``x[:, -1:]`` on dim 0) that real indexing elides when it can see the slice is a no-op."""
        if func is torch.ops.aten.detach.default:
            return bool(args) and id(args[0]) == self._last_factory_out
        if func is torch.ops.aten.slice.Tensor:
            start = args[2] if len(args) > 2 else kwargs.get("start", 0)
            end = args[3] if len(args) > 3 else kwargs.get("end")
            step = args[4] if len(args) > 4 else kwargs.get("step", 1)
            return (start in (0, None)) and step == 1 and (end is None or (isinstance(end, int) and end >= 2**62))
        return False


__all__ = ["Label", "OpRecorder", "RequestSymbols", "SpecialisedError", "render", "render_guard"]

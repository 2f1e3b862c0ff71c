"""Operator signatures: what one aten call computes, written in request symbols and model constants.

The tracer (:mod:`dooly.trace.tracer`) runs one dummy request through an engine and records every aten operator
the engine dispatches. Each integer that reaches a shape or an argument carries its provenance:

* **MODEL** integers come from the model config (hidden size, heads, vocab, ...). They are written as plain
  Python ``int`` s.
* **REQUEST** integers come from the request or the engine's limits. They are written as **expressions** over
  the request symbols below, e.g. ``"tokens"``, ``"requests*tokens"``, ``"kv_len + tokens"``. A product of a
  model constant and a request symbol stays an expression: ``"4096*tokens"``.

A model constant that happens to equal a request value is still an ``int``: provenance is carried by torch's
symbolic integers (each request value is a distinct symbol, never compared by value), not guessed from sizes.

Request symbols (the vocabulary every expression is written in; see :data:`REQUEST_SYMBOLS`)
----------------------------------------------------------------------------------------------
``requests``  sequences in the batch of this forward pass (the batch dimension).
``tokens``    new tokens per sequence computed in this pass (the query length). Prefill: the prompt (or chunk)
              length. In the **decode** phase one token is produced per sequence, so ``tokens`` does not occur:
              the query length is the literal ``1`` (a phase constant, not a model one).
``kv_len``    tokens already in the KV cache per sequence *before* this pass. ``0`` in a plain prefill (so it
              does not occur in prefill signatures); a decode step attends over ``kv_len + 1`` positions.
``max_cache_len``  engine limit: the preallocated KV length of engines with a static cache (reserved; the HF
              eager engine's dynamic cache never uses it).
``max_batched_tokens``  engine limit: token budget of a padded/packed batch (reserved; not used by HF eager).

Expressions are strings in a tiny grammar: integers, the symbols above, ``+ - * // %`` , parentheses and
``max(a, b, ...)`` / ``min(...)``. They are parsed with :mod:`ast` and evaluated by a whitelist walker
(:func:`eval_expr`); nothing is ever ``eval`` -ed. The tracer writes them in one canonical form (sympy's
ordering), so two models running the same math produce byte-identical signatures.

Data model
----------
:class:`TensorSpec`   ``shape`` and ``stride`` (tuples of ``int | str``), ``dtype`` (``"float32"``, ``"bfloat16"``,
                      ``"int64"`` ...).
:class:`Signature`    frozen and hashable: ``op`` (aten overload, ``"aten.mm.default"``), ``inputs`` (tuple of
                      TensorSpec, every tensor of the call in pytree order of ``(args, kwargs)``), ``args``
                      (canonical JSON of the non-tensor arguments, see below) and ``engine`` (``"hf-eager/cpu"``).
                      ``.key`` is a stable hex digest, ``.symbols()`` the request symbols it uses,
                      ``.concrete(values)`` the concrete shapes/args at given request values, and
                      ``.build_call(values, make_tensor)`` the ``(args, kwargs)`` to call the op with.
:class:`OpRecord`     one dispatched call: its signature, ``order`` (position in the pass), ``module`` (dotted
                      module path such as ``"model.layers.3.self_attn.q_proj"``), ``layer`` (first integer in the
                      module path, or ``None``) and ``view`` (True for view/metadata-only ops that launch no kernel).
:class:`ModelTrace`   ``model``, ``config_hash``, ``phase`` (one of :data:`PHASES`), ``engine``, ``records``,
                      ``hints`` (the dummy request values used), ``guards`` (conditions on the request symbols the
                      engine's control flow depended on, e.g. ``"kv_len >= 4096"`` for a sliding window: the
                      trace is valid where they hold; comparisons of expressions joined by ``and`` / ``or``, see
                      :func:`eval_guard`), ``sides`` (the same phase traced where the guards fail, each with its
                      own hints and guards; ``.at(values)`` picks the branch for a request size,
                      ``.all_unique()`` the signatures of every branch), ``.unique()`` ->
                      ``{Signature: multiplicity}``, ``to_json`` / ``from_json``.

The ``args`` JSON
-----------------
``{"args": [...], "kwargs": {...}}`` with sorted keys and no spaces. Inside, a tensor is ``{"tensor": i}`` (its
index into ``inputs``), a request-dependent int is ``{"sym": "tokens*requests"}``, and non-JSON values are tagged:
``{"dtype": "float32"}``, ``{"device": "cpu"}``, ``{"layout": "torch.strided"}``,
``{"memory_format": "torch.contiguous_format"}``, ``{"float": "inf"}``. Plain ints, floats, bools, strings and
``null`` are themselves. Tensor *values* are not part of a signature (only shape, stride and dtype).

The engine string names what executes the op, not which Python module issued it: ``"hf-eager/cpu"`` covers every
HF attention implementation on the CPU, because the same aten overload on the same backend is the same kernel
(the attention implementation shows in the ops themselves: an sdpa kernel vs. bmm + softmax).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dooly.core.errors import DoolyError

#: The request / engine-limit symbols an expression may use, with what they mean.
REQUEST_SYMBOLS: dict[str, str] = {
    "requests": "sequences in the batch of this forward pass",
    "tokens": "new tokens per sequence computed in this pass (query length; literal 1 in decode)",
    "kv_len": "tokens already cached per sequence before this pass (0 in prefill)",
    "max_cache_len": "engine limit: preallocated KV length of a static cache (reserved)",
    "max_batched_tokens": "engine limit: token budget of a padded batch (reserved)",
}

#: prefill: empty cache; decode: one new token per sequence; chunk: a prefill chunk on top of a filled cache
#: (chunked prefill), where both ``tokens`` and ``kv_len`` occur.
PHASES = ("prefill", "decode", "chunk")

Dim = int | str  # an int is a constant; a str is an expression over REQUEST_SYMBOLS

# ---------------------------------------------------------------------------------------------------------
# Expressions: parse with ast, evaluate with a whitelist (never eval)
# ---------------------------------------------------------------------------------------------------------

_FUNCS: dict[str, Callable[..., int]] = {"max": max, "min": min}


def _pow(a: int, b: int) -> int:
    # Checked before computing: 9**9**9 alone would run for minutes. Within these bounds the result has at most
    # 64 * 64 bits, and _eval rejects it right after if it exceeds _MAX_VALUE.
    if b < 0:
        raise ValueError(f"negative exponent {b}")
    if b > _MAX_EXPONENT and abs(a) > 1:
        raise ValueError(f"exponent {b} is beyond {_MAX_EXPONENT}")
    return a**b


_BINOPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: _pow,
}
_MAX_EXPR_LEN = 400
# Expressions come from profile databases and trace files a user may have received from elsewhere, so every
# value is bounded: no shape or stride is beyond int64, and an exponent beyond 64 can only overflow it.
_MAX_VALUE = 2**63
_MAX_EXPONENT = 64


def _parse(expr: str) -> ast.expr:
    if not isinstance(expr, str) or len(expr) > _MAX_EXPR_LEN:
        raise DoolyError(f"bad shape expression {expr!r}: must be a string of at most {_MAX_EXPR_LEN} characters")
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError as exc:
        raise DoolyError(f"bad shape expression {expr!r}: {exc.msg}") from None
    except (RecursionError, MemoryError, ValueError) as exc:  # nesting too deep for the parser, NUL bytes
        raise DoolyError(f"bad shape expression {expr!r}: {type(exc).__name__}") from None
    _check(tree, expr)
    return tree


def _check(node: ast.AST, expr: str) -> None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if abs(node.value) > _MAX_VALUE:
            raise DoolyError(f"bad shape expression {expr!r}: constant beyond 2**63")
        return
    if isinstance(node, ast.Name) and node.id in REQUEST_SYMBOLS:
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        _check(node.left, expr)
        _check(node.right, expr)
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        _check(node.operand, expr)
        return
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCS
        and node.args
        and not node.keywords
    ):
        for a in node.args:
            _check(a, expr)
        return
    raise DoolyError(f"bad shape expression {expr!r}: {ast.dump(node)[:60]} is not allowed")


def _eval(node: ast.expr, values: Mapping[str, int], expr: str) -> int:
    if isinstance(node, ast.Constant):
        return int(node.value)
    if isinstance(node, ast.Name):
        if node.id not in values:
            raise DoolyError(f"no value given for request symbol {node.id!r}")
        return _bounded(int(values[node.id]), expr)
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, values, expr), _eval(node.right, values, expr)
        try:
            return _bounded(_BINOPS[type(node.op)](a, b), expr)
        except (ValueError, ZeroDivisionError) as exc:
            raise DoolyError(f"bad shape expression {expr!r}: {exc}") from None
    if isinstance(node, ast.UnaryOp):
        return -_eval(node.operand, values, expr)
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    return _FUNCS[node.func.id](*(_eval(a, values, expr) for a in node.args))


def _bounded(v: int, expr: str) -> int:
    if abs(v) > _MAX_VALUE:
        raise DoolyError(f"bad shape expression {expr!r}: a value is beyond 2**63")
    return v


def eval_expr(expr: Dim, values: Mapping[str, int]) -> int:
    """The value of a dimension (an int, or an expression string) at the given request values.

    Every intermediate value is bounded by 2**63 (exponents by 64), so a hostile expression fails at once.
    """
    if isinstance(expr, bool):
        raise DoolyError(f"bad shape expression {expr!r}")
    if isinstance(expr, int):
        return _bounded(expr, str(expr))
    return _eval(_parse(expr), values, expr)


_CMP: dict[type, Callable[[int, int], bool]] = {
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
}


def _parse_guard(guard: str) -> ast.expr:
    if not isinstance(guard, str) or len(guard) > 4 * _MAX_EXPR_LEN:
        raise DoolyError(f"bad guard {str(guard)[:60]!r}")
    try:
        tree = ast.parse(guard, mode="eval").body
    except (SyntaxError, RecursionError, MemoryError, ValueError):
        raise DoolyError(f"bad guard {guard[:60]!r}") from None

    def check(node: ast.expr) -> None:
        if isinstance(node, ast.BoolOp):
            for v in node.values:
                check(v)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMP:
            try:
                _check(node.left, guard)
                _check(node.comparators[0], guard)
            except DoolyError as exc:
                raise DoolyError(f"bad guard {guard[:60]!r}: {exc}") from None
        else:
            raise DoolyError(f"bad guard {guard[:60]!r}: {ast.dump(node)[:60]} is not a comparison")

    check(tree)
    return tree


def eval_guard(guard: str, values: Mapping[str, int]) -> bool:
    """Whether a guard holds at the given request values: comparisons of expressions (``kv_len + 1 < 64``),
    joined by ``and`` / ``or`` with parentheses, evaluated by the same whitelist walker as :func:`eval_expr`."""

    def walk(node: ast.expr) -> bool:
        if isinstance(node, ast.BoolOp):
            parts = (walk(v) for v in node.values)
            return any(parts) if isinstance(node.op, ast.Or) else all(parts)
        assert isinstance(node, ast.Compare)
        a, b = _eval(node.left, values, guard), _eval(node.comparators[0], values, guard)
        return _CMP[type(node.ops[0])](a, b)

    return walk(_parse_guard(guard))


def expr_symbols(expr: Dim) -> frozenset[str]:
    """The request symbols an expression uses (empty for an int)."""
    if isinstance(expr, int):
        return frozenset()
    return frozenset(n.id for n in ast.walk(_parse(expr)) if isinstance(n, ast.Name) and n.id in REQUEST_SYMBOLS)


# ---------------------------------------------------------------------------------------------------------
# TensorSpec / Signature
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One tensor input: shape and stride (ints = constants, strings = request expressions) and dtype."""

    shape: tuple[Dim, ...]
    dtype: str
    stride: tuple[Dim, ...] | None = None  # None: contiguous

    def symbols(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for d in self.shape + (self.stride or ()):
            out |= expr_symbols(d)
        return out

    def concrete(self, values: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """(shape, stride) as ints at the given request values (stride None = contiguous)."""
        shape = tuple(eval_expr(d, values) for d in self.shape)
        stride = None if self.stride is None else tuple(eval_expr(d, values) for d in self.stride)
        return shape, stride

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype}
        if self.stride is not None:
            d["stride"] = list(self.stride)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorSpec:
        stride = d.get("stride")
        return cls(_dims(d["shape"]), str(d["dtype"]), None if stride is None else _dims(stride))


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (a size-0 dimension counts as 1)."""
    acc, out = 1, []
    for d in reversed(shape):
        out.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(out))


def _dims(values: Any) -> tuple[Dim, ...]:
    """Stored dimensions, checked: each a bounded int or a well-formed expression (a trace read from a file
    must not carry a list, a float or an expression that only fails once something evaluates it)."""
    if not isinstance(values, list | tuple):
        raise DoolyError(f"bad shape {values!r}: expected a list of dimensions")
    for v in values:
        if isinstance(v, str):
            _parse(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            _bounded(v, str(v))
        else:
            raise DoolyError(f"bad shape expression {v!r}: a dimension is an int or an expression string")
    return tuple(values)


def _walk_args(obj: Any, fn: Callable[[dict], Any]) -> Any:
    """Rebuild a decoded args structure, replacing each tagged dict via ``fn``.

    A tag is a one-key dict whose value is a scalar, so a kwarg such as ``{"dtype": {"dtype": "bool"}}``
    is a dict holding a tag, not a tag itself.
    """
    if isinstance(obj, list):
        return [_walk_args(x, fn) for x in obj]
    if isinstance(obj, dict):
        if len(obj) == 1:
            ((name, value),) = obj.items()
            if name in _TAGS and not isinstance(value, dict | list):
                return fn(obj)
        return {k: _walk_args(v, fn) for k, v in obj.items()}
    return obj


_TAGS = ("tensor", "sym", "dtype", "device", "layout", "memory_format", "float")


def canonical_json(obj: Any) -> str:
    """The one JSON spelling used in signatures (sorted keys, no spaces)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class Signature:
    """What one operator call computes, independent of the model that issued it (see the module docstring)."""

    op: str
    inputs: tuple[TensorSpec, ...]
    args: str  # canonical JSON: {"args": [...], "kwargs": {...}}
    engine: str

    @property
    def key(self) -> str:
        """Stable hex digest (sha256, 32 hex chars) of the canonical JSON of this signature."""
        return hashlib.sha256(canonical_json(self.to_dict()).encode()).hexdigest()[:32]

    def symbols(self) -> frozenset[str]:
        """Request symbols this signature depends on (empty: a pure model constant op)."""
        out: frozenset[str] = frozenset()
        for t in self.inputs:
            out |= t.symbols()

        def visit(tag: dict) -> None:
            nonlocal out
            if "sym" in tag:
                out |= expr_symbols(tag["sym"])

        _walk_args(json.loads(self.args), visit)
        return out

    def concrete(self, values: Mapping[str, int]) -> tuple[list[tuple[tuple[int, ...], tuple[int, ...] | None]], Any]:
        """Concrete ``[(shape, stride)]`` per input and the decoded args with every ``{"sym": e}`` evaluated."""
        shapes = [t.concrete(values) for t in self.inputs]

        def sub(tag: dict) -> Any:
            if "sym" in tag:
                return eval_expr(tag["sym"], values)
            return tag

        return shapes, _walk_args(json.loads(self.args), sub)

    def build_call(
        self, values: Mapping[str, int], make_tensor: Callable[[int, TensorSpec, tuple[int, ...], Any], Any]
    ) -> tuple[list[Any], dict[str, Any]]:
        """``(args, kwargs)`` to call the op with at ``values``.

        ``make_tensor(index, spec, shape, stride)`` creates input ``index`` (e.g. ``torch.empty_strided`` + fill);
        dtypes, devices, layouts and memory formats are decoded to torch objects, ``{"float": "inf"}`` to floats.
        """
        import torch

        shapes = [t.concrete(values) for t in self.inputs]
        made: dict[int, Any] = {}

        def sub(tag: dict) -> Any:
            ((name, v),) = tag.items()
            if name == "tensor":
                if v not in made:
                    shape, stride = shapes[v]
                    made[v] = make_tensor(v, self.inputs[v], shape, stride)
                return made[v]
            if name == "sym":
                return eval_expr(v, values)
            if name == "dtype":
                return getattr(torch, v)
            if name == "device":
                return torch.device(v)
            if name in ("layout", "memory_format"):
                return getattr(torch, v.removeprefix("torch."))
            return float(v)

        decoded = json.loads(self.args)
        return _walk_args(decoded["args"], sub), {k: _walk_args(v, sub) for k, v in decoded["kwargs"].items()}

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "inputs": [t.to_dict() for t in self.inputs], "args": self.args, "engine": self.engine}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Signature:
        args = d["args"]
        decoded = json.loads(args) if isinstance(args, str) else None
        if not (
            isinstance(decoded, dict)
            and isinstance(decoded.get("args"), list)
            and isinstance(decoded.get("kwargs"), dict)
        ):
            raise DoolyError(
                f'bad signature args {str(args)[:60]!r}: expected JSON {{"args": [...], "kwargs": {{...}}}}'
            )
        return cls(str(d["op"]), tuple(TensorSpec.from_dict(t) for t in d["inputs"]), args, str(d["engine"]))

    def __str__(self) -> str:
        ins = ", ".join(f"{t.dtype}[{', '.join(map(str, t.shape))}]" for t in self.inputs)
        return f"{self.op}({ins})"


# ---------------------------------------------------------------------------------------------------------
# OpRecord / ModelTrace
# ---------------------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_of(module: str) -> int | None:
    """First integer component of a dotted module path (``model.layers.3.mlp`` -> 3)."""
    m = _LAYER_RE.search(module)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class OpRecord:
    """One operator call of a traced pass."""

    signature: Signature
    order: int  # position in the pass (0-based)
    module: str  # dotted module path of the innermost module running when it was dispatched ("" = top level)
    layer: int | None = None
    view: bool = False  # view / metadata-only op (no kernel, no data movement)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sig": self.signature.key,
            "order": self.order,
            "module": self.module,
            "layer": self.layer,
            "view": self.view,
        }


@dataclass
class ModelTrace:
    """Every operator one phase of one model ran, with provenance-labelled shapes."""

    model: str
    config_hash: str
    phase: str
    engine: str
    records: list[OpRecord]
    hints: dict[str, int] = field(default_factory=dict)  # dummy request values the pass ran at
    guards: list[str] = field(default_factory=list)  # conditions on request symbols the pass relied on
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. attn_implementation, dtype, seconds
    # The same phase traced where the guards above do not hold (the engine's code branches on a request size):
    # each side has its own hints, guards and records. Empty when one trace covers every request size.
    sides: list[ModelTrace] = field(default_factory=list)

    def unique(self) -> dict[Signature, int]:
        """Each distinct signature with how many times the pass ran it (repeated layers count once)."""
        return dict(Counter(r.signature for r in self.records))

    def branches(self) -> list[ModelTrace]:
        """This trace and its sides: the passes the engine runs in this phase, each where its guards hold."""
        return [self, *self.sides]

    def at(self, values: Mapping[str, int]) -> ModelTrace:
        """The branch whose guards hold at ``values`` (this trace when none does: outside every traced side)."""
        for b in self.sides and self.branches():
            if all(eval_guard(g, values) for g in b.guards):
                return b
        return self

    def all_unique(self) -> dict[Signature, int]:
        """Every signature of every branch, with its largest multiplicity (what profiling this phase needs)."""
        out: dict[Signature, int] = {}
        for b in self.branches():
            for sig, n in b.unique().items():
                out[sig] = max(n, out.get(sig, 0))
        return out

    def kernels(self) -> list[OpRecord]:
        """Records that launch work (view/metadata-only ops left out)."""
        return [r for r in self.records if not r.view]

    def to_json(self) -> str:
        return json.dumps(self._doc(), indent=1, sort_keys=True)

    def _doc(self) -> dict[str, Any]:
        sigs: dict[str, dict[str, Any]] = {}
        for r in self.records:
            sigs.setdefault(r.signature.key, r.signature.to_dict())
        doc = {
            "format": "dooly.trace/1",
            "model": self.model,
            "config_hash": self.config_hash,
            "phase": self.phase,
            "engine": self.engine,
            "hints": self.hints,
            "guards": self.guards,
            "meta": self.meta,
            "signatures": sigs,
            "records": [r.to_dict() for r in self.records],
        }
        if self.sides:
            doc["sides"] = [b._doc() for b in self.sides]
        return doc

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> ModelTrace:
        try:
            doc = json.loads(text)
        except (TypeError, ValueError, RecursionError) as exc:
            raise DoolyError(f"{source}: malformed dooly trace ({type(exc).__name__}: {exc})") from None
        return cls._from_doc(doc, source)

    @classmethod
    def _from_doc(cls, doc: Any, source: str, depth: int = 0) -> ModelTrace:
        if not isinstance(doc, dict) or doc.get("format") != "dooly.trace/1":
            fmt = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise DoolyError(f"{source}: not a dooly trace (format {fmt!r})")
        sides = doc.get("sides", [])
        if not isinstance(sides, list) or (depth and sides):
            raise DoolyError(f"{source}: malformed dooly trace (sides must be a list of traces, one level deep)")
        branches = [cls._from_doc(b, source, depth + 1) for b in sides]
        try:
            guards = [str(g) for g in doc.get("guards", [])]
            for g in guards:
                _parse_guard(g)
            sigs = {k: Signature.from_dict(v) for k, v in doc["signatures"].items()}
            records = [
                OpRecord(sigs[r["sig"]], int(r["order"]), str(r["module"]), _layer(r.get("layer")), bool(r.get("view")))
                for r in doc["records"]
            ]
            return cls(
                model=str(doc["model"]),
                config_hash=str(doc["config_hash"]),
                phase=str(doc["phase"]),
                engine=str(doc["engine"]),
                records=records,
                hints={k: int(v) for k, v in doc.get("hints", {}).items()},
                guards=guards,
                meta=dict(doc.get("meta", {})),
                sides=branches,
            )
        except DoolyError as exc:  # a bad signature inside: say which file it came from
            raise DoolyError(f"{source}: malformed dooly trace ({exc})") from None
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:
            raise DoolyError(f"{source}: malformed dooly trace ({type(exc).__name__}: {exc})") from None


def _layer(v: Any) -> int | None:
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise TypeError(f"layer {v!r} is not an int")


def traces_to_json(traces: list[ModelTrace]) -> str:
    """Several traces as one JSON document (``{"format": "dooly.traces/1", "traces": [...]}``)."""
    return json.dumps({"format": "dooly.traces/1", "traces": [t._doc() for t in traces]}, indent=1)


def traces_from_json(text: str, source: str = "<string>") -> list[ModelTrace]:
    """Inverse of :func:`traces_to_json`; also accepts a single trace document."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise DoolyError(f"{source}: not JSON ({exc})") from None
    if isinstance(doc, dict) and doc.get("format") == "dooly.traces/1":
        return [ModelTrace.from_json(json.dumps(t), source) for t in doc.get("traces", [])]
    return [ModelTrace.from_json(text, source)]

"""The signature data model: safe expressions, stable keys, JSON round trips, concrete calls."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dooly.core.errors import DoolyError
from dooly.trace.signature import (
    ModelTrace,
    OpRecord,
    Signature,
    TensorSpec,
    canonical_json,
    eval_expr,
    expr_symbols,
    layer_of,
    traces_from_json,
    traces_to_json,
)


def _mm() -> Signature:
    return Signature(
        "aten.mm.default",
        (TensorSpec(("requests*tokens", 64), "bfloat16"), TensorSpec((64, 128), "bfloat16", (1, 64))),
        canonical_json({"args": [{"tensor": 0}, {"tensor": 1}], "kwargs": {}}),
        "hf-eager/cpu",
    )


def test_expressions_evaluate_with_a_whitelist() -> None:
    v = {"requests": 3, "tokens": 37, "kv_len": 113}
    assert eval_expr("requests*tokens", v) == 111
    assert eval_expr("kv_len + 1", v) == 114
    assert eval_expr("2*requests*tokens", v) == 222
    assert eval_expr("(kv_len + tokens)//(2)", v) == 75
    assert eval_expr("max(tokens, kv_len - 100)", v) == 37
    assert eval_expr(4096, v) == 4096
    assert expr_symbols("kv_len + tokens") == {"kv_len", "tokens"}
    assert expr_symbols(7) == frozenset()


@pytest.mark.parametrize(
    "bad", ["__import__('os').system('true')", "tokens.real", "foo + 1", "tokens if 1 else 2", "[1]", "1.5*tokens"]
)
def test_expressions_reject_anything_else(bad: str) -> None:
    with pytest.raises(DoolyError):
        eval_expr(bad, {"tokens": 1})


@pytest.mark.parametrize(
    "hostile",
    [
        "9**9**9",  # ran for more than a minute before exponents were bounded
        "tokens**100000000",
        "(2**62)*(2**62)*(2**62)",
        "2**63*4",
        "max(99999999999999999999999, tokens)",
        "tokens // (kv_len - kv_len)",
        "tokens % 0",
        "tokens**-1",
        "2**2**2**2**2**2",
    ],
)
def test_hostile_expressions_fail_fast_with_one_line(hostile: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(DoolyError) as exc:
        eval_expr(hostile, {"tokens": 37, "kv_len": 113})
    assert time.perf_counter() - t0 < 10  # a bound on a blow-up (a hang), not a speed: generous for busy machines
    msg = str(exc.value)
    assert "\n" not in msg and "bad shape expression" in msg and hostile[:20] in msg


def test_bounds_leave_real_sizes_alone() -> None:
    v = {"tokens": 2**20, "kv_len": 3}
    assert eval_expr("2**62", v) == 2**62
    assert eval_expr("tokens*tokens*tokens", v) == 2**60
    assert eval_expr("1**1000000 + 0**1000000", v) == 1
    assert eval_expr("(-2)**63", v) == -(2**63)
    assert eval_expr(2**63, v) == 2**63
    with pytest.raises(DoolyError, match="beyond 2"):
        eval_expr(2**64, v)


def test_missing_symbol_value_is_a_clear_error() -> None:
    with pytest.raises(DoolyError, match="kv_len"):
        eval_expr("kv_len + 1", {"tokens": 3})


def test_signature_key_is_stable_and_hashable() -> None:
    a, b = _mm(), _mm()
    assert a == b and hash(a) == hash(b) and a.key == b.key
    assert len(a.key) == 32 and int(a.key, 16) >= 0
    c = Signature(a.op, (TensorSpec(("requests*tokens", 64), "bfloat16"), a.inputs[1]), a.args, "hf-eager/cuda")
    assert c.key != a.key  # the engine is part of the identity
    assert a.symbols() == {"requests", "tokens"}
    assert Signature.from_dict(a.to_dict()) == a


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda s, r: s["inputs"][0]["shape"].__setitem__(0, [1, 2]), "int or an expression"),  # was: unhashable
        (lambda s, r: s["inputs"][0]["shape"].__setitem__(0, "tokens +"), "bad shape expression"),
        (lambda s, r: s["inputs"][0]["shape"].__setitem__(0, 2**80), "beyond 2"),
        (lambda s, r: s["inputs"][0].__setitem__("shape", "abc"), "list of dimensions"),
        (lambda s, r: s.__setitem__("args", "[1]"), "bad signature args"),
        (lambda s, r: r.__setitem__("layer", [3]), "layer"),
        (lambda s, r: r.__setitem__("order", 1e999), "OverflowError"),
    ],
)
def test_a_malformed_trace_file_is_one_error_naming_it(edit, why: str) -> None:  # noqa: ANN001
    doc = json.loads(ModelTrace("m", "h", "prefill", "e", [OpRecord(_mm(), 0, "model.layers.0", 0)]).to_json())
    edit(next(iter(doc["signatures"].values())), doc["records"][0])
    with pytest.raises(DoolyError, match=rf"^t\.json: malformed dooly trace \(.*{why}"):
        ModelTrace.from_json(json.dumps(doc), "t.json")


def test_concrete_and_build_call() -> None:
    sig = Signature(
        "aten.view.default",
        (TensorSpec(("requests", "tokens", 64), "float32"),),
        canonical_json({"args": [{"tensor": 0}, [{"sym": "requests*tokens"}, 64]], "kwargs": {}}),
        "hf-eager/cpu",
    )
    shapes, args = sig.concrete({"requests": 2, "tokens": 5})
    assert shapes == [((2, 5, 64), None)]
    assert args["args"][1] == [10, 64]

    def make(i: int, spec: TensorSpec, shape: tuple[int, ...], stride: object) -> torch.Tensor:
        return torch.zeros(shape, dtype=getattr(torch, spec.dtype))

    call_args, call_kwargs = sig.build_call({"requests": 2, "tokens": 5}, make)
    out = torch.ops.aten.view.default(*call_args, **call_kwargs)
    assert tuple(out.shape) == (10, 64)


def test_trace_json_round_trip_and_unique() -> None:
    sig = _mm()
    recs = [OpRecord(sig, i, f"model.layers.{i}.mlp.up_proj", i) for i in range(3)]
    tr = ModelTrace("m", "abc", "prefill", "hf-eager/cpu", recs, {"requests": 3, "tokens": 37}, ["tokens < 4095"])
    assert tr.unique() == {sig: 3}
    back = ModelTrace.from_json(tr.to_json())
    assert back.unique() == {sig: 3} and back.guards == tr.guards and back.records[2].layer == 2
    assert [t.model for t in traces_from_json(traces_to_json([tr, tr]))] == ["m", "m"]
    with pytest.raises(DoolyError, match="x.json"):
        ModelTrace.from_json('{"format": "dooly.trace/1"}', "x.json")


def test_layer_of() -> None:
    assert layer_of("model.layers.12.self_attn.q_proj") == 12
    assert layer_of("lm_head") is None


def test_build_call_kwargs_named_like_a_tag() -> None:
    doc = {"args": [[{"sym": "requests"}, 3]], "kwargs": {"dtype": {"dtype": "bool"}}}
    sig = Signature("aten.ones.default", (), json.dumps(doc), "hf-eager/cpu")
    args, kwargs = sig.build_call({"requests": 2}, lambda *a: None)
    assert args == [[2, 3]] and kwargs == {"dtype": torch.bool}
    assert torch.ops.aten.ones.default(*args, **kwargs).shape == (2, 3)

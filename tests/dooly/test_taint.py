"""Taint labels: request sizes are symbols, config numbers are ints, arithmetic keeps both."""

from __future__ import annotations

import pytest
import sympy
import torch

from dooly.core.errors import DoolyError
from dooly.trace.taint import Label, OpRecorder, RequestSymbols, render, render_guard


def test_equal_dummy_values_stay_distinct_symbols_and_model_ints_stay_ints() -> None:
    syms = RequestSymbols()
    r = syms.new("requests", 8)
    t = syms.new("tokens", 8)  # same dummy value as requests: still its own symbol
    with syms.fake_mode:
        x = torch.zeros(r, t, 8)  # the last 8 is a MODEL constant equal to both dummy values
    assert [syms.dim(d) for d in x.shape] == ["requests", "tokens", 8]
    assert [syms.label(d) for d in x.shape] == [Label.REQUEST, Label.REQUEST, Label.MODEL]


def test_arithmetic_keeps_labels() -> None:
    syms = RequestSymbols()
    r, t = syms.new("requests", 3), syms.new("tokens", 37)
    k = syms.new("kv_len", 113)
    with syms.fake_mode:
        x = torch.zeros(r, t, 4096)
        y = x.view(r * t, 4096)
        z = torch.zeros(r, k + t)
    assert syms.dim(y.shape[0]) == "requests*tokens"
    assert syms.dim(y.shape[0] * 4096) == "4096*requests*tokens"
    assert syms.label(y.shape[0] * 4096) == Label.MIXED
    assert syms.dim(z.shape[1]) == "kv_len + tokens"
    assert syms.dim(y.shape[1]) == 4096 and syms.label(y.shape[1]) == Label.MODEL


def test_render_canonical_forms() -> None:
    t, k = sympy.Symbol("tokens", integer=True, positive=True), sympy.Symbol("kv_len", integer=True, positive=True)
    assert render(sympy.Integer(7)) == 7
    assert render(k - 1) == "kv_len - 1"
    assert render(2 * (k + t)) == "2*kv_len + 2*tokens"
    assert render(sympy.Max(t, k)) == "max(kv_len, tokens)"
    assert render_guard(sympy.Le(-k, -50)) == "kv_len >= 50"
    with pytest.raises(DoolyError, match="not a request symbol"):
        render(sympy.Symbol("u0") + 1)


def test_a_specialised_request_size_is_an_error_not_a_silent_constant() -> None:
    syms = RequestSymbols()
    t = syms.new("tokens", 5)
    torch._check(t == 5)  # what an int(seq_len) in engine code does to the symbol
    with pytest.raises(DoolyError, match="specialised request size tokens"):
        syms.check_specialised()


def test_recorder_reads_request_derived_values_but_not_weight_derived_ones() -> None:
    syms = RequestSymbols()
    r, t = syms.new("requests", 3), syms.new("tokens", 5)
    with syms.fake_mode:
        w = torch.empty(16, 4)  # stands for a weight: created before recording, value unknown
        rec = OpRecorder(syms, "test/cpu", lambda: "m")
        with rec:
            rec.recording = True
            mask = torch.ones(r, t, dtype=torch.long)
            assert bool(mask.sum() == mask.numel())  # the real value, read as a real run would
            with pytest.raises(DoolyError, match="value computed from the weights"):
                bool(w.sum() > 0)
    ops = [s.op for s, _, _ in rec.calls]
    assert "aten.ones.default" in ops and "aten._local_scalar_dense.default" in ops
    assert rec.data_reads == ["m: True"]

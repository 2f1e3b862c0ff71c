"""Workloads: trace files (CSV/JSONL, Vidur's column names), generators and their errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dooly.core.errors import DoolyError
from dooly.simulator import generate_workload, load_workload, parse_workload


def test_csv_roundtrip(tmp_path):
    w = generate_workload(20, rate=5.0, prompt="10-50", output="ln:20:0.5", seed=1)
    path = w.save(tmp_path / "w.csv")
    back = load_workload(path)
    np.testing.assert_allclose(back.arrival, w.arrival, atol=1e-6)
    np.testing.assert_array_equal(back.prompt, w.prompt)
    np.testing.assert_array_equal(back.output, w.output)


def test_jsonl_with_vidur_columns_and_epoch_times(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"arrived_at": 1700000002.5, "num_prefill_tokens": 30, "num_decode_tokens": 4},
        {"arrived_at": 1700000001.0, "num_prefill_tokens": 10, "num_decode_tokens": 2},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w = load_workload(path)
    np.testing.assert_allclose(w.arrival, [0.0, 1.5])  # sorted, shifted to start at 0
    assert list(w.prompt) == [10, 30] and list(w.output) == [2, 4]


def test_generators_are_deterministic_and_hit_the_rate():
    a = generate_workload(4000, rate=10.0, seed=5)
    b = generate_workload(4000, rate=10.0, seed=5)
    np.testing.assert_array_equal(a.arrival, b.arrival)
    assert 9.0 < len(a) / a.arrival[-1] < 11.0
    g = generate_workload(4000, rate=10.0, arrival="gamma", cv=3.0, seed=5)
    gaps = np.diff(g.arrival)
    assert 9.0 < 1 / gaps.mean() < 11.0
    assert gaps.std() / gaps.mean() > 2.0  # bursty, unlike Poisson's cv of 1
    s = generate_workload(5, rate=1.0, arrival="static", prompt="7", output="3")
    assert np.all(s.arrival == 0) and np.all(s.prompt == 7)


def test_length_specs():
    w = generate_workload(500, rate=1.0, prompt="32-64", output="ln:50:1.0", seed=0)
    assert w.prompt.min() >= 32 and w.prompt.max() <= 64
    assert w.output.min() >= 1 and w.output.max() <= 400
    assert 35 < np.median(w.output) < 70


def test_parse_spec():
    w = parse_workload("poisson:n=12,rate=3,prompt=100,output=5-9,seed=2")
    assert len(w) == 12 and np.all(w.prompt == 100)
    with pytest.raises(DoolyError, match="unknown generator keys"):
        parse_workload("poisson:n=3,speed=1")
    with pytest.raises(DoolyError, match="bad length spec"):
        parse_workload("poisson:n=3,prompt=abc")
    with pytest.raises(DoolyError, match="neither a workload file"):
        parse_workload("lunar:n=3")


def test_bad_files(tmp_path):
    with pytest.raises(DoolyError, match="no such workload file"):
        load_workload(tmp_path / "missing.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_time,prompt_tokens\n0,10\n")
    with pytest.raises(DoolyError, match=r"bad\.csv.*output_tokens"):
        load_workload(bad)
    neg = tmp_path / "neg.csv"
    neg.write_text("arrival_time,prompt_tokens,output_tokens\n0,0,3\n")
    with pytest.raises(DoolyError, match=">= 1"):
        load_workload(neg)
    junk = tmp_path / "junk.jsonl"
    junk.write_text("{not json\n")
    with pytest.raises(DoolyError, match="junk.jsonl"):
        load_workload(junk)

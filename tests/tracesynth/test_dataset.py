"""The shipped dataset (data/): every file loads, validates and matches data/manifest.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracesynth.collect import sha256_file
from tracesynth.trace import Trace
from tracesynth.workloads import CATALOGUE

DATA = Path(__file__).resolve().parents[2] / "data"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
ENTRIES = MANIFEST["traces"]


def test_one_trace_per_catalogue_workload_within_budget():
    assert sorted(e["workload"] for e in ENTRIES) == sorted(CATALOGUE)
    files = sorted(p.name for p in DATA.glob("*.parquet"))
    assert files == sorted(e["file"] for e in ENTRIES)
    assert sum((DATA / e["file"]).stat().st_size for e in ENTRIES) <= 40 * 1024 * 1024


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["file"] for e in ENTRIES])
def test_dataset_file_matches_manifest(entry):
    path = DATA / entry["file"]
    assert sha256_file(path) == entry["sha256"]
    assert path.stat().st_size == entry["bytes"]
    trace = Trace.load(path)  # validates: sorted ts, no null ts/event
    assert len(trace) == entry["events"] >= 200_000
    assert trace.n_event_types == entry["event_types"]
    assert [[k, v] for k, v in trace.event_counts().items()] == entry["event_counts"]
    assert abs(trace.duration_ns / 1e9 - entry["duration_s"]) < 1e-5
    meta = trace.metadata
    assert meta["workload"] == entry["workload"] and meta["kernel"] == entry["kernel"]
    assert meta["source_format"] == "perf-data" and meta["clock"] == "perf_clock"
    # real kernel traces in the shared vocabulary, with perf's per-sample thread, CPU and return values
    counts = dict(entry["event_counts"])
    assert counts.get("sched_switch", 0) > 0 and any(e.startswith("syscall_entry_") for e in counts)
    assert not any(":" in e for e in counts)
    assert trace.table["tid"].null_count == 0 and trace.table["cpu"].null_count == 0

"""Shared test fixtures: paths to the real traces beside the repo (skipped when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
LTTNG_WGET = SHARED / "traces" / "lttng-wget-kernel"

# One console width wherever the suite runs (a terminal, CI, an xdist worker without one): the CLI tests
# read rich's tables and notes, which wrap at the width rich finds.
os.environ["COLUMNS"] = "200"
# Under pytest-xdist the workers share the cores: torch's threads per worker are the cores split between
# them, since more threads than cores make every op wait for the others (set before torch is imported).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _per_worker = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_per_worker))


@pytest.fixture
def lttng_wget() -> Path:
    if not LTTNG_WGET.exists():
        pytest.skip("../shared/traces/lttng-wget-kernel is absent (it lives beside the repo, not in it)")
    return LTTNG_WGET

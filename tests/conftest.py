"""Shared test fixtures: paths to the real traces beside the repo (skipped when absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
LTTNG_WGET = SHARED / "traces" / "lttng-wget-kernel"


@pytest.fixture
def lttng_wget() -> Path:
    if not LTTNG_WGET.exists():
        pytest.skip("../shared/traces/lttng-wget-kernel is absent (it lives beside the repo, not in it)")
    return LTTNG_WGET

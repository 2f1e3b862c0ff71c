"""SDV's PARSynthesizer baseline (optional: skipped when sdv is not installed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tracesynth.errors import TraceSynthError
from tracesynth.generators import make_generator
from tracesynth.generators.sdv_par import PARBaseline, sdv_available
from tracesynth.trace import Trace

pytestmark = pytest.mark.skipif(sdv_available() is not None, reason=f"sdv not installed ({sdv_available()})")


def test_par_fits_samples_and_keeps_the_vocabulary(tmp_path) -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    n = 600
    names = np.asarray(["syscall_entry_read", "syscall_exit_read", "sched_switch"])
    t = Trace.from_columns(
        ts=np.cumsum(rng.integers(1, 1000, n)), event=names[np.arange(n) % 3].tolist(), cpu=[0] * n, tid=[7] * n
    )
    gen = make_generator({"kind": "sdv_par", "seq_len": 20, "max_sequences": 10, "epochs": 1})
    assert isinstance(gen, PARBaseline)
    s = gen.fit([t]).sample(50, seed=1)
    assert len(s) == 50 and set(s.codes("event")[1]) <= set(names.tolist())
    assert np.all(np.diff(s.ts) >= 0)
    with pytest.raises(TraceSynthError, match="pickle"):
        gen.save(tmp_path)
    with pytest.raises(TraceSynthError):
        PARBaseline(seq_len=1)

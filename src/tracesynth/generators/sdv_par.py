"""SDV's PARSynthesizer (probabilistic auto-regressive LSTM) as an off-the-shelf baseline.

Optional: needs `pip install sdv` (not a dependency of tracesynth). A trace is cut into short
sequences of `seq_len` events, each row (event type, log dt, cpu, thread slot) a step of one
sequence; PAR learns them and samples new sequences, which are concatenated into one trace.

    gen = PARBaseline(seq_len=64, max_sequences=200, epochs=20).fit([trace])
    synth = gen.sample(10_000, seed=0)

save()/load() are not supported: SDV saves synthesizers with pickle, which this project never writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tracesynth.errors import TraceSynthError
from tracesynth.trace import Trace

MAX_TIDS = 16  # distinct threads kept by name; the rest share one slot


def sdv_available() -> str | None:
    """None when SDV's PARSynthesizer imports, else why not (one line)."""
    try:
        from sdv.sequential import PARSynthesizer  # noqa: F401
    except Exception as exc:  # any import failure means "absent"
        return f"{type(exc).__name__}: {exc}"
    return None


class PARBaseline:
    """PARSynthesizer behind the fit/sample interface of tracesynth.generators.Generator."""

    name = "sdv_par"

    def __init__(self, seq_len: int = 64, max_sequences: int = 200, epochs: int = 20, seed: int = 0):
        why = sdv_available()  # an optional third-party dependency: fail at once, not after the data is cut
        if why:
            raise TraceSynthError(f"the sdv_par generator needs SDV, which is not installed ({why}); pip install sdv")
        if seq_len < 2 or max_sequences < 1 or epochs < 1:
            raise TraceSynthError("PAR baseline: seq_len >= 2, max_sequences >= 1 and epochs >= 1 are required")
        self.seq_len, self.max_sequences, self.epochs, self.seed = seq_len, max_sequences, epochs, seed
        self._synth: Any = None
        self._tids: np.ndarray = np.zeros(0, np.int64)

    def fit(self, traces: Sequence[Trace]) -> PARBaseline:
        import pandas as pd
        import torch
        from sdv.metadata import Metadata
        from sdv.sequential import PARSynthesizer

        frames = []
        for t in traces:
            n = (len(t) // self.seq_len) * self.seq_len
            if n:
                frames.append(self._frame(t.slice(len(t) - n)))  # the most recent whole sequences
        if not frames:
            raise TraceSynthError(f"PAR baseline: no trace holds {self.seq_len} events")
        df = pd.concat(frames, ignore_index=True)
        df["seq"] = np.arange(len(df)) // self.seq_len
        keep = df["seq"].unique()[-self.max_sequences :]  # a bounded budget: PAR is slow on a CPU
        df = df[df["seq"].isin(keep)].reset_index(drop=True)
        meta = Metadata.load_from_dict(
            {
                "tables": {
                    "trace": {
                        "columns": {
                            "seq": {"sdtype": "id"},
                            "event": {"sdtype": "categorical"},
                            "log_dt": {"sdtype": "numerical"},
                            "cpu": {"sdtype": "categorical"},
                            "tid": {"sdtype": "categorical"},
                        },
                        "sequence_key": "seq",
                    }
                }
            }
        )
        torch.manual_seed(self.seed)
        np.random.seed(self.seed)  # PAR draws from numpy's global generator
        self._synth = PARSynthesizer(meta, epochs=self.epochs, cuda=False, verbose=False)
        self._synth.fit({"trace": df})  # SDV 2: a dict of one table
        return self

    @property
    def n_params(self) -> int | None:
        return None  # SDV does not expose its network's size

    @property
    def fit_info(self) -> dict[str, Any]:
        return {}

    def _frame(self, t: Trace) -> Any:
        import pandas as pd

        ts = t.ts.astype(np.float64)
        dt = np.diff(ts, prepend=ts[0])
        tid = t.numeric("tid")
        if not len(self._tids):
            vals, counts = np.unique(tid, return_counts=True)
            self._tids = vals[np.argsort(-counts)][:MAX_TIDS]
        slot = np.where(np.isin(tid, self._tids), tid, -1)
        cpu = t.numeric("cpu")
        codes, names = t.codes("event")
        return pd.DataFrame(
            {
                "event": np.asarray(names, dtype=object)[codes],
                "log_dt": np.log1p(np.maximum(dt, 0.0)),
                "cpu": cpu.astype(str),
                "tid": slot.astype(str),
            }
        )

    def sample(self, n_events: int, seed: int = 0) -> Trace:
        if self._synth is None:
            raise TraceSynthError("PAR baseline: sample() before fit()")
        import torch

        np.random.seed(seed)
        torch.manual_seed(seed)
        n_seq = -(-n_events // self.seq_len)
        out = self._synth.sample_sequences(num_sequences=n_seq, sequence_length=self.seq_len)
        df = (out["trace"] if isinstance(out, dict) else out).iloc[:n_events]  # SDV 2 returns a dict of tables
        dt = np.expm1(np.clip(df["log_dt"].to_numpy(np.float64), 0.0, 40.0))
        cpu = df["cpu"].astype(str).to_numpy()
        tid = df["tid"].astype(str).to_numpy()
        return Trace.from_columns(
            ts=np.cumsum(np.round(dt)).astype(np.int64),
            event=df["event"].astype(str).tolist(),
            cpu=[int(c) if c.lstrip("-").isdigit() and int(c) >= 0 else None for c in cpu],
            tid=[int(x) if x.lstrip("-").isdigit() and int(x) >= 0 else None for x in tid],
            metadata={"generator": self.name},
        )

    def save(self, directory: str | Path) -> Path:
        raise TraceSynthError("PAR baseline cannot be saved: SDV writes synthesizers with pickle", Path(directory))

    @classmethod
    def load(cls, directory: str | Path) -> PARBaseline:
        raise TraceSynthError("PAR baseline cannot be loaded: SDV writes synthesizers with pickle", Path(directory))

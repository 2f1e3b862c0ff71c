"""Channel encoding of the Trace table, fixed-length windows, and decoding back to a Trace.

Channels (one value per event):

    event  token of the event type (0 = unknown)
    dt     log-normalised gap to the previous event in ns: (log1p(dt) - mean) / std
    cpu    token of the CPU number (0 = null, 1 = unknown)
    tid    relabelled per window in order of first appearance (0 = null, 1, 2, ...); no real thread
           id is ever learned or emitted; the idle task (tid 0, one per CPU) is null
    comm   token of the command name (0 = null, 1 = unknown)
    ret    bucket: 0 = null, 1 = zero, one bucket per errno value seen, one per log2 bin of positive
           values, and one for any other negative value

The 2-channel mode keeps only `event` and `dt`. Everything is vectorised with numpy; the one loop
is per window (tid relabelling), never per event.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tracesynth.buckets import log2_bucket
from tracesynth.errors import TraceSynthError
from tracesynth.events import IDLE_TID
from tracesynth.trace import Trace
from tracesynth.vocab import remap

CHANNELS_6 = ("event", "dt", "cpu", "tid", "comm", "ret")
CHANNELS_2 = ("event", "dt")
DISCRETE = ("event", "cpu", "tid", "comm", "ret")

UNKNOWN_EVENT = "<unk>"
OTHER_NEGATIVE = "<other negative>"  # the ret token of a negative value that is no errno
N_POS_BINS = 64  # log2 bins for positive return values (covers all of int64)
MAX_ERRNO = 4095  # the kernel's -MAX_ERRNO..-1 range

Encoded = dict[str, np.ndarray]


def channels_for(n: int) -> tuple[str, ...]:
    """The channel names of the 2- or 6-channel mode."""
    if n == 6:
        return CHANNELS_6
    if n == 2:
        return CHANNELS_2
    raise TraceSynthError(f"channels must be 2 or 6, got {n}")


@dataclass
class ChannelCodec:
    """Vocabularies and normalisers learned from real traces; encodes and decodes the channels."""

    channels: tuple[str, ...] = CHANNELS_6
    events: list[str] = field(default_factory=lambda: [UNKNOWN_EVENT])
    cpus: list[int] = field(default_factory=list)
    comms: list[str] = field(default_factory=list)
    errnos: list[int] = field(default_factory=list)  # sorted ascending (most negative first)
    pos_repr: list[int] = field(default_factory=lambda: [1 << b for b in range(N_POS_BINS - 1)] + [2**63 - 1])
    other_neg_repr: int = -1
    dt_mean: float = 0.0
    dt_std: float = 1.0
    dt_max_log: float = 28.0  # log1p of the largest gap seen (decoded gaps are clipped to it)
    max_tids: int = 32

    # -- learning -----------------------------------------------------------------------------
    @classmethod
    def fit(cls, traces: Sequence[Trace], channels: Sequence[str] = CHANNELS_6, max_tids: int = 32) -> ChannelCodec:
        """Build vocabularies (by frequency) and the dt normaliser from real traces."""
        if not traces or not sum(len(t) for t in traces):
            raise TraceSynthError("no events to learn channel vocabularies from")
        counts: dict[str, int] = {}
        for t in traces:
            for k, v in t.event_counts().items():
                counts[k] = counts.get(k, 0) + v
        events = [UNKNOWN_EVENT] + sorted(counts, key=lambda k: (-counts[k], k))
        cpus = sorted({int(c) for t in traces for c in np.unique(t.numeric("cpu")) if c >= 0})
        comm_counts: dict[str, int] = {}
        for t in traces:
            codes, vocab = t.codes("comm")
            if len(vocab):
                binc = np.bincount(codes[codes >= 0], minlength=len(vocab))
                for name, c in zip(vocab, binc, strict=True):
                    if c:
                        comm_counts[name] = comm_counts.get(name, 0) + int(c)
        comms = sorted(comm_counts, key=lambda k: (-comm_counts[k], k))
        rets = np.concatenate([t.table["ret"].drop_null().to_numpy() for t in traces]).astype(np.int64)
        errnos = sorted(int(v) for v in np.unique(rets[(rets < 0) & (rets >= -MAX_ERRNO)]))
        other = rets[rets < -MAX_ERRNO]
        # Positive buckets decode to the median value seen in their bin (the bin's low end if none).
        pos = rets[rets > 0]
        bins = _log2_bin(pos)
        pos_repr = [1 << b for b in range(N_POS_BINS - 1)] + [2**63 - 1]
        for b in np.unique(bins):
            pos_repr[int(b)] = int(np.median(pos[bins == b]))
        logdt = np.concatenate([np.log1p(_gaps(t.ts)) for t in traces if len(t)])
        return cls(
            channels=tuple(channels),
            events=events,
            cpus=cpus,
            comms=comms,
            errnos=errnos,
            pos_repr=pos_repr,
            other_neg_repr=int(np.median(other)) if len(other) else -1,
            dt_mean=float(logdt.mean()),
            dt_std=float(max(logdt.std(), 1e-3)),
            dt_max_log=float(min(logdt.max(), 28.0)),
            max_tids=max_tids,
        )

    @property
    def vocab_sizes(self) -> dict[str, int]:
        """Number of tokens of each discrete channel in use."""
        sizes = {
            "event": len(self.events),
            "cpu": 2 + len(self.cpus),
            "tid": 1 + self.max_tids,
            "comm": 2 + len(self.comms),
            "ret": 2 + len(self.errnos) + N_POS_BINS + 1,
        }
        return {c: sizes[c] for c in self.channels if c in sizes}

    def token_names(self, channel: str) -> list[str]:
        """What each token of a discrete channel stands for, by token id: the key on which two codecs learned
        from different traces agree (`TokenModel.fit(init=)` carries a learned row over by it)."""
        if channel == "event":
            return list(self.events)
        if channel == "cpu":
            return ["<null>", UNKNOWN_EVENT, *(f"cpu{c}" for c in self.cpus)]
        if channel == "tid":
            return [str(i) for i in range(1 + self.max_tids)]
        if channel == "comm":
            return ["<null>", UNKNOWN_EVENT, *self.comms]
        if channel == "ret":
            return ["<null>", "0", *map(str, self.errnos), *(f"2^{b}" for b in range(N_POS_BINS)), OTHER_NEGATIVE]
        raise TraceSynthError(f"no discrete channel {channel!r}")

    # -- encoding -----------------------------------------------------------------------------
    def encode(self, trace: Trace) -> Encoded:
        """Per-event channel values: int64 tokens, float64 dt, raw tid (-1 = null) before windowing."""
        out: Encoded = {}
        codes, vocab = trace.codes("event")
        out["event"] = remap(codes, vocab, {k: i for i, k in enumerate(self.events)}, default=0)
        out["dt"] = (np.log1p(_gaps(trace.ts)) - self.dt_mean) / self.dt_std
        if "cpu" in self.channels:
            cpu = trace.numeric("cpu")
            table = np.asarray(self.cpus or [-1], dtype=np.int64)
            idx = np.minimum(np.searchsorted(table, cpu), len(table) - 1)
            known = (table[idx] == cpu) & (len(self.cpus) > 0)
            out["cpu"] = np.where(cpu < 0, 0, np.where(known, idx + 2, 1)).astype(np.int64)
        if "tid" in self.channels:
            tid = trace.numeric("tid")
            # the idle task (tid 0) is one per CPU, current on several at once: no one thread, so no label
            out["tid"] = np.where(tid == IDLE_TID, -1, tid)
        if "comm" in self.channels:
            codes, vocab = trace.codes("comm")
            tok = remap(codes, vocab, {k: i + 2 for i, k in enumerate(self.comms)}, default=1)
            out["comm"] = np.where(codes < 0, 0, tok)
        if "ret" in self.channels:
            out["ret"] = self._ret_tokens(trace)
        return out

    def _ret_tokens(self, trace: Trace) -> np.ndarray:
        col = trace.table["ret"]
        null = col.is_null().to_numpy(zero_copy_only=False)
        ret = col.fill_null(0).to_numpy().astype(np.int64)
        n_err = len(self.errnos)
        errnos = np.asarray(self.errnos, dtype=np.int64)
        tok = np.full(len(ret), 1, dtype=np.int64)  # zero
        neg = ret < 0
        if n_err:
            i = np.minimum(np.searchsorted(errnos, ret), n_err - 1)
            hit = neg & (errnos[i] == ret)
        else:
            i = np.zeros(len(ret), dtype=np.int64)
            hit = np.zeros(len(ret), dtype=bool)
        tok = np.where(hit, 2 + i, tok)
        tok = np.where(neg & ~hit, 2 + n_err + N_POS_BINS, tok)
        pos = ret > 0
        tok = np.where(pos, 2 + n_err + _log2_bin(np.where(pos, ret, 1)), tok)
        return np.where(null, 0, tok)

    def windows(self, encoded: Encoded, length: int, stride: int | None = None) -> Encoded:
        """Overlapping windows [n, length] of one encoded block (cut inside it, never across blocks)."""
        n = len(encoded["event"])
        stride = stride or length
        if n < length:
            return {c: np.zeros((0, length), dtype=np.float32 if c == "dt" else np.int64) for c in self.channels}
        starts = np.arange(0, n - length + 1, stride)
        if starts[-1] != n - length:  # keep the block's tail
            starts = np.append(starts, n - length)
        idx = starts[:, None] + np.arange(length)[None, :]
        out = {c: encoded[c][idx] for c in self.channels}
        out["dt"] = out["dt"].astype(np.float32)
        if "tid" in out:
            out["tid"] = self.relabel_tids(out["tid"])
        return out

    def relabel_tids(self, raw: np.ndarray) -> np.ndarray:
        """Per window: null -> 0, threads -> 1, 2, ... in order of first appearance (capped at max_tids)."""
        out = np.zeros(raw.shape, dtype=np.int64)
        for w, row in enumerate(raw):  # per window, not per event
            known = row >= 0
            if not known.any():
                continue
            vals = row[known]
            uniq, first, inv = np.unique(vals, return_index=True, return_inverse=True)
            rank = np.empty(len(uniq), dtype=np.int64)
            rank[np.argsort(first, kind="stable")] = np.arange(1, len(uniq) + 1)
            out[w, known] = np.minimum(rank[inv], self.max_tids)
        return out

    # -- decoding -----------------------------------------------------------------------------
    def decode(
        self, windows: Mapping[str, np.ndarray], t0: int = 0, metadata: Mapping[str, Any] | None = None
    ) -> Trace:
        """Turn windows ([n, L] or [L] per channel) back into one Trace, time running on across windows.

        Timestamps are t0 + the cumulative sum of decoded gaps; tids are the small per-window labels.
        """
        ev = np.asarray(windows["event"], dtype=np.int64).reshape(-1)
        n = len(ev)
        dt_log = np.asarray(windows["dt"], dtype=np.float64).reshape(-1) * self.dt_std + self.dt_mean
        # Clip to the largest gap seen so a wild sample cannot overflow the cumulative sum.
        gaps = np.rint(np.expm1(np.clip(dt_log, 0.0, self.dt_max_log))).astype(np.int64)
        ts = t0 + np.cumsum(gaps)
        names = np.asarray(self.events, dtype=object)[np.clip(ev, 0, len(self.events) - 1)]
        cols: dict[str, Any] = {"ts": ts, "event": names}
        if "cpu" in windows:
            tok = np.asarray(windows["cpu"], dtype=np.int64).reshape(-1)
            cpus = np.asarray([-1, -1] + self.cpus, dtype=np.int64)[np.clip(tok, 0, len(self.cpus) + 1)]
            cols["cpu"] = _masked(cpus, cpus < 0)
        if "tid" in windows:
            tok = np.asarray(windows["tid"], dtype=np.int64).reshape(-1)
            cols["tid"] = _masked(tok, tok <= 0)
        if "comm" in windows:
            tok = np.asarray(windows["comm"], dtype=np.int64).reshape(-1)
            table = np.asarray([None, None] + self.comms, dtype=object)
            cols["comm"] = table[np.clip(tok, 0, len(self.comms) + 1)]
        if "ret" in windows:
            tok = np.asarray(windows["ret"], dtype=np.int64).reshape(-1)
            reprs = np.asarray([0, 0] + self.errnos + self.pos_repr + [self.other_neg_repr], dtype=np.int64)
            cols["ret"] = _masked(reprs[np.clip(tok, 0, len(reprs) - 1)], tok <= 0)
        meta = dict(metadata or {})
        return Trace.from_columns(**cols, metadata=meta) if n else Trace.from_columns([], [], metadata=meta)

    # -- storage ------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["channels"] = list(self.channels)
        return d

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ChannelCodec:
        """Read to_json()'s output; a damaged vocab.json is a TraceSynthError, not a later crash."""
        if not isinstance(data, Mapping):
            raise TraceSynthError("vocab.json must hold a JSON object")
        d = dict(data)
        d["channels"] = tuple(d.get("channels") or ())
        if d["channels"] not in (CHANNELS_6, CHANNELS_2):
            raise TraceSynthError(f"vocab.json: unknown channels {list(d['channels'])!r}")

        def is_int(v: Any) -> bool:  # an int64 (the table's integer type)
            return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63

        checks = {
            "events": lambda v: isinstance(v, list) and v and all(isinstance(x, str) for x in v),
            "comms": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
            "cpus": lambda v: isinstance(v, list) and all(is_int(x) and x >= 0 for x in v),
            "errnos": lambda v: isinstance(v, list) and all(is_int(x) for x in v),
            "pos_repr": lambda v: isinstance(v, list) and len(v) == N_POS_BINS and all(is_int(x) for x in v),
            "other_neg_repr": is_int,
            "max_tids": lambda v: is_int(v) and v >= 1,
            **dict.fromkeys(
                ("dt_mean", "dt_std", "dt_max_log"),
                lambda v: isinstance(v, int | float) and not isinstance(v, bool) and abs(v) < 1e6,
            ),
        }
        for key, ok in checks.items():
            if key in d and not ok(d[key]):
                raise TraceSynthError(f"vocab.json: bad {key} ({str(d[key])[:40]})")
        return cls(**d)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def _gaps(ts: np.ndarray) -> np.ndarray:
    """Gap to the previous event (0 for the first), as float64 ns."""
    if len(ts) == 0:
        return np.zeros(0)
    return np.concatenate([[0], np.diff(ts)]).astype(np.float64)


def _log2_bin(v: np.ndarray) -> np.ndarray:
    """floor(log2(v)) for positive int64 values, exactly (no float rounding near powers of two)."""
    return np.clip(log2_bucket(v), 0, N_POS_BINS - 1)


def _masked(values: np.ndarray, null: np.ndarray) -> Any:
    import pyarrow as pa

    return pa.array(values, mask=np.asarray(null, dtype=bool), type=pa.int64())

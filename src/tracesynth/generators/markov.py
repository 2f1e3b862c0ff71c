"""Order-k Markov chain over event types: the simple generator a user would try first.

- event type: order-k chain with back-off to shorter contexts (down to the unigram) when a context
  was only ever seen at the end of a trace;
- dt (gap to the previous event): drawn from the empirical gaps observed for the same
  (previous event, event) transition, falling back to the event type's gaps, then to all gaps;
- cpu / tid / comm: with the probability observed for that event type the row stays on the previous
  row's (cpu, thread), otherwise it is drawn from that event type's empirical (cpu, thread) mix;
  thread ids are relabelled 1..N at fit time so no real thread id reaches a synthetic trace (the idle task,
  every CPU's tid 0, stays 0);
- ret: drawn from the event type's empirical return values (null where the type never returns one).

`sample(n, seed, guide="kernel")` draws the same chain one event at a time under the kernel invariants
(what `generators.guide` does for the `ar` model; the state is a `tracesynth.kernel.KernelState`), keeping the
event sequence the chain draws and moving the event instead: to the CPU where its thread is current, to the
thread current on its CPU, or, where that thread may not do it (an entry inside a call, a wrong or orphan exit),
to another CPU whose current thread may (or a free CPU and a thread current nowhere). Only where no CPU can take
it is the event redrawn from the same Markov context with the forbidden events masked out. The default
`guide="none"` is the plain chain a user would write.

Saved as JSON (config, vocabularies, the tables' sha256, checked on load) + safetensors (tables); no pickle.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from atomicio import atomic_path
from tracesynth.errors import TraceSynthError
from tracesynth.events import IDLE_TID
from tracesynth.integrity import HASHES, file_hashes, verify_hashes
from tracesynth.kernel import EventTables, KernelFacts, KernelState
from tracesynth.trace import Trace
from tracesynth.vocab import Vocab

_MAX_SAMPLES = 512  # empirical values kept per key (dt per transition, ret per type): bounds the model size
TABLES = "tables.safetensors"  # the tables file of a saved chain (beside config.json)


def _subsample(keys: np.ndarray, values: np.ndarray, cap: int, rng: np.random.Generator) -> tuple:
    """Group values by key, keeping at most `cap` random values per key; returns (ukeys, offsets, flat values)."""
    order = np.lexsort((rng.random(len(keys)), keys))  # random order inside each key
    k, v = keys[order], values[order]
    ukeys, start, counts = np.unique(k, return_index=True, return_counts=True)
    rank = np.arange(len(k)) - np.repeat(start, counts)
    keep = rank < cap
    k, v = k[keep], v[keep]
    ukeys, counts = np.unique(k, return_counts=True)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return ukeys, offsets, v


def _draw_grouped(
    query: np.ndarray, ukeys: np.ndarray, offsets: np.ndarray, values: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """For each query key draw one stored value uniformly; returns (values, found mask)."""
    if len(ukeys) == 0:
        return np.zeros(len(query), dtype=values.dtype), np.zeros(len(query), dtype=bool)
    pos = np.clip(np.searchsorted(ukeys, query), 0, len(ukeys) - 1)
    found = ukeys[pos] == query
    lo, hi = offsets[pos], offsets[pos + 1]
    idx = lo + np.floor(rng.random(len(query)) * np.maximum(hi - lo, 1)).astype(np.int64)
    out = values[np.minimum(idx, len(values) - 1)]
    return out, found


@dataclass(frozen=True)
class MarkovConfig:
    """The chain's one option (`tracesynth fit --kind markov` and a pipeline config's {"kind": "markov"})."""

    order: int = 4  # events of context

    kind: ClassVar[str] = "markov"


class MarkovChain:
    """Order-k Markov chain over event types with empirical dt per transition (Generator protocol)."""

    name = "markov"
    contents = ("config.json", TABLES)  # what save() writes

    def __init__(self, order: int = MarkovConfig.order):
        if order < 1:
            raise TraceSynthError(f"Markov order must be >= 1, got {order}")
        self.order = int(order)
        self.name = f"markov{self.order}"
        self.kernel: KernelFacts | None = None  # mined at fit time (for guide="kernel")
        self._fitted = False

    # -- fitting --------------------------------------------------------------------------------
    def fit(self, traces: Sequence[Trace]) -> MarkovChain:
        traces = [t for t in traces if len(t) > 0]
        if not traces:
            raise TraceSynthError("Markov chain: nothing to fit (no events)")
        rng = np.random.default_rng(0)
        events = Vocab(sorted({v for t in traces for v in t.codes("event")[1]}))
        comms = Vocab(sorted({v for t in traces for v in t.codes("comm")[1]}))
        self.vocab, self.comms = events.values, comms.values
        V = len(self.vocab)
        self._base = V + 1  # context digits: 0 = "before the start", 1..V = event code + 1
        if self._base**self.order >= 2**62:
            raise TraceSynthError(f"Markov order {self.order} too high for {V} event types")

        tid_map: dict[int, int] = {}
        cols = [self._columns(t, events, comms, tid_map) for t in traces]
        ev_all = [c["ev"] for c in cols]
        ctx_keys = [[c["ctx"][j] for c in cols] for j in range(self.order + 1)]
        ctx_next = [ev_all for _ in range(self.order + 1)]
        dt_all, key_all = [c["dt"] for c in cols], [c["key"] for c in cols]
        thread_all, same_all, ret_all = [c["thread"] for c in cols], [c["same"] for c in cols], [c["ret"] for c in cols]

        ev = np.concatenate(ev_all)
        self._unigram = np.bincount(ev, minlength=V).astype(np.float64)
        # transition tables, one per order: (context key, next event) -> count
        self._tables: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for j in range(self.order + 1):
            keys = np.concatenate(ctx_keys[j])
            nxt = np.concatenate(ctx_next[j])
            pair, counts = np.unique(keys * V + nxt, return_counts=True)
            self._tables.append((pair // V, pair % V, counts.astype(np.int64)))
        # dt per (prev, next) transition and per event type
        dts = np.concatenate(dt_all)
        keys = np.concatenate(key_all)
        self._dt_pair = _subsample(keys, dts, _MAX_SAMPLES, rng)
        ev_after = np.concatenate([e[1:] for e in ev_all])
        self._dt_event = _subsample(ev_after, dts, _MAX_SAMPLES, rng)
        self._dt_any = dts[rng.permutation(len(dts))[: _MAX_SAMPLES * 4]] if len(dts) else np.zeros(1, np.int64)
        # threads
        thread = np.concatenate(thread_all)
        same = np.concatenate(same_all)
        self._p_same = np.bincount(ev, weights=same, minlength=V) / np.maximum(np.bincount(ev, minlength=V), 1)
        uthreads, tinv = np.unique(thread, axis=0, return_inverse=True)
        self._threads = uthreads.astype(np.int64)
        self._thread_by_event = _subsample(ev, tinv.reshape(-1).astype(np.int64), _MAX_SAMPLES * 4, rng)
        # return values (sentinel = null)
        ret = np.concatenate(ret_all)
        self._ret = _subsample(ev, ret, _MAX_SAMPLES, rng)
        from tracesynth.generators.guide import mine_kernel_facts  # on use: the guide module imports torch

        self.kernel = mine_kernel_facts(traces)
        self._build_samplers()
        self._fitted = True
        return self

    def _columns(self, t: Trace, events: Vocab, comms: Vocab, tid_map: dict[int, int]) -> dict[str, Any]:
        """One trace's columns as the tables count them; threads get the next labels of `tid_map`."""
        ev = events.lookup(*t.codes("event"))
        n, V = len(ev), len(self.vocab)
        # context of order j for position i: events i-j..i-1 as base-(V+1) digits (0 pads the start)
        padded = np.concatenate([np.zeros(self.order, dtype=np.int64), ev + 1])
        ctx = []
        for j in range(self.order + 1):
            key = np.zeros(n, dtype=np.int64)
            for d in range(j, 0, -1):  # oldest digit first: the most recent event is the lowest digit
                key = key * self._base + padded[self.order - d : self.order - d + n]
            ctx.append(key)
        dt = np.diff(t.ts, prepend=t.ts[0]).astype(np.int64)
        prev = np.concatenate([[-1], ev[:-1]])
        tid_raw = t.numeric("tid")
        for x in np.unique(tid_raw):  # relabel threads 1..N (by id, across traces): no real id leaks;
            if x >= 0 and int(x) not in tid_map:  # the idle task stays 0 (it is every CPU's, and exempt)
                tid_map[int(x)] = 0 if x == IDLE_TID else len(tid_map) + 1 - (IDLE_TID in tid_map)
        tid = np.full(n, -1, dtype=np.int64)
        if tid_map:
            lut_keys = np.asarray(sorted(tid_map), dtype=np.int64)
            lut_vals = np.asarray([tid_map[int(k)] for k in lut_keys], dtype=np.int64)
            pos = np.clip(np.searchsorted(lut_keys, tid_raw), 0, len(lut_keys) - 1)
            tid = np.where(tid_raw >= 0, lut_vals[pos], -1)
        thread = np.stack([t.numeric("cpu"), tid, comms.lookup(*t.codes("comm"))], axis=1)
        return {
            "ev": ev,
            "ctx": ctx,
            "dt": dt[1:] if n > 1 else dt[:0],
            "key": (prev * V + ev)[1:],
            "thread": thread,
            "same": np.concatenate([[False], np.all(thread[1:] == thread[:-1], axis=1)]),
            "ret": t.numeric("ret", fill=np.iinfo(np.int64).min),
        }

    def _build_samplers(self) -> None:
        """Per-order dict: context key -> (next events, cumulative probabilities)."""
        self._samplers: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []
        for ctx, nxt, cnt in self._tables:
            d: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            if len(ctx):
                bounds = np.flatnonzero(np.diff(ctx)) + 1
                starts = np.concatenate([[0], bounds])
                ends = np.concatenate([bounds, [len(ctx)]])
                for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
                    c = np.cumsum(cnt[a:b]).astype(np.float64)
                    d[int(ctx[a])] = (nxt[a:b], c / c[-1])
            self._samplers.append(d)

    @property
    def n_params(self) -> int | None:
        """Transition-table entries (None before fit/load)."""
        return int(sum(len(t[2]) for t in self._tables)) if self._fitted else None

    @property
    def fit_info(self) -> dict[str, Any]:
        return {}

    # -- sampling -------------------------------------------------------------------------------
    def sample(self, n_events: int, seed: int = 0, guide: str = "none") -> Trace:
        """Generate n_events events (sampling only; repair is tracesynth.constraints.repair_trace).

        guide: "none" (the plain chain) or "kernel" (draws kept within the kernel invariants; see the module
        docstring)."""
        if not self._fitted:
            raise TraceSynthError("Markov chain: sample() before fit()/load()")
        if guide not in ("none", "kernel"):
            raise TraceSynthError(f"Markov chain: no guide {guide!r} (it can take none, kernel)")
        rng = np.random.default_rng(seed)
        if guide == "kernel":
            return self._sample_guided(n_events, rng)
        base, k = self._base, self.order
        mod = base**k
        ev = np.empty(n_events, dtype=np.int64)
        u = rng.random(n_events)
        key = 0  # the start of a trace: all-zero context
        uni = np.cumsum(self._unigram) / self._unigram.sum()
        # sequential by nature: each event depends on the previous k (one dict lookup per event)
        for i in range(n_events):
            nxt = self._context(key)
            if nxt is None:
                e = int(np.searchsorted(uni, u[i], side="right"))
            else:
                e = int(nxt[0][min(int(np.searchsorted(nxt[1], u[i], side="right")), len(nxt[0]) - 1)])
            ev[i] = e
            key = (key * base + e + 1) % mod
        return self._decorate(ev, rng)

    def _contexts(self, key: int):  # type: ignore[no-untyped-def]
        """The (next events, cumulative probabilities) of every order that saw the context, longest first."""
        k = self.order
        mod = self._base**k
        for j in range(k, -1, -1):
            s = self._samplers[j].get(key % (mod // self._base ** (k - j)) if j < k else key)
            if s is not None:
                yield s

    def _context(self, key: int):  # type: ignore[no-untyped-def]
        return next(self._contexts(key), None)

    def _sample_guided(self, n: int, rng: np.random.Generator) -> Trace:
        """The chain drawn event by event under the kernel invariants (sched consistency, one CPU per thread,
        syscall pairing): each event as the chain draws it, placed on a CPU and thread where it breaks none;
        redrawn (masked) only where no such place exists."""
        draw = _GuidedDraw(self, rng)
        base, mod = self._base, self._base**self.order
        ev = np.empty(n, np.int64)
        out = np.empty((n, 3), np.int64)
        u, keep_u, pick_u = rng.random(n), rng.random(n), rng.random(n)
        key, last = 0, None
        for i in range(n):
            e = draw.event(key, u[i])
            if last is not None and keep_u[i] < self._p_same[e]:
                c, t, cm = last
            else:
                c, t, cm = draw.thread(e, pick_u[i])
            e, c, t, cm = draw.settle(key, e, c, t, cm)
            ev[i], out[i] = e, (c, t, cm)
            last = (c, t, cm)
            key = (key * base + e + 1) % mod
        return self._decorate(ev, rng, out)

    def _decorate(self, ev: np.ndarray, rng: np.random.Generator, thread: np.ndarray | None = None) -> Trace:
        """dt, cpu/tid/comm (unless given: [n, 3]) and ret for a sampled event sequence (vectorised)."""
        n, V = len(ev), len(self.vocab)
        prev = np.concatenate([[-1], ev[:-1]])
        dt, found = _draw_grouped(prev * V + ev, *self._dt_pair, rng)
        dt_e, found_e = _draw_grouped(ev, *self._dt_event, rng)
        dt = np.where(found, dt, np.where(found_e, dt_e, self._dt_any[rng.integers(0, len(self._dt_any), n)]))
        if n:
            dt[0] = 0
        ts = np.cumsum(np.maximum(dt, 0))
        if thread is None:  # keep the previous row's (cpu, thread) or draw a fresh one from this event type's mix
            fresh_idx, _ = _draw_grouped(ev, *self._thread_by_event, rng)
            keep = rng.random(n) < self._p_same[ev]
            if n:
                keep[0] = False
            pos = np.where(keep, 0, np.arange(n))
            pos = np.maximum.accumulate(pos)
            thread = self._threads[fresh_idx[pos]] if len(self._threads) else np.full((n, 3), -1)
        ret, found_r = _draw_grouped(ev, *self._ret, rng)
        null = np.iinfo(np.int64).min
        cpu, tid, comm = thread[:, 0], thread[:, 1], thread[:, 2]
        return Trace.from_columns(
            ts=ts.astype(np.int64),
            event=pa.DictionaryArray.from_arrays(pa.array(ev.astype(np.int32)), pa.array(self.vocab, pa.string())),
            cpu=pa.array(cpu.astype(np.int32), mask=cpu < 0),
            tid=pa.array(tid, mask=tid < 0),
            comm=pa.DictionaryArray.from_arrays(
                pa.array(comm.astype(np.int32), mask=comm < 0), pa.array(self.comms or [""], pa.string())
            ),
            ret=pa.array(ret, mask=~found_r | (ret == null)),
            metadata={"generator": self.name, "synthetic": True},
        )

    # -- storage --------------------------------------------------------------------------------
    def _arrays(self) -> dict[str, np.ndarray]:
        arrays: dict[str, np.ndarray] = {"unigram": self._unigram, "p_same": self._p_same, "threads": self._threads}
        for j, (c, nx, cnt) in enumerate(self._tables):
            arrays[f"t{j}_ctx"], arrays[f"t{j}_next"], arrays[f"t{j}_count"] = c, nx, cnt
        for name in ("dt_pair", "dt_event", "thread_by_event", "ret"):
            uk, off, vals = getattr(self, f"_{name}")
            arrays[f"{name}_keys"], arrays[f"{name}_off"], arrays[f"{name}_vals"] = uk, off, vals
        arrays["dt_any"] = self._dt_any
        return {k: np.ascontiguousarray(v) for k, v in arrays.items()}

    def save(self, directory: str | Path) -> Path:
        if not self._fitted:
            raise TraceSynthError("Markov chain: save() before fit()")
        directory = Path(directory)
        with atomic_path(directory, directory=True, contents=self.contents) as tmp:
            meta = {
                "kind": "markov",
                "order": self.order,
                "vocab": self.vocab,
                "comms": self.comms,
                "kernel": vars(self.kernel) if self.kernel is not None else None,
            }
            save_file(self._arrays(), str(tmp / TABLES))
            meta[HASHES] = file_hashes(tmp, (TABLES,))
            (tmp / "config.json").write_text(json.dumps(meta, indent=1))  # last: it vouches for the tables
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> MarkovChain:
        directory = Path(directory)
        try:
            meta = json.loads((directory / "config.json").read_text())
            if not isinstance(meta, dict) or meta.get("kind") != "markov":
                raise TraceSynthError("not a saved Markov chain (config.json kind is not 'markov')", directory)
            verify_hashes(directory, meta)  # a chain saved before the hashes has none and is not checked
            arrays = load_file(str(directory / TABLES))
            self = cls(int(meta["order"]))
            self.vocab, self.comms = list(meta["vocab"]), list(meta["comms"])
            if not all(isinstance(v, str) for v in self.vocab + self.comms):
                raise TraceSynthError("not a saved Markov chain (vocab/comms hold non-strings)", directory)
            self._base = len(self.vocab) + 1
            if meta.get("kernel") is not None:  # older saves have none: the guide then assumes the defaults
                self.kernel = KernelFacts.from_json(meta["kernel"])
            self._unigram, self._p_same, self._threads = arrays["unigram"], arrays["p_same"], arrays["threads"]
            self._tables = [
                (arrays[f"t{j}_ctx"], arrays[f"t{j}_next"], arrays[f"t{j}_count"]) for j in range(self.order + 1)
            ]
            for name in ("dt_pair", "dt_event", "thread_by_event", "ret"):
                setattr(self, f"_{name}", (arrays[f"{name}_keys"], arrays[f"{name}_off"], arrays[f"{name}_vals"]))
            self._dt_any = arrays["dt_any"]
            th = self._threads
            if th.size and (th.ndim != 2 or th.shape[1] != 3 or th[:, 2].max() >= max(1, len(self.comms))):
                raise ValueError("threads table does not match comms")
            if len(self._p_same) != len(self.vocab):
                raise ValueError("p_same does not match vocab")
            self._build_samplers()
        except TraceSynthError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, SafetensorError) as exc:
            # a damaged config.json or tables file: one line naming the directory
            raise TraceSynthError(f"not a saved Markov chain ({type(exc).__name__}: {exc})", directory) from None
        self._fitted = True
        return self


class _GuidedDraw:
    """One guided sample's kernel state (tracesynth.kernel.KernelState) and how it places the chain's draws."""

    def __init__(self, chain: MarkovChain, rng: np.random.Generator):
        self.chain, self.rng = chain, rng
        self.tables = EventTables.of(chain.vocab, chain.kernel or KernelFacts())
        self.k = KernelState(self.tables)
        self.uni = chain._unigram / chain._unigram.sum()
        uk, off, self.vals = chain._thread_by_event  # dense per event type: where its (cpu, thread, comm) draws lie
        V = len(chain.vocab)
        self.lo, self.hi = np.zeros(V, np.int64), np.zeros(V, np.int64)
        self.lo[uk], self.hi[uk] = off[:-1], off[1:]
        self.threads = chain._threads if len(chain._threads) else np.full((1, 3), -1, np.int64)
        self.cpus = sorted({int(c) for c in self.threads[:, 0] if c >= 0})
        self.mix: dict[int, list[tuple[int, int]]] = {}  # event -> the (thread, comm) pairs it was seen with
        self.comm_of: dict[int, int] = {}

    def event(self, key: int, u: float) -> int:
        """The chain's next event for a context (the unigram where no order saw it)."""
        nxt = self.chain._context(key)
        if nxt is None:
            return int(np.searchsorted(np.cumsum(self.uni), u, side="right").clip(0, len(self.uni) - 1))
        return int(nxt[0][min(int(np.searchsorted(nxt[1], u, side="right")), len(nxt[0]) - 1)])

    def thread(self, e: int, u: float) -> tuple[int, int, int]:
        """A (cpu, thread, comm) drawn from event e's mix."""
        span = self.hi[e] - self.lo[e]
        row = self.vals[self.lo[e] + int(u * span)] if span else 0
        c, t, cm = (int(x) for x in self.threads[row])
        return c, t, cm

    def settle(self, key: int, e: int, c: int, t: int, cm: int) -> tuple[int, int, int, int]:
        """The event as the chain drew it, on a CPU and thread where the invariants allow it; only where no such
        place exists is the event redrawn (a "next"-convention switch keeps its drawn thread). Steps the state."""
        k = self.k
        keeps = e == self.tables.switch and not self.tables.prev
        spot = self.place(e, c, t, cm) if c >= 0 and t >= 0 and not keeps else None
        if spot is not None:
            c, t, cm = spot
        elif c >= 0 and t >= 0:
            if t != IDLE_TID and k.where.get(t, c) != c:
                c = k.where[t]
            elif not keeps and k.owner.get(c, t) != t:
                t = k.owner[c]
                cm = self.comm_of.get(t, cm)
        if t >= 0:
            m = k.allowed(t)
            if not m[e]:
                e = self.masked_draw(key, m)
            self.comm_of[t] = cm
        k.step(e, c, t)
        return e, c, t, cm

    def place(self, e: int, c: int, t: int, cm: int) -> tuple[int, int, int] | None:
        """Where event e can happen: the drawn (cpu, thread) where the invariants allow it, else a CPU whose
        current thread may do e, else a free CPU and a thread of e's mix current nowhere (None: nowhere)."""
        k, rng = self.k, self.rng
        owner, where = k.owner, k.where
        cur = where.get(t) if t != IDLE_TID else None
        if cur is not None:
            if k.may(t, e):
                return cur, t, cm  # a thread's events stay on the CPU where it is current
        elif c not in owner:
            if k.may(t, e):
                return c, t, cm
        elif k.may(owner[c], e):
            return c, owner[c], self.comm_of.get(owner[c], cm)  # a busy CPU's events are its current thread's
        busy = [x for x, o in owner.items() if k.may(o, e) and not (o == IDLE_TID and self.tables.is_syscall[e])]
        if busy:
            x = busy[int(rng.random() * len(busy))]
            return x, owner[x], self.comm_of.get(owner[x], cm)
        free = [x for x in self.cpus if x not in owner]
        if free:
            if e not in self.mix:
                rows = self.threads[self.vals[self.lo[e] : self.hi[e]]]
                self.mix[e] = sorted({(int(r[1]), int(r[2])) for r in rows if r[1] >= 0})
            cands = [(th, co) for th, co in self.mix[e] if th not in where and th != IDLE_TID and k.may(th, e)]
            if cands:
                th, co = cands[int(rng.random() * len(cands))]
                return free[int(rng.random() * len(free))], th, co
        return None

    def masked_draw(self, key: int, m: np.ndarray) -> int:
        """The longest context's next-event distribution with the events `m` forbids taken out."""
        for nxt, cum in self.chain._contexts(key):
            p = np.diff(cum, prepend=0.0) * m[nxt]
            if p.sum() > 0:
                return int(nxt[self.pick(p)])
        p = self.uni * m
        return self.pick(p if p.sum() > 0 else m / m.sum())

    def pick(self, p: np.ndarray) -> int:
        return int(min(np.searchsorted(np.cumsum(p) / p.sum(), self.rng.random(), side="right"), len(p) - 1))

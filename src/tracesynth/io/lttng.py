"""Read LTTng kernel CTF traces (lttng-modules event names) into the Trace table.

Events keep their LTTng names (`syscall_entry_openat`, `syscall_exit_openat`, `sched_switch`,
`irq_handler_entry`, `timer_hrtimer_start`, `lttng_statedump_process_state`, ...). Timestamps are
ns since the trace clock's origin (its offset applied; the Unix epoch for LTTng's monotonic clock).

Columns:

- `cpu`: the stream's packet-context `cpu_id`.
- `ret`: the `ret` payload field of syscall exits (`syscall_exit_*`, `compat_syscall_exit_*`);
  other events stay null (irq_handler_exit's `ret` is an IRQ status, not a syscall result). In a
  trace written by tracesynth (env `tracesynth = 1`) `ret` is read on every event that has it.
- `tid` / `comm`: when events carry LTTng context fields (`lttng add-context -t tid -t procname`),
  those are used as they are (tid -1 and procname "<unknown>" mean unknown in tracesynth-written
  traces; an empty procname means unknown in any trace).
  Otherwise they are derived per CPU from the scheduler, as Trace Compass does: after a CPU's
  `sched_switch`, its events belong to `next_tid`/`next_comm` until the next switch. The
  `sched_switch` row itself is attributed to the task switching *out* (`prev_tid`/`prev_comm`),
  the task that executes the switch (what a `tid` context would say). Events before a CPU's first
  `sched_switch` stay null. With a `tid` context but no `procname`, `comm` comes from the latest
  name known for that tid (statedump `lttng_statedump_process_state` and sched_switch names).

The trace is streamed through `babeltrace2` in blocks (see tracesynth.io.babeltrace) and the
per-CPU state is carried from block to block, so memory holds only the compact result columns.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tracesynth.errors import TraceSynthError
from tracesynth.io.babeltrace import Field, ctf_metadata, iter_ctf_batches
from tracesynth.io.ctf_writer import NULL_COMM
from tracesynth.io.lttng_legacy import LEGACY_SYSCALL_EXITS, normalise_legacy_syscalls
from tracesynth.trace import SCHEMA, Trace
from tracesynth.vocab import Vocab

SYSCALL_EXITS = ("syscall_exit_*", "compat_syscall_exit_*", *LEGACY_SYSCALL_EXITS)
STATEDUMP_PROCESS = "lttng_statedump_process_state"
_MAX_CPUS = 1 << 16  # CPU ids the compiled forward fill indexes its state by (more: the numpy one)


def ctf_trace_dirs(path: Path) -> list[Path]:
    """Directories under `path` that hold a CTF trace (an LTTng session nests them per domain)."""
    from tracesynth.io.ctf_dirs import find_ctf_metadata

    return [m.parent for m in find_ctf_metadata(path)]


def _merged_metadata(dirs: list[Path]) -> dict[str, Any]:
    """Env and clock of the trace(s): the kernel one first when a session holds several."""
    infos = [ctf_metadata(d) for d in dirs]
    infos.sort(key=lambda i: i["env"].get("domain") != "kernel")
    first = infos[0]
    return {
        "env": first["env"],
        "clocks": first["clocks"],
        "context_fields": set().union(*(i["context_fields"] for i in infos)),
        "tracesynth": all(i["env"].get("tracesynth") == 1 for i in infos),
        "ret_events": {n for i in infos for n, fs in i["event_fields"].items() if "ret" in fs},
    }


def _ints(col: pa.Array, null: int = -1) -> np.ndarray:
    return col.fill_null(null).to_numpy(zero_copy_only=False).astype(np.int64)


class _SchedState:
    """Per-CPU running thread carried across blocks, plus the tid -> comm names seen so far."""

    def __init__(self) -> None:
        self.tid: dict[int, int] = {}
        self.comm: dict[int, int] = {}
        self.names: dict[int, int] = {}

    def derive(self, cpu: np.ndarray, is_switch: np.ndarray, prev: tuple, nxt: tuple) -> tuple[np.ndarray, np.ndarray]:
        """tid/comm of each row of one block from sched_switch (a per-CPU forward fill; `prev`/`nxt`: the
        switches' (tid, comm) in row order): one pass of the compiled CTF core's `carry` where a read
        loaded it, else vectorised numpy (same result)."""
        from tracesynth.io.ctf import fast  # here: the babeltrace2 path need not import the native reader

        k = fast.loaded()
        top = int(cpu.max(initial=-1))
        if k is not None and top < _MAX_CPUS:
            return self._carry(k.carry, cpu, is_switch, prev, nxt, top + 1)
        return self._derive_numpy(cpu, is_switch, prev, nxt)

    def _carry(self, carry: Any, cpu: np.ndarray, is_switch: np.ndarray, prev: tuple, nxt: tuple, m: int) -> tuple:
        # the state as arrays indexed by CPU for the kernel, and back (a few CPUs: cheap)
        st_tid = np.full(m, -1, dtype=np.int64)
        st_comm = np.full(m, -1, dtype=np.int32)
        for x, t in self.tid.items():
            if x < m:
                st_tid[x], st_comm[x] = t, self.comm[x]
        tid = np.empty(len(cpu), dtype=np.int64)
        comm = np.empty(len(cpu), dtype=np.int32)
        arr = np.ascontiguousarray
        carry(arr(cpu, np.int64), arr(is_switch).view(np.uint8), arr(prev[0], np.int64), arr(prev[1], np.int32),
              arr(nxt[0], np.int64), arr(nxt[1], np.int32), st_tid, st_comm, tid, comm)  # fmt: skip
        for x in np.flatnonzero(np.bincount(cpu[is_switch & (cpu >= 0)], minlength=m)).tolist():
            self.tid[x], self.comm[x] = int(st_tid[x]), int(st_comm[x])
        return tid, comm

    def _derive_numpy(self, cpu: np.ndarray, is_switch: np.ndarray, prev: tuple, nxt: tuple) -> tuple:
        n = len(cpu)

        def rows(vals: np.ndarray, dtype: type) -> np.ndarray:  # the switches' values on their rows
            out = np.full(n, -1, dtype=dtype)
            out[is_switch] = vals
            return out

        prev_tid, prev_comm = rows(prev[0], np.int64), rows(prev[1], np.int32)
        next_tid, next_comm = rows(nxt[0], np.int64), rows(nxt[1], np.int32)
        order = np.argsort(cpu, kind="stable")  # rows grouped by CPU, time order kept inside
        c = cpu[order]
        pos = np.arange(n)
        last = np.maximum.accumulate(np.where(is_switch[order], pos, -1))  # latest switch at/before
        starts = np.flatnonzero(np.r_[True, c[1:] != c[:-1]]) if n else np.zeros(0, dtype=np.int64)
        lengths = np.diff(np.r_[starts, n])
        group_start = np.repeat(starts, lengths)
        cpus = c[starts]
        carry_tid = np.array([self.tid.get(int(x), -1) for x in cpus], dtype=np.int64)
        carry_comm = np.array([self.comm.get(int(x), -1) for x in cpus], dtype=np.int32)
        group = np.repeat(np.arange(len(starts)), lengths)
        in_group = last >= group_start
        src = order[np.maximum(last, 0)]
        tid_s = np.where(in_group, next_tid[src], carry_tid[group])
        comm_s = np.where(in_group, next_comm[src], carry_comm[group])
        sw = is_switch[order]
        tid_s = np.where(sw, prev_tid[order], tid_s)
        comm_s = np.where(sw, prev_comm[order], comm_s)
        unknown_cpu = c < 0
        tid_s[unknown_cpu] = -1
        comm_s[unknown_cpu] = -1
        # carry each CPU's state at the end of the block into the next one
        ends = starts + lengths - 1
        for g, x in enumerate(cpus):
            if x >= 0 and last[ends[g]] >= starts[g]:
                r = order[last[ends[g]]]
                self.tid[int(x)] = int(next_tid[r])
                self.comm[int(x)] = int(next_comm[r])
        tid = np.empty(n, dtype=np.int64)
        comm = np.empty(n, dtype=np.int32)
        tid[order] = tid_s
        comm[order] = comm_s
        return tid, comm

    def learn_names(self, tids: np.ndarray, comms: np.ndarray) -> None:
        ok = (tids >= 0) & (comms >= 0)
        for t, c in zip(tids[ok].tolist(), comms[ok].tolist(), strict=True):
            self.names[t] = c

    def lookup_names(self, tids: np.ndarray) -> np.ndarray:
        if not self.names:
            return np.full(len(tids), -1, dtype=np.int32)
        keys = np.fromiter(self.names.keys(), dtype=np.int64)
        vals = np.fromiter(self.names.values(), dtype=np.int32)
        srt = np.argsort(keys)
        keys, vals = keys[srt], vals[srt]
        at = np.clip(np.searchsorted(keys, tids), 0, len(keys) - 1)
        return np.where(keys[at] == tids, vals[at], -1).astype(np.int32)


def read_lttng(path: str | Path) -> Trace:
    """Read an LTTng kernel CTF trace (a trace directory or a session directory above it)."""
    path = Path(path)
    if not path.exists():
        raise TraceSynthError("no such file or directory", path)
    if not path.is_dir():
        raise TraceSynthError("an LTTng trace is a directory (with a 'metadata' file and stream files)", path)
    dirs = ctf_trace_dirs(path)
    if not dirs:
        raise TraceSynthError("directory holds no CTF trace (no 'metadata' file found)", path)
    info = _merged_metadata(dirs)
    ctx = info["context_fields"]
    ours = info["tracesynth"]
    has_ctx_tid, has_ctx_comm = "tid" in ctx, "procname" in ctx

    # tracesynth writes unknown comms as NULL_COMM; an empty procname means unknown everywhere
    comms = Vocab(nulls={"", NULL_COMM} if ours else {""})
    events = Vocab()
    state = _SchedState()
    # compact numpy columns (~33 bytes an event); -1 marks nulls in cpu/tid/comm
    cols = _Columns(_event_bound(dirs))
    for batch in iter_ctf_batches(path, _fields(info)):
        n = batch.num_rows
        if n == 0:
            continue
        event = batch["event"]
        names = event.dictionary.to_pylist()
        is_switch = np.zeros(n, dtype=bool)
        if "sched_switch" in names:
            is_switch = event.indices.to_numpy(zero_copy_only=False) == names.index("sched_switch")
        cpu = _ints(batch["cpu"])
        tid, comm = _tid_comm(batch, cpu, is_switch, comms, state, has_ctx_tid, has_ctx_comm)
        ret = batch["ret"]
        ts = batch["ts"].to_numpy()
        # babeltrace2 merges streams in time order; check it here, block by block, instead of on the
        # whole table at the end (whose diff would double the peak memory)
        last = cols.last_ts() if cols.n else ts[0]
        if ts[0] < last or (ts[1:] < ts[:-1]).any():  # compared, not subtracted: a difference may overflow int64
            raise TraceSynthError("timestamps go backwards in babeltrace2's output (corrupt trace?)", path)
        has_ret = ret.is_valid().to_numpy(zero_copy_only=False)
        ret = ret.fill_null(0).to_numpy(zero_copy_only=False)
        cols.append(ts=ts, event=events.grow(event), cpu=cpu, tid=tid, comm=comm, ret=ret, has_ret=has_ret)
    if not cols.n:
        raise TraceSynthError("the trace holds no events", path)
    table = pa.table(_arrays(cols, events, comms), schema=SCHEMA)
    return normalise_legacy_syscalls(Trace(table, _trace_metadata(path, info), validate=False))


def _fields(info: dict[str, Any]) -> list[Field]:
    """The fields to read beside the event, timestamp and CPU, for the trace's context fields."""
    ctx = info["context_fields"]
    # ret: syscall exits; in our own traces every event class that declares a `ret` field
    ret_events = tuple(sorted(glob.escape(n) for n in info["ret_events"])) if info["tracesynth"] else SYSCALL_EXITS
    switch = ("sched_switch",)
    fields = [
        Field("ret", scope="payload", events=ret_events),
        # in lttng-modules' payload order: each field is then found right after the one before
        Field("prev_comm", kind="str", scope="payload", events=switch),
        Field("prev_tid", scope="payload", events=switch),
        Field("next_comm", kind="str", scope="payload", events=switch),
        Field("next_tid", scope="payload", events=switch),
    ]
    has_ctx_tid, has_ctx_comm = "tid" in ctx, "procname" in ctx
    if has_ctx_tid:
        fields.append(Field("tid", scope="context", column="ctx_tid"))
    if has_ctx_comm:
        fields.append(Field("procname", kind="str", scope="context", column="ctx_comm"))
    if has_ctx_tid and not has_ctx_comm:
        fields += [
            Field("tid", scope="payload", events=(STATEDUMP_PROCESS,), column="sd_tid"),
            Field("name", kind="str", scope="payload", events=(STATEDUMP_PROCESS,), column="sd_name"),
        ]
    return fields


def _tid_comm(
    batch: pa.RecordBatch,
    cpu: np.ndarray,
    is_switch: np.ndarray,
    comms: Vocab,
    state: _SchedState,
    has_ctx_tid: bool,
    has_ctx_comm: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """tid and comm codes of one block's rows: from the context fields where the trace has them, else derived
    from sched_switch (and, for comm with a tid context, from the names seen so far)."""
    # the switch fields of the switches alone (a tenth of the rows; null on the others)
    sw = np.flatnonzero(is_switch)
    prev = (_ints(batch["prev_tid"].take(sw)), comms.grow(batch["prev_comm"].take(sw)))
    nxt = (_ints(batch["next_tid"].take(sw)), comms.grow(batch["next_comm"].take(sw)))
    if has_ctx_tid:
        tid = _ints(batch["ctx_tid"])
        tid[tid < 0] = -1
    if has_ctx_comm:
        comm = comms.grow(batch["ctx_comm"])
    if not (has_ctx_tid and has_ctx_comm):
        d_tid, d_comm = state.derive(cpu, is_switch, prev, nxt)
        if not has_ctx_tid:
            tid = d_tid
        if not has_ctx_comm:
            if has_ctx_tid:
                state.learn_names(_ints(batch["sd_tid"]), comms.grow(batch["sd_name"]))
                state.learn_names(*prev)
                state.learn_names(*nxt)
                comm = state.lookup_names(tid)
            else:
                comm = d_comm
    return tid, comm


def _event_bound(dirs: list[Path]) -> int:
    """Events the columns are first sized for: one per 8 bytes of stream data (an LTTng kernel event
    takes 12 to 100), so a trace seldom outgrows them; at most 2**26 (a buffer no bigger than 512 MB
    to reserve: a longer trace grows them)."""
    size = sum(f.stat().st_size for d in dirs for f in d.iterdir() if f.is_file() and f.name != "metadata")
    return min(size // 8 + 1, 1 << 26)


class _Columns:
    """The table's numpy columns, each block written in place: buffers allocated once for the trace's
    bound, never concatenated (a copy of every column) nor split in blocks. The pages past the rows
    written are never touched, so they take address space, not memory; a longer trace doubles them."""

    DTYPES = {"ts": np.int64, "event": np.int32, "cpu": np.int32, "tid": np.int64, "comm": np.int32,
              "ret": np.int64, "has_ret": np.bool_}  # fmt: skip

    def __init__(self, cap: int) -> None:
        self.n = 0
        self.bufs = {k: np.empty(cap, dtype=t) for k, t in self.DTYPES.items()}

    def append(self, **cols: Any) -> None:
        m = len(cols["ts"])
        cap = len(self.bufs["ts"])
        if self.n + m > cap:
            cap = max(2 * cap, self.n + m)
            for k, b in self.bufs.items():
                grown = np.empty(cap, dtype=b.dtype)
                grown[: self.n] = b[: self.n]
                self.bufs[k] = grown
        for k, v in cols.items():
            self.bufs[k][self.n : self.n + m] = v
        self.n += m

    def last_ts(self) -> int:
        return self.bufs["ts"][self.n - 1]

    def take(self, name: str) -> np.ndarray:
        """The column's rows (the buffer's pages past them are never touched)."""
        return self.bufs.pop(name)[: self.n]


def _arrays(cols: _Columns, events: Vocab, comms: Vocab) -> list[pa.Array]:
    """The table's columns in SCHEMA order, zero-copy from the numpy columns."""

    def dict_column(codes: np.ndarray, vocab: Vocab) -> pa.DictionaryArray:
        return pa.DictionaryArray.from_arrays(
            pa.array(codes, type=pa.int32(), mask=codes < 0), pa.array(vocab.values, type=pa.string())
        )

    arrays = [pa.array(cols.take("ts"), type=pa.int64()), dict_column(cols.take("event"), events)]
    for name, type_ in (("cpu", pa.int32()), ("tid", pa.int64())):
        vals = cols.take(name)
        arrays.append(pa.array(vals, type=type_, mask=vals < 0))
    arrays.append(dict_column(cols.take("comm"), comms))
    has_ret = cols.take("has_ret")
    arrays.append(pa.array(cols.take("ret"), type=pa.int64(), mask=~has_ret))
    return arrays


def _trace_metadata(path: Path, info: dict[str, Any]) -> dict[str, Any]:
    env = dict(info["env"])
    embedded = env.pop("tracesynth_metadata", None)
    env.pop("tracesynth", None)
    clock = info["clocks"][0] if info["clocks"] else {}
    meta: dict[str, Any] = {
        "source_format": "lttng",
        "source": str(path),
        "hostname": env.get("hostname"),
        "clock": {k: clock[k] for k in ("name", "freq", "offset_s", "offset") if k in clock},
        "tracer": {k: env[k] for k in ("tracer_name", "tracer_major", "tracer_minor") if k in env},
        "kernel_release": env.get("kernel_release"),
    }
    meta = {k: v for k, v in meta.items() if v not in (None, {})}
    if isinstance(embedded, str):  # a trace written by tracesynth carries its original metadata
        try:
            restored = json.loads(embedded)
        except ValueError:
            restored = None
        if isinstance(restored, dict):
            meta = restored
    return meta

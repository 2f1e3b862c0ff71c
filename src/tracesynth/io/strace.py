"""Reader for `strace -f -ttt -T` text.

Each system call becomes two events in the LTTng vocabulary: ``syscall_entry_<name>`` at the
call's time and ``syscall_exit_<name>`` at that time plus strace's ``<duration>`` (``ret`` holds
the kernel's return value: ``-1 ENOENT`` becomes ``-2`` as LTTng and perf record it). A call split
by another thread (``<unfinished ...>`` ... ``<... name resumed>``) is paired per thread, and the
exit is placed at the entry's time plus the resumed line's duration. Calls that never return
(``exit_group(0) = ?``) have no exit event. Signals become ``signal_deliver`` and ``+++ exited`` /
``+++ killed`` lines ``sched_process_exit``. strace does not see CPUs: ``cpu`` is null. ``tid`` is
the pid column (``[pid N]`` or ``N`` prefix; lines without one belong to the first process);
``comm`` is known from a successful ``execve`` on, inherited by children created by
clone/fork/vfork, and null before that. Rows are sorted by time.

Lines that are not strace events are skipped with one warning. So are lines whose timestamp, pid,
return value or duration does not fit the table's int64 columns (a corrupt or edited file): one
warning names their line numbers and the rest of the trace is kept. Fraction digits beyond the
9th (below a nanosecond) are dropped.

Line structure is matched by vectorised pyarrow regex kernels over the whole file; Python only
walks the few execve/clone lines that carry names.
"""

from __future__ import annotations

import errno
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracesynth.errors import TraceSynthError
from tracesynth.io.syscalls import ENTRY_POINT_NAMES, syscall_name
from tracesynth.trace import SCHEMA, Trace

_LINE = (
    r"^(?:\[pid +(?P<p1>\d+)\] +|(?P<p2>\d+) +)?(?P<s>\d+)\.(?P<f>\d+) +"
    r"(?:(?P<res><\.\.\. )?(?P<name>\w+)(?: resumed>|\()(?P<rest>.*)"
    r"|--- (?P<sig>SIG\w+|\{)(?P<sigrest>.*)"
    r"|\+\+\+ (?P<exit>exited|killed)(?P<exitrest>.*))$"
)
# the tail of a finished call: ") = ret [ERRNO (text)] [<duration>]"
_RESULT = r"\) += (?P<ret>0x[0-9a-fA-F]+|-?\d+|\?)(?: (?P<err>E[A-Z0-9_]+))?.*?(?: <(?P<dur>\d+\.\d+)>)?$"
_CLONES = ("clone", "clone3", "fork", "vfork")
# kernel-internal restart codes strace prints by name (include/linux/errno.h)
_KERNEL_ERRNO = {"ERESTARTSYS": 512, "ERESTARTNOINTR": 513, "ERESTARTNOHAND": 514, "ERESTART_RESTARTBLOCK": 516}


def _errno_value(name: str | None) -> int | None:
    if name is None:
        return None
    return _KERNEL_ERRNO.get(name) or getattr(errno, name, None)


def _field(s: pa.StructArray, name: str) -> pa.Array:
    f = s.field(name)
    return pc.if_else(pc.equal(f, ""), pa.scalar(None, pa.string()), f)


def _syscall_event_name(name: str) -> str:
    if name.startswith("syscall_0x"):  # strace's name for a number it does not know
        return syscall_name(int(name[len("syscall_0x") :], 16))
    return ENTRY_POINT_NAMES.get(name, name)


_INT64_MAX = (1 << 63) - 1


def read_strace(path: str | Path) -> Trace:
    """Read `strace -f -ttt -T` output (see the module docstring for the mapping)."""
    path = Path(path)
    lines, lineno, m = _event_lines(path)
    res = pc.extract_regex(lines, _RESULT)
    ts, ok = _timestamps(m)
    ret_s, err_s = _field(res, "ret"), _field(res, "err")
    ret, ok_ret = _return_values(ret_s, err_s)
    dur, ok_dur = _durations(_field(res, "dur"), ts)
    tid, ok_tid = _ints_or_bad(pc.coalesce(_field(m, "p1"), _field(m, "p2")))
    bad = ~(ok & ok_ret & ok_dur & ok_tid)
    if bad.any():
        shown = ", ".join(str(x) for x in lineno[bad][:5]) + (" ..." if bad.sum() > 5 else "")
        warnings.warn(
            f"{path}: skipped {int(bad.sum())} line(s) whose timestamp, pid, return value or duration "
            f"does not fit in 64 bits (line {shown})",
            stacklevel=2,
        )
        keep = pa.array(~bad)
        lines, m, res, ret_s, err_s = (a.filter(keep) for a in (lines, m, res, ret_s, err_s))
        ts, ret, dur, tid = ts[~bad], ret[~bad], dur[~bad], tid[~bad]
        if len(m) == 0:
            raise TraceSynthError("no strace events left after skipping the lines that do not fit in 64 bits", path)
    calls = _call_kinds(m, lines, res, ret_s, err_s)
    entry_ts, entry_row = _pair_resumed(ts, tid, calls["unfinished"], calls["resumed"])
    exit_ts = np.where(dur >= 0, entry_ts + np.maximum(dur, 0), ts)
    names = _field(m, "name").to_pylist()
    has_pid = tid >= 0
    if not has_pid.all():
        tid[~has_pid] = _first_process(tid, names, calls["returns"], ret)
    table = _events_table(names, calls, ts, entry_ts, exit_ts, entry_row, tid, ret, lines)
    return Trace(table, {"source_format": "strace", "source": path.name, "clock": "CLOCK_REALTIME (strace -ttt)"})


def _event_lines(path: Path) -> tuple[pa.Array, np.ndarray, pa.StructArray]:
    """(lines, their 1-based line numbers, regex captures) of the lines that are strace events."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceSynthError(f"cannot read ({exc.strerror})", path) from None
    # split on "\n" only (str.splitlines also splits on \x0b, \x1c, ... and would shift line numbers)
    text = pc.utf8_rtrim(pa.array(data.decode("utf-8", errors="replace").split("\n"), pa.string()), characters="\r")
    lineno = np.arange(1, len(text) + 1)
    nonblank = pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(text)), 0)
    text, lineno = text.filter(nonblank), lineno[nonblank.to_numpy(zero_copy_only=False)]
    m = pc.extract_regex(text, _LINE)
    ok = m.is_valid()
    n_bad = len(m) - pc.sum(ok.cast(pa.int64())).as_py() if len(m) else 0
    if n_bad == len(m):
        raise TraceSynthError(
            f"no strace events found ({n_bad} unparseable line(s); expected `strace -f -ttt -T` output)", path
        )
    if n_bad:
        warnings.warn(f"{path}: skipped {n_bad} line(s) that are not strace -f -ttt -T events", stacklevel=3)
    return text.filter(ok), lineno[ok.to_numpy(zero_copy_only=False)], m.filter(ok)


def _ints_or_bad(strings: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Decimal strings -> (int64 values, fits); null -> (-1, True); beyond int64 -> (0, False)."""
    n = len(strings)
    vals = np.full(n, -1, dtype=np.int64)
    ok = np.ones(n, dtype=bool)
    short = pc.less_equal(pc.utf8_length(strings), 18).fill_null(False).to_numpy(zero_copy_only=False)
    if short.any():
        vals[short] = pc.cast(strings.filter(pa.array(short)), pa.int64()).to_numpy(zero_copy_only=False)
    longs = ~short & strings.is_valid().to_numpy(zero_copy_only=False)
    for i in np.flatnonzero(longs):  # 19+ digits: rare, checked exactly
        v = int(strings[int(i)].as_py())
        ok[i] = -_INT64_MAX - 1 <= v <= _INT64_MAX
        vals[i] = v if ok[i] else 0
    return vals, ok


def _timestamps(m: pa.StructArray) -> tuple[np.ndarray, np.ndarray]:
    """ns timestamps from "secs.frac" (digits past the 9th are dropped) and whether they fit in int64."""
    sec, ok = _ints_or_bad(m.field("s"))
    frac = pc.utf8_slice_codeunits(m.field("f"), 0, 9)
    flen = pc.utf8_length(frac).to_numpy(zero_copy_only=False)
    frac_ns = pc.cast(frac, pa.int64()).to_numpy(zero_copy_only=False) * 10 ** (9 - flen)
    ok &= (sec >= 0) & (sec <= (_INT64_MAX - frac_ns) // 1_000_000_000)
    return np.where(ok, sec, 0) * 1_000_000_000 + frac_ns, ok


def _return_values(ret_s: pa.Array, err_s: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Return values (decimal, hex, "-1 ENAME" -> -errno, as the kernel returned them) and whether they fit."""
    n = len(ret_s)
    ret = np.zeros(n, dtype=np.int64)
    ok = np.ones(n, dtype=bool)
    dec = pc.match_substring_regex(ret_s, r"^-?\d+$").fill_null(False)
    dec_np = dec.to_numpy(zero_copy_only=False)
    ret[dec_np], ok[dec_np] = _ints_or_bad(ret_s.filter(dec))
    hexes = pc.starts_with(ret_s, "0x").fill_null(False).to_numpy(zero_copy_only=False)
    for i, h in zip(np.flatnonzero(hexes), ret_s.filter(pa.array(hexes)).to_pylist(), strict=True):
        v = int(h, 16)
        ok[i] = v < 1 << 64  # a register value: above 2**63 it is a negative int64
        ret[i] = v - (1 << 64 if v >= 1 << 63 else 0) if ok[i] else 0
    errs = err_s.to_pylist()
    for i in np.flatnonzero(err_s.is_valid().to_numpy(zero_copy_only=False)):
        code = _errno_value(errs[i])
        if code is not None:
            ret[i], ok[i] = -code, True
    return ret, ok


def _durations(dur_s: pa.Array, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """strace's <secs> as ns (-1 where absent) and whether call time + duration still fits in int64."""
    f = pc.multiply(pc.cast(dur_s, pa.float64()), 1e9).fill_null(-1.0).to_numpy(zero_copy_only=False)
    ok = np.isfinite(f) & (f < 2.0**62)
    dur = np.where(ok, np.round(f), -1).astype(np.int64)
    ok &= dur <= _INT64_MAX - ts
    return np.where(ok, dur, -1), ok


def _call_kinds(
    m: pa.StructArray, lines: pa.Array, res: pa.StructArray, ret_s: pa.Array, err_s: pa.Array
) -> dict[str, np.ndarray]:
    """Per line: is_call, resumed ("<... x resumed>"), unfinished, is_sig, is_exit, returns (has an exit event)."""

    def np_(a: pa.Array) -> np.ndarray:
        return a.to_numpy(zero_copy_only=False)

    is_call = np_(_field(m, "name").is_valid())
    unfinished = np_(pc.or_(pc.ends_with(lines, "<unfinished ...>"), pc.ends_with(lines, "<detached ...>")))
    finished = np_(res.is_valid()) & is_call & ~unfinished
    returns = finished & ~np_(pc.equal(ret_s, "?").fill_null(True))
    returns |= finished & np_(err_s.is_valid())  # "= ? ERESTARTNOHAND"
    return {
        "is_call": is_call,
        "resumed": np_(pc.equal(m.field("res"), "<... ")) & is_call,
        "unfinished": unfinished & is_call,
        "is_sig": np_(m.field("sig").is_valid()) & ~np_(pc.equal(m.field("sig"), "")),
        "is_exit": ~np_(pc.equal(m.field("exit"), "")),
        "returns": returns,
    }


def _pair_resumed(
    ts: np.ndarray, tid: np.ndarray, unfinished: np.ndarray, resumed: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(entry time, entry line) per line: a "<... x resumed>" line takes its thread's "<unfinished ...>"."""
    entry_ts = ts.copy()
    entry_row = np.arange(len(ts))
    split = np.flatnonzero(unfinished | resumed)
    if len(split):
        order = split[np.lexsort((split, tid[split]))]
        pairs = (tid[order[1:]] == tid[order[:-1]]) & unfinished[order[:-1]] & resumed[order[1:]]
        entry_ts[order[1:][pairs]] = ts[order[:-1][pairs]]
        entry_row[order[1:][pairs]] = order[:-1][pairs]
    return entry_ts, entry_row


def _first_process(tid: np.ndarray, names: list[str | None], returns: np.ndarray, ret: np.ndarray) -> int:
    """The tid of unprefixed lines: the first process, the one pid never returned by a clone (-1 if none)."""
    children = {int(ret[i]) for i in np.flatnonzero(returns) if names[i] in _CLONES and ret[i] > 0}
    known = tid[tid >= 0]
    _, first = np.unique(known, return_index=True)
    roots = [int(p) for p in known[np.sort(first)] if int(p) not in children]  # in order of appearance
    return roots[0] if roots else -1


def _events_table(
    names: list[str | None],
    calls: dict[str, np.ndarray],
    ts: np.ndarray,
    entry_ts: np.ndarray,
    exit_ts: np.ndarray,
    entry_row: np.ndarray,
    tid: np.ndarray,
    ret: np.ndarray,
    lines: pa.Array,
) -> pa.Table:
    """The Trace table: entries (plain calls and unfinished halves), exits, signals, process exits, by time."""
    base = [_syscall_event_name(x) if x else "" for x in names]
    entry_rows = np.flatnonzero(calls["is_call"] & ~calls["resumed"])
    exit_rows = np.flatnonzero(calls["returns"])
    sig_rows = np.flatnonzero(calls["is_sig"])
    pexit_rows = np.flatnonzero(calls["is_exit"])
    ev_names = (
        ["syscall_entry_" + base[i] for i in entry_rows]
        + ["syscall_exit_" + base[i] for i in exit_rows]
        + ["signal_deliver"] * len(sig_rows)
        + ["sched_process_exit"] * len(pexit_rows)
    )
    out_ts = np.concatenate([entry_ts[entry_rows], exit_ts[exit_rows], ts[sig_rows], ts[pexit_rows]])
    out_tid = np.concatenate([tid[entry_rows], tid[exit_rows], tid[sig_rows], tid[pexit_rows]])
    out_ret = np.concatenate(
        [np.zeros(len(entry_rows), np.int64), ret[exit_rows], np.zeros(len(sig_rows) + len(pexit_rows), np.int64)]
    )
    has_ret = np.zeros(len(out_ts), dtype=bool)
    has_ret[len(entry_rows) : len(entry_rows) + len(exit_rows)] = True
    # comm: set by successful execve (at its exit), inherited by clone children (at the clone's exit)
    out_comm = _comms(names, lines, entry_row, calls["returns"], ret.tolist(), tid, exit_ts, out_ts, out_tid)
    order = np.argsort(out_ts, kind="stable")
    return pa.table(
        [
            pa.array(out_ts[order], pa.int64()),
            pc.dictionary_encode(pa.array(ev_names, pa.string()).take(pa.array(order))),
            pa.nulls(len(order), pa.int32()),
            pa.array(out_tid[order], pa.int64(), mask=out_tid[order] < 0),
            out_comm.take(pa.array(order)),
            pa.array(out_ret[order], pa.int64(), mask=~has_ret[order]),
        ],
        schema=SCHEMA,
    )


def _comms(
    names: list[str | None],
    lines: pa.Array,
    entry_row: np.ndarray,
    returns: np.ndarray,
    rets: list[int],
    tid: np.ndarray,
    exit_ts: np.ndarray,
    out_ts: np.ndarray,
    out_tid: np.ndarray,
) -> pa.Array:
    """Per output row, the thread's comm at that time (null before it is known)."""
    changes: list[tuple[int, int, int, str | None, int]] = []  # (time, order, tid, comm, parent)
    for i in np.flatnonzero(returns):
        nm = names[i]
        if nm == "execve" and rets[i] == 0:
            line = lines[int(entry_row[i])].as_py()  # the arguments are on the entry half
            start = line.find('execve("')
            if start >= 0:
                prog = line[start + 8 : line.find('"', start + 8)]
                changes.append((int(exit_ts[i]), int(i), int(tid[i]), prog.rsplit("/", 1)[-1][:15], -1))
        elif nm in _CLONES and rets[i] > 0:
            changes.append((int(exit_ts[i]), int(i), rets[i], None, int(tid[i])))
    changes.sort()
    current: dict[int, str | None] = {}
    history: dict[int, tuple[list[int], list[str | None]]] = {}
    inherited: set[int] = set()  # threads whose first name came from their parent (clone children)
    for t, _, who, comm, parent in changes:
        value = comm if parent < 0 else current.get(parent)
        if who not in history and parent >= 0:
            inherited.add(who)
        current[who] = value
        times, values = history.setdefault(who, ([], []))
        times.append(t)
        values.append(value)
    vocab: dict[str, int] = {}
    result = np.full(len(out_ts), -1, dtype=np.int32)
    for who, (times, values) in history.items():
        rows = np.flatnonzero(out_tid == who)
        k = np.searchsorted(np.asarray(times), out_ts[rows], side="right") - 1
        if who in inherited:
            k = np.maximum(k, 0)  # a child may run before its parent's clone() returns
        codes = np.array([-1 if v is None else vocab.setdefault(v, len(vocab)) for v in values], dtype=np.int32)
        result[rows] = np.where(k >= 0, codes[np.maximum(k, 0)], -1)
    return pa.DictionaryArray.from_arrays(
        pa.array(result, pa.int32(), mask=result < 0), pa.array(list(vocab), pa.string())
    )

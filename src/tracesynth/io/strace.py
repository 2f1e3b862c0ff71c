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


def read_strace(path: str | Path) -> Trace:
    """Read `strace -f -ttt -T` output (see the module docstring for the mapping)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceSynthError(f"cannot read ({exc.strerror})", path) from None
    text = pa.array(data.decode("utf-8", errors="replace").splitlines(), pa.string())
    text = text.filter(pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(text)), 0))
    m = pc.extract_regex(text, _LINE)
    ok = m.is_valid()
    n_bad = len(m) - pc.sum(ok.cast(pa.int64())).as_py() if len(m) else 0
    lines, m = text.filter(ok), m.filter(ok)
    if len(m) == 0:
        raise TraceSynthError(
            f"no strace events found ({n_bad} unparseable line(s); expected `strace -f -ttt -T` output)", path
        )
    if n_bad:
        warnings.warn(f"{path}: skipped {n_bad} line(s) that are not strace -f -ttt -T events", stacklevel=2)

    n = len(m)
    pid = pc.coalesce(_field(m, "p1"), _field(m, "p2"))
    has_pid = pid.is_valid().to_numpy(zero_copy_only=False)
    tid = pc.cast(pid, pa.int64()).fill_null(-1).to_numpy(zero_copy_only=False).copy()
    frac = m.field("f")
    flen = pc.utf8_length(frac).to_numpy(zero_copy_only=False)
    ts = pc.cast(m.field("s"), pa.int64()).to_numpy(zero_copy_only=False) * 1_000_000_000
    ts = ts + pc.cast(frac, pa.int64()).to_numpy(zero_copy_only=False) * 10 ** np.clip(9 - flen, 0, 9)

    name = _field(m, "name")
    is_call = name.is_valid().to_numpy(zero_copy_only=False)
    resumed = pc.equal(m.field("res"), "<... ").to_numpy(zero_copy_only=False) & is_call
    unfinished = (
        pc.or_(pc.ends_with(lines, "<unfinished ...>"), pc.ends_with(lines, "<detached ...>")).to_numpy(
            zero_copy_only=False
        )
        & is_call
    )
    is_sig = m.field("sig").is_valid().to_numpy(zero_copy_only=False) & ~pc.equal(m.field("sig"), "").to_numpy(
        zero_copy_only=False
    )
    is_exit = ~pc.equal(m.field("exit"), "").to_numpy(zero_copy_only=False)

    res = pc.extract_regex(lines, _RESULT)
    finished = res.is_valid().to_numpy(zero_copy_only=False) & is_call & ~unfinished
    ret_s = _field(res, "ret")
    dur_s = _field(res, "dur")
    err_s = _field(res, "err")
    dur_ns = pc.round(pc.multiply(pc.cast(dur_s, pa.float64()), 1e9)).cast(pa.int64())
    dur = dur_ns.fill_null(-1).to_numpy(zero_copy_only=False)
    returns = finished & ~pc.equal(ret_s, "?").fill_null(True).to_numpy(zero_copy_only=False)
    returns |= finished & err_s.is_valid().to_numpy(zero_copy_only=False)  # "= ? ERESTARTNOHAND"

    # return values: decimal, hex, and "-1 ENAME" -> -errno (what the kernel returned)
    ret = np.zeros(n, dtype=np.int64)
    dec = pc.match_substring_regex(ret_s, r"^-?\d+$").fill_null(False).to_numpy(zero_copy_only=False)
    ret[dec] = pc.cast(ret_s.filter(pa.array(dec)), pa.int64()).to_numpy(zero_copy_only=False)
    hexes = pc.starts_with(ret_s, "0x").fill_null(False).to_numpy(zero_copy_only=False)
    if hexes.any():
        ret[hexes] = [
            int(h, 16) - (1 << 64 if int(h, 16) >= 1 << 63 else 0) for h in ret_s.filter(pa.array(hexes)).to_pylist()
        ]
    errs = err_s.to_pylist()
    has_err = err_s.is_valid().to_numpy(zero_copy_only=False)
    for i in np.flatnonzero(has_err):
        code = _errno_value(errs[i])
        ret[i] = -code if code is not None else ret[i]

    # pair each "<... x resumed>" with its "<unfinished ...>" entry on the same thread
    entry_ts = ts.copy()
    entry_row = np.arange(n)
    split = np.flatnonzero(unfinished | resumed)
    if len(split):
        order = split[np.lexsort((split, tid[split]))]
        prev_ok = np.zeros(len(order), dtype=bool)
        prev_ok[1:] = (tid[order[1:]] == tid[order[:-1]]) & unfinished[order[:-1]] & resumed[order[1:]]
        entry_ts[order[1:][prev_ok[1:]]] = ts[order[:-1][prev_ok[1:]]]
        entry_row[order[1:][prev_ok[1:]]] = order[:-1][prev_ok[1:]]
    exit_ts = np.where(dur >= 0, entry_ts + np.maximum(dur, 0), ts)

    # unprefixed lines belong to the first process: the one pid never returned by a clone
    names = name.to_pylist()
    rets_list = ret.tolist()
    clone_rows = [i for i in np.flatnonzero(returns & is_call) if names[i] in _CLONES and rets_list[i] > 0]
    if not has_pid.all():
        children = {rets_list[i] for i in clone_rows}
        roots = [p for p in pc.unique(pid.drop_null()).to_pylist() if int(p) not in children]
        tid[~has_pid] = int(roots[0]) if roots else -1

    # events: entries (plain calls and unfinished halves), exits, signals, process exits
    base = [_syscall_event_name(x) if x else "" for x in names]
    entry_rows = np.flatnonzero(is_call & ~resumed)
    exit_rows = np.flatnonzero(returns)
    sig_rows = np.flatnonzero(is_sig)
    pexit_rows = np.flatnonzero(is_exit)
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
    out_comm = _comms(names, lines, entry_row, returns, rets_list, tid, exit_ts, out_ts, out_tid)
    order = np.argsort(out_ts, kind="stable")
    table = pa.table(
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
    return Trace(table, {"source_format": "strace", "source": path.name, "clock": "CLOCK_REALTIME (strace -ttt)"})


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

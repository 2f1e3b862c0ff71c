"""LTTng 2.5 and older name syscalls `sys_NAME` (entry) and `exit_syscall` (one exit for every call,
with `ret`); newer lttng-modules write `syscall_entry_NAME` / `syscall_exit_NAME`. Mapping the old
names at ingest gives both the same vocabulary: `sys_NAME` -> `syscall_entry_NAME`, and each
`exit_syscall` -> `syscall_exit_NAME` of the call its thread has open (`ret` kept). An exit with no
open call on its thread (the trace began inside the call) keeps its old name."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from tracesynth.events import LEGACY_SYSCALL_ENTRY, LEGACY_SYSCALL_EXIT, SYSCALL_ENTRY, SYSCALL_EXIT
from tracesynth.trace import Trace

# the old exit event's glob, for the readers that parse `ret` only on syscall exits
LEGACY_SYSCALL_EXITS = (LEGACY_SYSCALL_EXIT,)


def normalise_legacy_syscalls(trace: Trace) -> Trace:
    """The trace with old LTTng syscall names mapped onto the current ones (unchanged if it has none)."""
    codes, vocab = trace.codes("event")
    entry = np.array([v.startswith(LEGACY_SYSCALL_ENTRY) for v in vocab] or [False])
    if LEGACY_SYSCALL_EXIT not in vocab and not entry.any():
        return trace
    names = [SYSCALL_ENTRY + v[len(LEGACY_SYSCALL_ENTRY) :] if e else v for v, e in zip(vocab, entry, strict=True)]
    exit_code = vocab.index(LEGACY_SYSCALL_EXIT) if LEGACY_SYSCALL_EXIT in vocab else -1
    codes = codes.astype(np.int64)
    tid = trace.numeric("tid", -1)
    # each exit closes the call of the thread's latest legacy event before it, when that is an entry
    sys_rows = np.flatnonzero((entry[codes] | (codes == exit_code)) & (tid >= 0))
    order = sys_rows[np.argsort(tid[sys_rows], kind="stable")]
    prev = np.full(len(order), -1, dtype=np.int64)
    same = tid[order[1:]] == tid[order[:-1]]
    prev[1:][same] = order[:-1][same]
    is_exit = codes[order] == exit_code
    opened = np.where(prev >= 0, codes[np.maximum(prev, 0)], -1)
    closes = is_exit & (opened >= 0) & entry[np.maximum(opened, 0)]
    index = {n: i for i, n in enumerate(names)}
    exit_of: dict[int, int] = {}
    for c in np.unique(opened[closes]).tolist():
        n = SYSCALL_EXIT + vocab[c][len(LEGACY_SYSCALL_ENTRY) :]
        if n not in index:
            index[n] = len(names)
            names.append(n)
        exit_of[c] = index[n]
    new = codes.copy()
    rows = order[closes]
    new[rows] = [exit_of[c] for c in opened[closes].tolist()]
    event = pa.DictionaryArray.from_arrays(pa.array(new.astype(np.int32)), pa.array(names, pa.string()))
    return Trace(trace.table.set_column(trace.table.schema.get_field_index("event"), "event", event), trace.metadata)

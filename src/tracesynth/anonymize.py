"""Anonymise a trace for sharing: hash command names, relabel thread ids, drop identifying metadata.

- `comm`: each distinct name becomes "c" + 14 hex digits of SHA-256(salt, name): stable for a
  given salt (the same program gets the same label across traces anonymised together), not
  reversible without the salt, and short enough for a kernel comm (15 bytes), so anonymised
  traces still export to CTF unchanged.
- `tid`: relabelled 1, 2, 3, ... in order of first appearance; tid 0 (the idle task, the same
  on every Linux machine) stays 0 so idle periods remain recognisable. Nulls stay null.
- `ret` of the syscalls that return a thread/process/group id (gettid, getpid, getppid, clone,
  fork, wait4, set_tid_address, getsid, ... see ID_SYSCALLS): positive values get the same new
  label as that id in the tid column (ids that never ran in the trace, e.g. a parent shell,
  get the next labels); 0 and negative errors stay. So no real id survives through a return value.
- `ts` (with shift_time): shifted so the trace starts at 0, and the clock's absolute offset is
  dropped from the metadata, hiding when the trace was recorded; intervals are unchanged.
- metadata: keys that name paths, hosts, commands, users or kernels are dropped (recursively),
  as are string values that look like filesystem paths; an `anonymized` note is added.
Timestamps (unless shifted), CPUs, event names and other return values are kept: they are what a model
learns from.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np
import pyarrow as pa

from tracesynth.trace import Trace

_SENSITIVE_KEY = re.compile(
    r"^(?:source|cmd|argv|args|cwd|env|user|uname|node|machine)$|path|host|command|cmdline|file|dir|kernel", re.I
)
_PATHLIKE = re.compile(r"^(?:/|~|[A-Za-z]:\\)|/home/|/root/|/Users/")


def hash_comm(name: str, salt: str) -> str:
    """Salted, stable, comm-sized label for a command name."""
    digest = hashlib.sha256(salt.encode("utf-8") + b"\0" + name.encode("utf-8")).hexdigest()
    return "c" + digest[:14]


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if not _SENSITIVE_KEY.search(str(k))}
    if isinstance(value, list):
        return [_clean(v) for v in value if not (isinstance(v, str) and _PATHLIKE.search(v))]
    if isinstance(value, str) and _PATHLIKE.search(value):
        return None
    return value


def anonymize_metadata(metadata: dict[str, Any], shift_time: bool = False) -> dict[str, Any]:
    """Metadata without paths, hostnames, commands and other identifying fields."""
    meta = {k: v for k, v in _clean(dict(metadata)).items() if v is not None}
    meta["anonymized"] = {
        "comm": "salted sha256",
        "tid": "relabelled by first appearance (0 kept), id-valued syscall returns with them",
    }
    if shift_time:
        if isinstance(meta.get("clock"), dict):  # the offset dates the trace
            meta["clock"] = {k: v for k, v in meta["clock"].items() if not k.startswith("offset")}
        meta["anonymized"]["ts"] = "shifted to start at 0"
    return meta


# syscalls whose return value is a tid / pid / pgid / sid (as LTTng, perf and our strace reader name them)
ID_SYSCALLS = frozenset(
    {
        "gettid",
        "getpid",
        "getppid",
        "getpgrp",
        "getpgid",
        "getsid",
        "setsid",
        "clone",
        "clone3",
        "fork",
        "vfork",
        "wait4",
        "waitid",
        "waitpid",
        "set_tid_address",
    }
)
_EXIT_PREFIXES = ("syscall_exit_", "compat_syscall_exit_")


def id_valued_exits(trace: Trace) -> np.ndarray:
    """Rows that are exits of ID_SYSCALLS with a positive (id-valued) return value."""
    codes, vocab = trace.codes("event")
    is_id = np.array(
        [any(v.startswith(p) and v[len(p) :] in ID_SYSCALLS for p in _EXIT_PREFIXES) for v in vocab] + [False]
    )
    ret = trace.numeric("ret", fill=0)
    return is_id[codes] & (ret > 0)


def relabel_tids(tid: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """New tids 1, 2, ... in order of first appearance (0 stays 0); invalid rows are left as is."""
    out = tid.copy()
    vals = tid[valid]
    if len(vals) == 0:
        return out
    uniq, first, inverse = np.unique(vals, return_index=True, return_inverse=True)
    nonzero = uniq != 0
    rank = np.zeros(len(uniq), dtype=np.int64)
    by_first = np.argsort(first[nonzero], kind="stable")
    rank_nz = np.empty(int(nonzero.sum()), dtype=np.int64)
    rank_nz[by_first] = np.arange(1, len(by_first) + 1)
    rank[nonzero] = rank_nz
    out[valid] = rank[inverse]
    return out


def _relabel_ids(
    tid: np.ndarray, valid: np.ndarray, ret: np.ndarray, id_rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """tid column and id-valued rets relabelled together: one map, tids ranked first, then ids seen only in rets."""
    ids = np.concatenate([tid[valid], ret[id_rows]])
    new = relabel_tids(ids, np.ones(len(ids), dtype=bool))
    out_tid, out_ret = tid.copy(), ret.copy()
    n = int(valid.sum())
    out_tid[valid] = new[:n]
    out_ret[id_rows] = new[n:]
    return out_tid, out_ret


def anonymize(trace: Trace, salt: str, shift_time: bool = False) -> Trace:
    """An anonymised copy of `trace` (see the module docstring for what changes)."""
    if not salt:
        raise ValueError("anonymize needs a non-empty salt")
    tid_col = trace.table["tid"].combine_chunks()
    valid = tid_col.is_valid().to_numpy(zero_copy_only=False)
    ret_col = trace.table["ret"].combine_chunks()
    tid, ret = _relabel_ids(
        tid_col.fill_null(0).to_numpy().astype(np.int64), valid, trace.numeric("ret", fill=0), id_valued_exits(trace)
    )
    columns: dict[str, Any] = {"ret": pa.array(ret, mask=~ret_col.is_valid().to_numpy(zero_copy_only=False))}
    if shift_time and len(trace):
        ts = trace.ts
        columns["ts"] = ts - ts[0]
    codes, vocab = trace.codes("comm")
    hashed = [hash_comm(v, salt) for v in vocab]
    comm = pa.DictionaryArray.from_arrays(
        pa.array(codes, type=pa.int32(), mask=codes < 0), pa.array(hashed, type=pa.string())
    )
    out = trace.with_columns(tid=pa.array(tid, mask=~valid), comm=comm, **columns)
    out.metadata = anonymize_metadata(trace.metadata, shift_time=shift_time)
    return out

"""Anonymise a trace for sharing: hash command names, relabel thread ids, drop identifying metadata.

- `comm`: each distinct name becomes "c" + 14 hex digits of SHA-256(salt, name): stable for a
  given salt (the same program gets the same label across traces anonymised together), not
  reversible without the salt, and short enough for a kernel comm (15 bytes), so anonymised
  traces still export to CTF unchanged.
- `tid`: relabelled 1, 2, 3, ... in order of first appearance; tid 0 (the idle task, the same
  on every Linux machine) stays 0 so idle periods remain recognisable. Nulls stay null.
- metadata: keys that name paths, hosts, commands, users or kernels are dropped (recursively),
  as are string values that look like filesystem paths; an `anonymized` note is added.
Timestamps, CPUs, event names and return values are kept: they are what a model learns from.
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


def anonymize_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """Metadata without paths, hostnames, commands and other identifying fields."""
    meta = {k: v for k, v in _clean(dict(metadata)).items() if v is not None}
    meta["anonymized"] = {"comm": "salted sha256", "tid": "relabelled by first appearance (0 kept)"}
    return meta


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


def anonymize(trace: Trace, salt: str) -> Trace:
    """An anonymised copy of `trace` (see the module docstring for what changes)."""
    if not salt:
        raise ValueError("anonymize needs a non-empty salt")
    tid_col = trace.table["tid"].combine_chunks()
    valid = tid_col.is_valid().to_numpy(zero_copy_only=False)
    tid = relabel_tids(tid_col.fill_null(0).to_numpy().astype(np.int64), valid)
    codes, vocab = trace.codes("comm")
    hashed = [hash_comm(v, salt) for v in vocab]
    comm = pa.DictionaryArray.from_arrays(
        pa.array(codes, type=pa.int32(), mask=codes < 0), pa.array(hashed, type=pa.string())
    )
    out = trace.with_columns(tid=pa.array(tid, mask=~valid), comm=comm)
    out.metadata = anonymize_metadata(trace.metadata)
    return out

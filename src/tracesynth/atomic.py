"""Atomic output: write to a temporary sibling, rename into place only on success."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(dest: str | Path, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `dest`; on clean exit it replaces `dest`, on error it vanishes.

    With directory=True the temporary path is an (empty) directory, for multi-file outputs such as
    a CTF trace or a model folder.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        os.close(fd)
        tmp = Path(name)
    # mkstemp/mkdtemp create owner-only entries; give the output the permissions a plain open() would.
    tmp.chmod((0o777 if directory else 0o666) & ~_umask())
    try:
        yield tmp
        if directory and dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise

"""Temporary directories named after the process that owns them, removed when it exits and, where it could not
(SIGKILL, a default SIGTERM), by the next dooly process that makes one.

A directory is ``$TMPDIR/<prefix><pid>-<random>``; :func:`owned_tmpdir` registers its removal at interpreter
exit (or when ``owner`` is collected) and first removes the directories of the same prefix whose owning
process no longer exists.
"""

from __future__ import annotations

import atexit
import glob
import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path

from atomicio import pid_alive

_SWEPT: set[str] = set()


def sweep_stale(prefix: str, root: str | Path | None = None) -> list[Path]:
    """Remove this user's ``<prefix><pid>-*`` directories under ``root`` (the temp dir) whose process is dead;
    returns what was removed. Directories of live processes, of other users, or not named so are kept."""
    root = Path(root or tempfile.gettempdir())
    pattern = re.compile(re.escape(prefix) + r"(\d+)-")
    removed = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for d in entries:
        m = pattern.match(d.name)
        if m is None or int(m.group(1)) == os.getpid() or pid_alive(int(m.group(1))):
            continue
        try:
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def owned_tmpdir(prefix: str, owner: object | None = None) -> Path:
    """A new directory ``<prefix><pid>-XXXX`` in the temp dir, removed when ``owner`` is collected or, without
    an owner, at interpreter exit; stale ones of the same prefix (dead owners) are swept first, once a process."""
    if prefix not in _SWEPT:
        _SWEPT.add(prefix)
        sweep_stale(prefix)
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))
    if owner is not None:
        weakref.finalize(owner, shutil.rmtree, path, ignore_errors=True)  # also runs at exit if still alive
    else:
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def remove_segments(name: str) -> None:
    """Remove the shared-memory segments ``/dev/shm/<name>-*``: vLLM's CPU communicator names its segments after
    its group (or rendezvous file) and leaves them behind when a rank is killed or a server is stopped."""
    for segment in Path("/dev/shm").glob(f"{glob.escape(name)}-*"):
        segment.unlink(missing_ok=True)

"""Atomic outputs shared by both tools: write beside the destination, rename into place on success.

Rules every output path follows (so no command can lose a user's file):
- a new path is created; an existing output *of the same kind* is replaced atomically (the old
  one is renamed aside, the new one renamed into place, then the old one removed);
- anything else at the path (a directory where a file goes, a file where a directory goes, a
  directory holding files that are not this kind of output) is refused with `OutputPathError`;
- on failure, or on SIGTERM/SIGINT, the temporary is removed; temporaries left by a killed process
  (`.NAME.<pid>.*.tmp`) are swept by the next write to the same path.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["OutputPathError", "atomic_path", "check_replaceable", "pid_alive"]


class OutputPathError(Exception):
    """The output path is occupied by something this command must not replace (one-line error)."""

    def __init__(self, path: str | Path, message: str):
        self.path = str(path)
        super().__init__(f"{self.path}: {message}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts): how a temporary's owner is told dead or alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale(dest: Path) -> None:
    """Remove temporaries and set-aside copies of `dest` whose writing process is gone."""
    pattern = re.compile(rf"^\.{re.escape(dest.name)}\.(\d+)\.[^/]*\.(tmp|old)$")
    try:
        siblings = list(dest.parent.iterdir())
    except OSError:
        return
    for p in siblings:
        m = pattern.match(p.name)
        if not m or pid_alive(int(m.group(1))):
            continue
        if m.group(2) == "old" and not dest.exists():
            # killed between "rename aside" and "rename into place": the old output is the good one
            with contextlib.suppress(OSError):
                os.replace(p, dest)
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


def check_replaceable(dest: Path, directory: bool, contents: Iterable[str] | None) -> None:
    """Raise OutputPathError unless `dest` is new or an earlier output of this kind (what atomic_path checks
    before it writes; a command may call it before long work)."""
    if not (dest.exists() or dest.is_symlink()):
        return
    if not directory:
        if dest.is_dir():
            raise OutputPathError(dest, "is a directory; give a file path for this output")
        return
    if not dest.is_dir() or dest.is_symlink():
        raise OutputPathError(dest, "exists and is not a directory; give a new directory path")
    names = [p.name for p in dest.iterdir()]
    if not names:
        return
    patterns = list(contents or ())
    foreign = [n for n in names if not any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]
    if not patterns or foreign:
        shown = ", ".join(sorted(foreign)[:3]) + (" ..." if len(foreign) > 3 else "")
        raise OutputPathError(
            dest,
            f"directory holds files this command did not write ({shown}); "
            "give a new or empty directory, or remove them",
        )


@contextlib.contextmanager
def atomic_path(
    dest: str | Path, directory: bool = False, contents: Iterable[str] | None = None
) -> Iterator[Path]:
    """Yield a temporary path beside `dest`; on clean exit it replaces `dest`, on error it vanishes.

    With directory=True the temporary path is an (empty) directory, for multi-file outputs such as
    a CTF trace or a model folder; `contents` lists the glob patterns of the files such an output
    holds, so that an earlier output of the same kind may be replaced and nothing else is.
    """
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(dest.parent, f"cannot create the output's directory ({exc.strerror or exc})") from None
    _sweep_stale(dest)
    check_replaceable(dest, directory, contents)
    prefix = f".{dest.name}.{os.getpid()}."
    try:
        if directory:
            tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=dest.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=dest.parent)
            os.close(fd)
            tmp = Path(name)
    except OSError as exc:  # a read-only directory or file system, a full disk
        raise OutputPathError(dest, f"cannot write here ({exc.strerror or exc})") from None
    # mkstemp/mkdtemp create owner-only entries; give the output the permissions a plain open() would.
    tmp.chmod((0o777 if directory else 0o666) & ~_umask())
    try:
        yield tmp
        if directory and dest.exists():
            aside = Path(tempfile.mkdtemp(prefix=prefix, suffix=".old", dir=dest.parent))
            os.replace(dest, aside)  # an empty directory may be replaced by rename on POSIX
            os.replace(tmp, dest)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise

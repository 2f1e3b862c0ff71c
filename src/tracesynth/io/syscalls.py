"""Syscall numbers -> names, so perf's raw_syscalls and LTTng share one event vocabulary.

The table lives in ``syscall_table.py`` beside this module. It is generated, never hand-edited:

    .venv/bin/python -m tracesynth.io.syscalls --regenerate

reads the kernel's generated ``asm/unistd_64.h`` shipped by Debian's ``linux-libc-dev`` (itself
produced from the kernel's ``arch/x86/entry/syscalls/syscall_64.tbl``) and writes the table with
the header's path and package version in its docstring.

Names follow the kernel *entry points* (``sys_newstat`` -> ``newstat``), which is what both
lttng-modules (``syscall_entry_newstat``) and perf's ``syscalls:sys_enter_newstat`` tracepoints
use; ``unistd_64.h`` carries the user-space names (``__NR_stat``), so the few that differ are
mapped by ``ENTRY_POINT_NAMES`` (checked against tracefs by the tests where it is readable).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

# unistd name -> kernel entry-point name, where the two differ on x86_64 (syscall_64.tbl column 4).
ENTRY_POINT_NAMES = {
    "stat": "newstat",
    "fstat": "newfstat",
    "lstat": "newlstat",
    "uname": "newuname",
    "sendfile": "sendfile64",
    "umount2": "umount",
}

UNISTD_HEADER = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
TABLE_FILE = Path(__file__).with_name("syscall_table.py")


def syscall_names(arch: str = "x86_64") -> dict[int, str]:
    """Syscall number -> entry-point name for `arch` (only x86_64 is shipped)."""
    if arch != "x86_64":
        from tracesynth.errors import TraceSynthError

        raise TraceSynthError(f"no syscall table for architecture {arch!r} (only x86_64 is shipped)")
    from tracesynth.io.syscall_table import X86_64

    return dict(X86_64)


def syscall_name(nr: int, arch: str = "x86_64") -> str:
    """Name of one syscall number; unknown numbers become ``unknown`` as in lttng-modules."""
    return syscall_names(arch).get(int(nr), "unknown")


def name_lookup(arch: str = "x86_64") -> tuple[np.ndarray, list[str]]:
    """(index array over syscall numbers, names): names[index[nr]] is nr's name, for vectorised lookups.

    The last name is ``unknown``; index has one spare slot at the end, used for numbers out of range.
    """
    table = syscall_names(arch)
    names = sorted(set(table.values())) + ["unknown"]
    pos = {n: i for i, n in enumerate(names)}
    index = np.full(max(table) + 2, len(names) - 1, dtype=np.int32)
    for nr, name in table.items():
        index[nr] = pos[name]
    return index, names


def lookup_numbers(numbers: np.ndarray, arch: str = "x86_64") -> tuple[np.ndarray, list[str]]:
    """Vectorised: (codes into names, names) for an int array of syscall numbers."""
    index, names = name_lookup(arch)
    nr = np.asarray(numbers, dtype=np.int64)
    nr = np.where((nr >= 0) & (nr < len(index) - 1), nr, len(index) - 1)
    return index[nr], names


# -- generator -----------------------------------------------------------------------------------
def parse_unistd(text: str) -> dict[int, str]:
    """``#define __NR_read 0`` lines -> {0: 'read'} with entry-point names applied."""
    table: dict[int, str] = {}
    for name, nr in re.findall(r"^#define\s+__NR_(\w+)\s+(\d+)\s*$", text, re.M):
        table[int(nr)] = ENTRY_POINT_NAMES.get(name, name)
    return table


def _package_version(path: Path) -> str:
    try:
        owner = subprocess.run(["dpkg", "-S", str(path)], capture_output=True, text=True, check=True).stdout
        pkg = owner.split(":")[0].strip()
        ver = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True, check=True
        ).stdout.strip()
        return f"{pkg} {ver}"
    except (OSError, subprocess.CalledProcessError):
        return "unknown package"


def regenerate(header: Path = UNISTD_HEADER, out: Path = TABLE_FILE) -> int:
    """Rewrite the shipped table from `header`; returns the number of syscalls written."""
    table = parse_unistd(header.read_text())
    if len(table) < 300:
        raise SystemExit(f"{header}: only {len(table)} syscalls found; is this unistd_64.h?")
    lines = [
        '"""x86_64 syscall number -> kernel entry-point name. GENERATED: do not edit.',
        "",
        f"Source: {header} from Debian package {_package_version(header)}",
        "(the kernel's arch/x86/entry/syscalls/syscall_64.tbl, via its generated unistd_64.h),",
        "entry-point renames from tracesynth.io.syscalls.ENTRY_POINT_NAMES.",
        "Regenerate: python -m tracesynth.io.syscalls --regenerate",
        '"""',
        "",
        "X86_64: dict[int, str] = {",
        *(f'    {nr}: "{name}",' for nr, name in sorted(table.items())),
        "}",
        "",
    ]
    from tracesynth.atomic import atomic_path

    with atomic_path(out) as tmp:
        tmp.write_text("\n".join(lines))
    return len(table)


if __name__ == "__main__":
    if sys.argv[1:] == ["--regenerate"]:
        print(f"wrote {regenerate()} syscalls to {TABLE_FILE}")
    else:
        print("usage: python -m tracesynth.io.syscalls --regenerate", file=sys.stderr)
        sys.exit(2)

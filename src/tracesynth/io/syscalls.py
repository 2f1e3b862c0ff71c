"""Syscall numbers -> names, so perf's raw_syscalls and LTTng share one event vocabulary.

The table lives in ``syscall_table.py`` beside this module. It is generated, never hand-edited:

    .venv/bin/python -m tracesynth.io.syscalls --regenerate

reads the kernel's generated ``asm/unistd_64.h`` shipped by Debian's ``linux-libc-dev`` (itself
produced from the kernel's ``arch/x86/entry/syscalls/syscall_64.tbl``) and writes the table with
the header's path and package version in its docstring. With ``--probe`` (root and perf needed)
numbers newer than the header (Debian 12 ships 6.1 headers) are added from the running kernel:
a child calls each unknown number with invalid arguments under `perf record` on
``raw_syscalls:sys_enter`` and every ``syscalls:sys_enter_*`` tracepoint, and each number is
named by the named tracepoint that fires right after it on the same thread.

Names follow the kernel *entry points* (``sys_newstat`` -> ``newstat``), which is what both
lttng-modules (``syscall_entry_newstat``) and perf's ``syscalls:sys_enter_newstat`` tracepoints
use; ``unistd_64.h`` carries the user-space names (``__NR_stat``), so the few that differ are
mapped by ``ENTRY_POINT_NAMES`` (checked against tracefs by the tests where it is readable).
"""

from __future__ import annotations

import platform
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


# Never probed: uretprobe/uprobe signal the caller when called outside a probe trampoline, and
# 512-547 is the x32 range.
_NO_PROBE = {335, 336, *range(512, 548)}
_PROBE_CHILD = (
    "import ctypes, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "bad = ctypes.c_long(-1)\n"  # invalid fd, pointer and flags: every call fails harmlessly
    "for nr in map(int, sys.argv[1:]):\n"
    "    libc.syscall(ctypes.c_long(nr), bad, bad, bad, bad, bad, bad)\n"
)


def probe_kernel(numbers: list[int]) -> dict[int, str]:
    """Name syscall numbers on the running kernel by the tracepoints they fire (root + perf)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "probe.data"
        subprocess.run(
            ["perf", "record", "-q", "-e", "raw_syscalls:sys_enter", "-e", "syscalls:sys_enter_*", "-o", str(data)]
            + ["--", sys.executable, "-c", _PROBE_CHILD, *map(str, numbers)],
            check=True,
            capture_output=True,
        )
        raw = subprocess.run(
            ["perf", "script", "-i", str(data), "-F", "tid,event,trace"], check=True, capture_output=True, text=True
        ).stdout
    found: dict[int, str] = {}
    pending: dict[str, int] = {}
    wanted = set(numbers)
    for line in raw.splitlines():
        m = re.match(r"\s*(\d+)\s+raw_syscalls:sys_enter:\s+NR (\d+) ", line)
        if m:
            pending[m.group(1)] = int(m.group(2))
            continue
        m = re.match(r"\s*(\d+)\s+syscalls:sys_enter_(\w+):", line)
        if m and m.group(1) in pending:
            nr = pending.pop(m.group(1))
            if nr in wanted:
                found[nr] = m.group(2)
    return found


def regenerate(header: Path = UNISTD_HEADER, out: Path = TABLE_FILE, probe: bool = False) -> int:
    """Rewrite the shipped table from `header` (and the running kernel); returns the syscall count."""
    table = parse_unistd(header.read_text())
    if len(table) < 300:
        raise SystemExit(f"{header}: only {len(table)} syscalls found; is this unistd_64.h?")
    probed: dict[int, str] = {}
    if probe:
        candidates = [nr for nr in range(max(table) + 1, 548) if nr not in _NO_PROBE]
        probed = {nr: name for nr, name in probe_kernel(candidates).items() if nr not in table}
        table.update(probed)
    lines = [
        '"""x86_64 syscall number -> kernel entry-point name. GENERATED: do not edit.',
        "",
        f"Source: {header} from Debian package {_package_version(header)}",
        "(the kernel's arch/x86/entry/syscalls/syscall_64.tbl, via its generated unistd_64.h),",
        "entry-point renames from tracesynth.io.syscalls.ENTRY_POINT_NAMES.",
        *(
            [
                f"Numbers {min(probed)}-{max(probed)} ({len(probed)} names): probed on Linux {platform.release()}",
                "(the syscalls:sys_enter_* tracepoint each number fires; see probe_kernel).",
            ]
            if probed
            else []
        ),
        "Regenerate: python -m tracesynth.io.syscalls --regenerate [--probe]",
        '"""',
        "",
        "X86_64: dict[int, str] = {",
        *(f'    {nr}: "{name}",' for nr, name in sorted(table.items())),
        "}",
        "",
    ]
    from atomicio import atomic_path

    with atomic_path(out) as tmp:
        tmp.write_text("\n".join(lines))
    return len(table)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--regenerate"] and set(sys.argv[2:]) <= {"--probe"}:
        print(f"wrote {regenerate(probe='--probe' in sys.argv)} syscalls to {TABLE_FILE}")
    else:
        print("usage: python -m tracesynth.io.syscalls --regenerate [--probe]", file=sys.stderr)
        sys.exit(2)

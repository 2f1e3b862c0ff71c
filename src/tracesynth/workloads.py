"""The workload catalogue: real, packaged programs that `tracesynth collect NAME` traces.

Each entry is a shell command run in a fresh temporary directory (its inputs are generated there,
so nothing downloads and nothing outside the directory is touched). Placeholders:
``{python}`` is this interpreter, ``{scimark}`` the SciMark 2 benchmark script pyperformance ships.

The mix mirrors the workloads the tracesynth paper trained on (Phoronix Test Suite): deterministic
compute (scimark2), memory bandwidth (STREAM), file I/O (iozone's role, played by fio), video
encoding (ffmpeg), compression (gzip/xz) and a database (sqlite3).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tracesynth.errors import TraceSynthError


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # compute | memory | io | video | compression | database
    description: str
    command: str  # shell command, run with `sh -c` in a fresh temporary directory
    package: str  # where its program comes from: "debian:<pkg>" or "pypi:<pkg>"
    needs: tuple[str, ...] = field(default=())  # executables that must be on PATH
    duration: float | None = None  # default --duration (seconds); None runs to completion

    def shell_command(self) -> str:
        """The command with placeholders filled in for this machine."""
        return self.command.format(python=sys.executable, scimark=scimark_script())

    def check(self) -> None:
        """Raise TraceSynthError naming the package to install when a program is missing."""
        for exe in self.needs:
            if shutil.which(exe) is None:
                raise TraceSynthError(f"workload {self.name!r} needs {exe!r}: install {_install_hint(self.package)}")
        if "{scimark}" in self.command:
            scimark_script()


def _install_hint(package: str) -> str:
    kind, _, name = package.partition(":")
    return f"apt-get install {name}" if kind == "debian" else f".venv/bin/pip install {name}"


def scimark_script() -> str:
    """Path of pyperformance's SciMark 2 benchmark (bm_scimark/run_benchmark.py)."""
    try:
        import pyperformance
    except ImportError:
        raise TraceSynthError("workload 'scimark2' needs pyperformance: .venv/bin/pip install pyperformance") from None
    path = Path(pyperformance.__file__).parent / "data-files" / "benchmarks" / "bm_scimark" / "run_benchmark.py"
    if not path.is_file():
        raise TraceSynthError("pyperformance does not ship bm_scimark/run_benchmark.py", path)
    return str(path)


# Commands are sized so that a default run records a few hundred thousand events here.
CATALOGUE: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "scimark2",
            "compute",
            "SciMark 2 (FFT, SOR, Monte Carlo, sparse mat-mult, LU) from pyperformance, run by pyperf workers",
            "{python} {scimark} --fast --quiet -o scimark.json",
            "pypi:pyperformance",
            duration=70,
        ),
        Workload(
            "stream",
            "memory",
            "STREAM memory-bandwidth kernels (copy, scale, add, triad): stress-ng's stream stressor, 2 workers, rerun",
            "for i in $(seq 1 200); do stress-ng --stream 2 --stream-ops 40 --stream-l3-size 4M -q || exit 1; done",
            "debian:stress-ng",
            ("stress-ng",),
            duration=60,
        ),
        Workload(
            "fio",
            "io",
            "fio random read/write, 4 KiB blocks, psync engine, on a 64 MiB file with fsync (stands in for iozone)",
            "fio --name=randrw --directory=. --rw=randrw --bs=4k --size=64m --ioengine=psync --fsync=32 "
            "--runtime=60 --time_based --output=fio.log",
            "debian:fio",
            ("fio",),
            duration=12,
        ),
        Workload(
            "ffmpeg",
            "video",
            "ffmpeg encoding a generated test pattern (lavfi testsrc, 640x360@30) to H.264 with 2 threads",
            "ffmpeg -nostdin -hide_banner -loglevel error -f lavfi -i testsrc=duration=900:size=640x360:rate=30 "
            "-c:v libx264 -preset veryfast -threads 2 -y out.mp4",
            "debian:ffmpeg",
            ("ffmpeg",),
            duration=25,
        ),
        Workload(
            "compress",
            "compression",
            "gzip and xz compressing and decompressing generated text (seq output)",
            "seq 1 6000000 > data.txt && for l in 1 6 9; do "
            "gzip -$l -c data.txt > d.gz && gzip -dc d.gz | cmp - data.txt; done && "
            "xz -2 -T1 -c data.txt > d.xz && xz -dc d.xz | cmp - data.txt",
            "debian:xz-utils",
            ("gzip", "xz", "seq", "cmp"),
            duration=60,
        ),
        Workload(
            "sqlite",
            "database",
            "sqlite3: bulk insert, index build, aggregate queries, then many small durable (WAL) transactions",
            "sqlite3 db.sqlite 'PRAGMA journal_mode=WAL; CREATE TABLE t(id INTEGER PRIMARY KEY, k INT, v TEXT); "
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<50000) "
            "INSERT INTO t(k, v) SELECT abs(random()) % 1000, hex(randomblob(32)) FROM c; "
            "CREATE INDEX tk ON t(k); SELECT k, count(*), avg(length(v)) FROM t GROUP BY k ORDER BY 2 DESC LIMIT 3;' "
            "> q.txt && i=0; while [ $i -lt 400 ]; do "
            'echo "BEGIN; INSERT INTO t(k, v) VALUES ($i, hex(randomblob(64))); '
            'UPDATE t SET v = hex(randomblob(16)) WHERE k = $i % 1000; COMMIT;"; i=$((i+1)); done '
            "| sqlite3 db.sqlite > /dev/null",
            "debian:sqlite3",
            ("sqlite3",),
            duration=60,
        ),
    )
}


def get_workload(name: str) -> Workload:
    """A catalogue entry by name; TraceSynthError listing the names otherwise."""
    try:
        return CATALOGUE[name]
    except KeyError:
        raise TraceSynthError(f"unknown workload {name!r} (catalogue: {', '.join(CATALOGUE)})") from None

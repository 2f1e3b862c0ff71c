"""Text ingestion speed and memory: `perf script` (target 500k events/s) and strace.

Builds large `perf script` files under /tmp by tiling the real capture in tests/fixtures/perf
(timestamps shifted tile by tile, so the text stays sorted as perf prints it), then ingests each in a
fresh subprocess and reports events/s and peak RSS at two lengths: the text grows by ~108 bytes per
event, peak memory only by the output table's few tens of bytes per event (the text is streamed in
16 MiB blocks). Then the same for `strace -f -ttt -T` text.

    .venv/bin/python bench/bench_ingest_text.py [--events 1000000 4000000] [--strace-events 500000]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PERF_FIXTURE = REPO / "tests" / "fixtures" / "perf" / "perf-script.txt"
STRACE_FIXTURE = REPO / "tests" / "fixtures" / "strace" / "strace-f-ttt-T.txt"
TARGET = 500_000

_PERF_TIME = re.compile(r"^(.*?\]\s+)(\d+)\.(\d{9})(:.*)$", re.S)
_STRACE_TIME = re.compile(r"^(\d+ )(\d+)\.(\d{6})( .*)$", re.S)


def _tile(src: Path, dest: Path, n_events: int, pattern: re.Pattern[str], digits: int) -> int:
    """Repeat src's lines until n_events, shifting each tile's timestamps past the previous tile."""
    parts = []
    for line in src.read_text().splitlines(keepends=True):
        m = pattern.match(line)
        if m:
            parts.append((m.group(1), int(m.group(2)) * 10**digits + int(m.group(3)), m.group(4)))
    span = parts[-1][1] - parts[0][1] + 10**digits // 1000
    written = 0
    with dest.open("w") as f:
        tile = 0
        while written < n_events:
            off = tile * span
            take = parts[: n_events - written]
            f.write(
                "".join(
                    f"{pre}{(t + off) // 10**digits}.{(t + off) % 10**digits:0{digits}d}{suf}" for pre, t, suf in take
                )
            )
            written += len(take)
            tile += 1
    return written


_CHILD = """
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
from tracesynth.io.{module} import {func}
t0, c0 = time.perf_counter(), time.process_time()
trace = {func}(sys.argv[1])
dt, cpu = time.perf_counter() - t0, time.process_time() - c0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"events": len(trace), "seconds": dt, "cpu_seconds": cpu, "rss_mb": rss}}))
"""


def _ingest(module: str, func: str, path: Path) -> dict:
    code = _CHILD.format(module=module, func=func)
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, nargs=2, default=[1_000_000, 4_000_000], help="two perf text lengths")
    ap.add_argument("--strace-events", type=int, default=500_000, help="strace text length (lines)")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tracesynth-bench-"))
    # Wall-clock rates depend on what else runs; CPU-second rates much less (2 cores here, often shared).
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    try:
        print(f"perf script text: tiling {PERF_FIXTURE.relative_to(REPO)} (a real capture) under {tmp}")
        rows = []
        for n in args.events:
            path = tmp / f"perf-{n}.txt"
            lines = _tile(PERF_FIXTURE, path, n, _PERF_TIME, 9)
            r = _ingest("perf", "read_perf_script", path)
            r["mb"] = path.stat().st_size / 1e6
            rows.append(r)
            rate, cpu_rate = r["events"] / r["seconds"], r["events"] / r["cpu_seconds"]
            print(
                f"  {lines:>10,} lines {r['mb']:6.1f} MB: {r['seconds']:6.2f} s wall = {rate:>9,.0f} events/s "
                f"({rate / TARGET:.2f}x target); {r['cpu_seconds']:6.2f} s CPU = {cpu_rate:>9,.0f} events/s "
                f"({cpu_rate / TARGET:.2f}x); peak RSS {r['rss_mb']:,.0f} MB"
            )
            path.unlink()
        a, b = rows
        grow = (b["rss_mb"] - a["rss_mb"]) * 1e6 / max(1, b["events"] - a["events"])
        text = (b["mb"] - a["mb"]) * 1e6 / max(1, b["events"] - a["events"])
        print(
            f"  memory: peak RSS grows {grow:.0f} bytes per extra event (the output table), "
            f"the text {text:.0f} bytes per event; RSS/text size at the longer length "
            f"{b['rss_mb'] / b['mb']:.2f}"
        )
        best = max(r["events"] / r["seconds"] for r in rows)
        best_cpu = max(r["events"] / r["cpu_seconds"] for r in rows)
        print(
            f"  perf script ingestion: best {best:,.0f} events/s wall ({best / TARGET:.2f}x the {TARGET:,}/s target), "
            f"{best_cpu:,.0f} events per CPU-second ({best_cpu / TARGET:.2f}x)"
        )

        path = tmp / "strace.txt"
        lines = _tile(STRACE_FIXTURE, path, args.strace_events, _STRACE_TIME, 6)
        r = _ingest("strace", "read_strace", path)
        print(
            f"strace -f -ttt -T text: {lines:,} lines ({path.stat().st_size / 1e6:.1f} MB) -> {r['events']:,} events "
            f"in {r['seconds']:.2f} s wall: {r['events'] / r['seconds']:,.0f} events/s "
            f"({r['events'] / r['cpu_seconds']:,.0f} per CPU-second), peak RSS {r['rss_mb']:,.0f} MB"
        )
    finally:
        if not args.keep:
            for p in tmp.iterdir():
                p.unlink()
            os.rmdir(tmp)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"(bench took {time.time() - t0:.0f} s)")

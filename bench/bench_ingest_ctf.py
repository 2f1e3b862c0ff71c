"""CTF ingestion speed and memory (issue target: >= 300k events/s, memory flat in trace length).

Builds large LTTng-style kernel CTF traces under /tmp with the project's CTF writer, by tiling the
real wget trace from ../shared (timestamps shifted tile by tile) or, where it is absent, a
synthetic trace; by default without tid/procname context, like a plain lttng-modules session, so
threads are derived from sched_switch. Then, each in a fresh subprocess, at two trace lengths:

- `bt2-dummy`: `babeltrace2 TRACE -c sink.utils.dummy`, babeltrace2's decoder with no output;
- `babeltrace2`: `babeltrace2 TRACE > /dev/null`, the babeltrace2 CLI's own text rate (the reference);
- `stream`: tracesynth.io.babeltrace.iter_ctf_batches with read_lttng's fields through the
  babeltrace2 text path, batches dropped; `native`: the same through tracesynth.io.ctf;
- `read_lttng`: the whole reader, building the Trace table, with the native decoder (the default);
  `read_lttng-bt2`: the same over the babeltrace2 text path; `read_lttng-numba`: the native
  decoder with the numba core (TRACESYNTH_CTF_CORE=numba) instead of the default ahead-of-time
  (Cython) one, which is what the native modes use where it is built (the line `native core`).

Each is run --repeats times; the medians are printed. The Python children load modules from
bytecode caches as an installed package does (PYTHONDONTWRITEBYTECODE, set on some machines, is
dropped for them: without it each process compiles tracesynth's sources, ~30 ms inside a read).
The numba core costs its import and cache load (about half a second and 150 MB per process,
inside the timed read); on a fresh checkout its first run also compiles it (about 10 s, then
cached under src/tracesynth/io/ctf/__pycache__), which the median of 3 leaves out.

For each: wall-clock events/s (the read alone, after the Python imports), its ratio to
babeltrace2's wall rate (`vs bt2`) and to the dummy sink's (`vs dummy`) measured in the same run,
the whole process's wall time (`proc s`: interpreter start and imports included, as babeltrace2's
wall time includes its own start), CPU
seconds (ours and babeltrace2's child process), and peak RSS (VmHWM) of the Python process. The machine's
2 cores are shared, so wall rates move with the load; `cpu-bound` is events / max(our CPU,
babeltrace2's CPU): the rate when the pipeline's two processes each have a core.

    .venv/bin/python bench/bench_ingest_ctf.py [--events 1000000 4000000] [--context] [--keep] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WGET = REPO.parent / "shared" / "traces" / "lttng-wget-kernel"
TARGET = 300_000
#: bytes of peak RSS per event of read_lttng over babeltrace2's text before issue 46's reader (72-78 measured)
BT2_PATH_BYTES_PER_EVENT = 72


def build_trace(dest: Path, n_events: int, context: bool) -> int:
    """Write an n_events LTTng-style CTF trace at dest; return the event count."""
    import numpy as np
    import pyarrow as pa

    from tracesynth.io.ctf_writer import write_ctf
    from tracesynth.trace import Trace

    if WGET.exists():
        from tracesynth.io.lttng import read_lttng

        base = read_lttng(WGET)
    else:  # a synthetic stand-in: 4 CPUs, switches, syscall pairs
        rng = np.random.default_rng(0)
        n = 20_000
        names = np.array(["sched_switch", "syscall_entry_read", "syscall_exit_read", "irq_handler_entry"])
        event = names[rng.integers(0, 4, n)]
        ret = np.where(event == "syscall_exit_read", rng.integers(-11, 4096, n), 0).astype(object)
        ret[event != "syscall_exit_read"] = None
        base = Trace.from_columns(
            np.cumsum(rng.integers(100, 5000, n)), event, rng.integers(0, 4, n), rng.integers(1, 500, n),
            [f"proc{t % 50}" for t in rng.integers(1, 500, n)], ret,
        )  # fmt: skip
    span = int(base.duration_ns) + 1_000
    tiles = -(-n_events // len(base))
    table = pa.concat_tables(
        [base.table.set_column(0, "ts", pa.array(base.ts + k * span)) for k in range(tiles)]
    ).slice(0, n_events)
    big = Trace(table.unify_dictionaries().combine_chunks(), base.metadata, validate=False)
    write_ctf(big, dest, context=context)
    return len(big)


_CHILD = """
import json, resource, sys, time
from tracesynth.io.babeltrace import iter_ctf_batches, Field, ctf_decoder
from tracesynth.io.lttng import read_lttng
mode, path = sys.argv[1], sys.argv[2]
ctf_decoder.set("native" if mode in ("native", "read_lttng", "read_lttng-numba") else "babeltrace2")
t0 = time.perf_counter(); c0 = time.process_time()
if mode.startswith("read_lttng"):
    n = len(read_lttng(path))
else:
    sw = ("sched_switch",)
    fields = [Field("ret", scope="payload", events=("syscall_exit_*",)),
              Field("prev_tid", scope="payload", events=sw), Field("next_tid", scope="payload", events=sw),
              Field("prev_comm", kind="str", scope="payload", events=sw),
              Field("next_comm", kind="str", scope="payload", events=sw)]
    n = sum(b.num_rows for b in iter_ctf_batches(path, fields))
wall = time.perf_counter() - t0
cpu = time.process_time() - c0
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
# VmHWM, not ru_maxrss: Linux carries the forking parent's peak RSS into ru_maxrss across exec
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
from tracesynth.io.ctf import fast
core = fast.loaded().name if fast.loaded() is not None else "python"
print(json.dumps({"events": n, "wall": wall, "cpu": cpu, "child_cpu": kids.ru_utime + kids.ru_stime,
                  "rss_mb": hwm / 1024, "core": core}))
"""


# the reference first
MODES = ("babeltrace2", "bt2-dummy", "stream", "native", "read_lttng-bt2", "read_lttng-numba", "read_lttng")
_BT2 = {
    "babeltrace2": 'TIMEFORMAT="%U %S"; { time babeltrace2 "$1" > /dev/null; } 2>&1 | tail -1',
    "bt2-dummy": 'TIMEFORMAT="%U %S"; { time babeltrace2 "$1" -c sink.utils.dummy; } 2>&1 | tail -1',
}


def measure(mode: str, path: Path, repeats: int) -> dict:
    """The run with the median wall time of `repeats` runs."""
    runs = sorted((measure_once(mode, path) for _ in range(repeats)), key=lambda r: r["wall"])
    return runs[len(runs) // 2]


def measure_once(mode: str, path: Path) -> dict:
    if mode in _BT2:
        t0 = time.perf_counter()
        proc = subprocess.run(["bash", "-c", _BT2[mode], "_", str(path)], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        user, sys_ = (float(x) for x in proc.stdout.split()[-2:])
        return {"wall": wall, "cpu": 0.0, "child_cpu": user + sys_, "rss_mb": float("nan"), "proc": wall}
    env = {**os.environ, "TRACESYNTH_CTF_CORE": "numba" if mode == "read_lttng-numba" else "auto"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # modules load from bytecode, as from an installed package
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(path)], capture_output=True, text=True, check=True, cwd=REPO, env=env
    )
    proc = time.perf_counter() - t0
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "proc": proc}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, nargs="+", default=[1_000_000, 4_000_000])
    ap.add_argument("--context", action="store_true", help="write tid/procname context fields (lttng add-context)")
    ap.add_argument("--keep", action="store_true", help="keep the generated traces under /tmp")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode (the median is printed)")
    args = ap.parse_args()
    if shutil.which("babeltrace2") is None:
        sys.exit("babeltrace2 is not installed (apt-get install babeltrace2)")
    work = Path(tempfile.mkdtemp(prefix="tracesynth-bench-ctf-"))
    src = "tiled ../shared/traces/lttng-wget-kernel" if WGET.exists() else "synthetic"
    print(f"source: {src}; context fields: {'tid, procname' if args.context else 'none (derived)'}; work dir {work}")
    print(
        f"{'events':>10} {'size MB':>8} {'mode':>16} {'wall s':>7} {'events/s':>10} {'vs bt2':>7} {'vs dummy':>8} "
        f"{'our CPU s':>9} {'bt2 CPU s':>9} {'cpu-bound ev/s':>14} {'peak RSS MB':>11} {'proc s':>6}"
    )
    rss: dict[str, list[tuple[int, float]]] = {}
    try:
        for n in args.events:
            path = work / f"trace-{n}"
            n = build_trace(path, n, args.context)
            size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
            runs = {}
            for mode in MODES:
                runs[mode] = measure(mode, path, args.repeats)
            ref = {m: n / runs[m]["wall"] for m in ("babeltrace2", "bt2-dummy")}
            for mode, r in runs.items():
                rate = n / r["wall"]
                rss.setdefault(mode, []).append((n, r["rss_mb"]))
                bound = n / max(r["cpu"], r["child_cpu"])
                vs_bt2, vs_dummy = rate / ref["babeltrace2"], rate / ref["bt2-dummy"]
                print(
                    f"{n:>10,} {size:>8.1f} {mode:>16} {r['wall']:>7.2f} {rate:>10,.0f} {vs_bt2:>7.2f} "
                    f"{vs_dummy:>8.2f} "
                    f"{r['cpu']:>9.2f} {r['child_cpu']:>9.2f} {bound:>14,.0f} {r['rss_mb']:>11.0f} {r['proc']:>6.2f}",
                    flush=True,
                )
            cores = sorted({r["core"] for m, r in runs.items() if m in ("native", "read_lttng")})
            print(f"native core: {', '.join(cores)}", flush=True)
            if not args.keep:
                shutil.rmtree(path)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for mode, pts in rss.items():  # memory per event: the slope of peak RSS between the trace lengths
        if len(pts) > 1 and pts[-1][0] > pts[0][0] and pts[0][1] == pts[0][1]:
            per = (pts[-1][1] - pts[0][1]) * 2**20 / (pts[-1][0] - pts[0][0])
            print(f"peak RSS per event, {pts[0][0]:,} -> {pts[-1][0]:,} events, {mode}: {per:.0f} bytes")
    print(f"target: >= {TARGET:,} events/s for read_lttng; 'vs bt2' is the rate over `babeltrace2 > /dev/null`")
    print(
        "issue 46 targets: native read_lttng >= 2.00 vs bt2 and >= 1.00 vs dummy; memory per event no higher than "
        f"the Trace table's when the issue was filed ({BT2_PATH_BYTES_PER_EVENT} bytes: the babeltrace2 path, runs 1-6 "
        "of results/ingest-ctf-native.log; that path has since shared the native one's column buffers)"
    )


if __name__ == "__main__":
    main()

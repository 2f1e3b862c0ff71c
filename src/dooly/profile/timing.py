"""Timing harness: the clock, the thread count, cache eviction, and timing op calls and whole forwards.

Also the store key of everything but the signature (:func:`context_for`), since it names the clock and the
timing method a profile was taken with.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dooly.db.store import Measurement, ProfileContext, hardware_fingerprint
from dooly.engines import Engine, RequestShape


@dataclass(frozen=True)
class TimerConfig:
    """How hard to time one point. Defaults suit a noisy shared CPU: a few samples, medians."""

    warmup: int = 2
    repeats: int = 7
    min_sample_s: float = 2e-4  # short ops are looped so one sample lasts at least this long
    max_inner: int = 64
    budget_s: float = 1.5  # stop adding repeats (keeping at least 3) once a point has cost this much


@contextmanager
def fixed_threads(threads: int | None) -> Iterator[None]:
    """Pin torch's intra-op thread count for the duration (timings are only comparable at a fixed count)."""
    import torch

    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def default_clock(device: str, threads: int | None) -> str:
    """``thread`` (CPU time of the calling thread) for a one-thread CPU engine, else ``wall``.

    With one intra-op thread every kernel runs on the calling thread, so its CPU time is the latency the pass
    has on a core of its own; wall time on a shared machine also counts the time other tenants' processes
    hold the core, which long forwards suffer and short op samples (whose median drops preempted samples) do
    not -- timing both with the thread clock keeps them comparable. ``$DOOLY_CLOCK`` overrides.
    """
    env = os.environ.get("DOOLY_CLOCK")
    if env in ("wall", "thread"):
        return env
    return "thread" if device == "cpu" and threads == 1 else "wall"


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


@functools.cache
def _evict_buffer() -> Any:
    """The eviction buffer: twice the last-level cache (at least 64 MiB) of float32, made on first use."""
    import torch

    llc = 32 * 2**20
    for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"), reverse=True):
        try:
            text = (idx / "size").read_text().strip().upper()
            llc = int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
            break
        except (OSError, ValueError):
            continue
    return torch.ones(max(64 * 2**20, 2 * llc) // 4, dtype=torch.float32)


def evict_caches() -> None:
    """Read a buffer twice the size of the last-level cache, so what runs next finds every cache cold.

    Used before each timed forward: copying its KV cache into place left the cache hot, while in serving it
    was last touched a whole pass ago. (Single ops are not timed this way: bench/bench_cold_cache.py shows a
    full eviction makes a matmul slower than it is inside the model, and a loop over rotated copies of its
    weight about as slow as it is there.)
    """
    _evict_buffer().sum()


#: glibc hands an allocation above its mmap threshold fresh pages from the kernel, and every 4 KiB of them
#: costs a page fault on first touch (~1.5 us here: a 33 MiB KV-cache ``cat`` in HF eager decode is ~3 ms of
#: copying and ~11 ms of faults). The threshold adapts upward to the largest such block freed, up to 32 MiB on a
#: 64-bit build, which is where a long-running engine settles: blocks up to it are reused from the heap,
#: larger ones fault on every call.
MMAP_MAX_BYTES = 32 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


@functools.cache
def _libc() -> Any:
    """glibc, or None where there is none to tune (musl, macOS). Loaded once: ``find_library`` runs
    ``ldconfig`` in a subprocess, and ``reused_pages`` is entered for every profiled point."""
    import ctypes
    import ctypes.util

    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        lib.mallopt.argtypes, lib.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


@contextmanager
def reused_pages() -> Iterator[None]:
    """While timing one op in a loop: serve every allocation from the heap and keep freed memory there, so
    no call pays page faults for its output (the predictor adds those where the model pays them: outputs
    above :data:`MMAP_MAX_BYTES`; see ``dooly.predict.pages``). On leaving, glibc is left in its steady state
    (threshold at its 32 MiB ceiling, trimming at twice that), not in whatever state the process had reached.
    """
    libc = _libc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, MMAP_MAX_BYTES)
    libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    libc.mallopt(_M_MMAP_MAX, 0)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_MAX, 65536)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_MAX_BYTES)
        libc.malloc_trim(0)  # hand the heap grown while timing back: else what runs next reuses it, never faulting


_SETTLED_FAULTS = 16  # page faults one call may take and still count as run on a settled heap


def _minor_faults() -> int:
    """Minor page faults of this process so far (0 where the platform does not count them)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


#: The forwards-table row holding the machine's page-fault cost (model name, phase, point).
PAGE_COST_KEY = ("#fresh-pages", "alloc", {"bytes": 64 * 2**20})


def measure_page_cost(repeats: int = 9, clock: str = "wall") -> Measurement:
    """Seconds a block of ``PAGE_COST_KEY``'s bytes above the mmap ceiling costs beyond writing it: mapped,
    filled (every page faulted in) and unmapped, minus filling a block already in place; median of ``repeats``.
    Stored per hardware context by ``dooly profile``, measured in its process after the jobs (the cost grows with
    the process's resident memory: 0.25-0.45 ms per MiB on this VM, as a model is loaded).

    The block is mapped with ``mmap`` itself, as glibc maps an output above its ceiling when no free block of the
    heap can hold it: through ``malloc`` the price depended on what the jobs had left on the heap (a free block
    large enough, kept by ``malloc_trim``, served it without a fault, and the price came out 0)."""
    import mmap

    import torch

    nbytes = PAGE_COST_KEY[2]["bytes"]
    now = CLOCKS[clock]
    start = now()
    warm = torch.empty(nbytes, dtype=torch.uint8)
    warm.fill_(0)
    samples = []
    for _ in range(repeats):
        t0 = now()
        # private and anonymous, as glibc maps it (Python's default, shared, faults about 1.6x slower here)
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        block = torch.frombuffer(buf, dtype=torch.uint8)
        block.fill_(1)
        del block
        buf.close()
        t1 = now()
        warm.fill_(2)
        t2 = now()
        samples.append(max(0.0, (t1 - t0) - (t2 - t1)))
    del warm
    return Measurement(
        statistics.median(samples), quantile(samples, 0.1), quantile(samples, 0.9), repeats, now() - start
    )


def time_calls(
    call: Callable[[int], Any], device: str = "cpu", cfg: TimerConfig | None = None, clock: str = "wall"
) -> Measurement:
    """Time ``call(i)`` (``i`` rotates over input copies so weights are not cache-hot) and return its stats.

    CPU: ``clock`` (``wall`` = perf_counter, ``thread`` = thread CPU time) around a loop of calls. CUDA: CUDA
    events around the loop, synchronised.
    """
    cfg = cfg or TimerConfig()
    now = CLOCKS[clock]
    start = now()  # cost is counted on the same clock as the samples
    cuda = device.startswith("cuda")
    if cuda:
        import torch

        sync = torch.cuda.synchronize
    else:

        def sync() -> None:
            return None

    i = 0
    # warm-up, and a first estimate of one call's duration
    t_one = float("inf")
    for _ in range(max(1, cfg.warmup)):
        sync()
        t0 = now()
        call(i)
        sync()
        t_one = min(t_one, now() - t0)
        i += 1
    inner = int(min(cfg.max_inner, max(1, math.ceil(cfg.min_sample_s / max(t_one, 1e-9)))))
    samples: list[float] = []
    if cuda:
        import torch

        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    retaken = 0
    while len(samples) < cfg.repeats:
        if cuda:
            ev0.record()
            for _ in range(inner):
                call(i)
                i += 1
            ev1.record()
            ev1.synchronize()
            samples.append(ev0.elapsed_time(ev1) / 1e3 / inner)
        else:
            f0 = _minor_faults()
            t0 = now()
            for _ in range(inner):
                call(i)
                i += 1
            dt = (now() - t0) / inner
            # a sample whose calls faulted in new pages timed the heap growing to hold the op's outputs (its
            # fragments settle after a few calls), which a running engine's heap already holds: take another
            if _minor_faults() - f0 > _SETTLED_FAULTS * inner and retaken < cfg.repeats:
                retaken += 1
                continue
            samples.append(dt)
        if len(samples) >= 3 and now() - start > cfg.budget_s:
            break
    cost = now() - start
    return Measurement(
        median_s=statistics.median(samples),
        p10_s=quantile(samples, 0.1),
        p90_s=quantile(samples, 0.9),
        repeats=len(samples) * inner,
        cost_s=cost,
    )


def default_threads() -> int:
    """Threads used for profiling and validation unless told otherwise (env DOOLY_THREADS, else 1).

    One thread by default: on a shared machine it is the setting whose timings stay reproducible.
    """
    return int(os.environ.get("DOOLY_THREADS", "1"))


TIMING_METHOD = "resident1"


def context_for(engine: Engine, threads: int | None) -> ProfileContext:
    """The store key of everything but the signature: hardware (+ clock), engine, backend, dtype."""
    backend = getattr(engine, "attn_implementation", None) or "default"
    clock = default_clock(engine.device, threads)
    # TIMING_METHOD: profiles taken with an older timing method are not mixed with newer ones
    hw = f"{hardware_fingerprint(engine.device, threads)}:{TIMING_METHOD}"
    if not engine.device.startswith("cuda"):
        hw += ":reusedpages"  # ops timed without page faults (reused_pages); CUDA's caching allocator has none
    hw += ":threadclock" if clock == "thread" else ""
    return ProfileContext(hardware=hw, engine=engine.name, backend=backend, dtype=getattr(engine, "dtype", "float32"))


def clock_of(ctx: ProfileContext) -> str:
    """The clock timings under ``ctx`` were (and must be) taken with."""
    return "thread" if ctx.hardware.endswith(":threadclock") else "wall"


def measure_forward(
    engine: Engine,
    model: Any,
    phase: str,
    values: Mapping[str, int],
    repeats: int = 5,
    warmup: int = 1,
    clock: str = "wall",
) -> Measurement:
    """Time one real engine forward at ``values`` (the KV cache is rebuilt, untimed, before each run)."""
    shape = (
        RequestShape.prefill(values["requests"], values["tokens"])
        if phase == "prefill"
        else RequestShape.decode(values["requests"], values["kv_len"])
    )
    t_start = CLOCKS[clock]()
    return measure_prepared(engine, model, engine.prepare(model, shape), repeats, warmup, clock, t_start)


def measure_prepared(
    engine: Engine,
    model: Any,
    base: Any,
    repeats: int = 5,
    warmup: int = 1,
    clock: str = "wall",
    t_start: float | None = None,
) -> Measurement:
    """Time ``engine.forward`` on prepared inputs ``base`` (each run on a fresh copy: a forward extends the
    cache in place); the cost counts from ``t_start`` (default: now)."""
    import copy

    now = CLOCKS[clock]
    t_start = now() if t_start is None else t_start
    samples = []
    for r in range(warmup + repeats):
        inputs = copy.deepcopy(base)  # forward extends the cache in place; each run starts from the same state
        if not engine.device.startswith("cuda"):
            evict_caches()  # the copy left the KV cache hot; in serving it was last touched a pass ago
        if engine.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        t0 = now()
        engine.forward(model, inputs)
        if engine.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
        if r >= warmup:
            samples.append(now() - t0)
    return Measurement(
        statistics.median(samples),
        quantile(samples, 0.1),
        quantile(samples, 0.9),
        len(samples),
        now() - t_start,
    )

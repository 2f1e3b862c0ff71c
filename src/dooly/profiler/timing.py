"""Timing harness: the clock, the thread count, cache eviction, and timing op calls and whole forwards.

Also the store key of everything but the signature (:func:`context_for`), since it names the clock and the
timing method a profile was taken with.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dooly.engines import Engine, RequestShape
from dooly.store import Measurement, ProfileContext, hardware_fingerprint


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


_EVICT: list[Any] = []


def evict_caches() -> None:
    """Read a buffer twice the size of the last-level cache, so what runs next finds every cache cold.

    Used before each timed forward: copying its KV cache into place left the cache hot, while in serving it
    was last touched a whole pass ago. (Single ops are not timed this way: bench/bench_cold_cache.py shows a
    full eviction makes a matmul slower than it is inside the model, and a loop over rotated copies of its
    weight about as slow as it is there.)
    """
    import torch

    if not _EVICT:
        llc = 32 * 2**20
        for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"), reverse=True):
            try:
                text = (idx / "size").read_text().strip().upper()
                llc = int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
                break
            except (OSError, ValueError):
                continue
        _EVICT.append(torch.ones(max(64 * 2**20, 2 * llc) // 4, dtype=torch.float32))
    _EVICT[0].sum()


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
    for r in range(cfg.repeats):
        if cuda:
            ev0.record()
            for _ in range(inner):
                call(i)
                i += 1
            ev1.record()
            ev1.synchronize()
            samples.append(ev0.elapsed_time(ev1) / 1e3 / inner)
        else:
            t0 = now()
            for _ in range(inner):
                call(i)
                i += 1
            samples.append((now() - t0) / inner)
        if r >= 2 and now() - start > cfg.budget_s:
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
    engine: Engine, model: Any, base: Any, repeats: int = 5, warmup: int = 1, clock: str = "wall",
    t_start: float | None = None,
) -> Measurement:  # fmt: skip
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
        statistics.median(samples), quantile(samples, 0.1), quantile(samples, 0.9), len(samples),
        now() - t_start,
    )  # fmt: skip

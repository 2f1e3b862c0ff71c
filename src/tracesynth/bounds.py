"""Bounds and progress of a sample: refuse up front an event count whose trace would not fit in memory, and
show a progress bar (events done of the total, time left) while a long sample runs, or plain lines in a log."""

from __future__ import annotations

import os
import time
from typing import Any

from tracesynth.errors import TraceSynthError

# peak memory (bytes) per event of sample(n) and saving its trace, by kind: the trace, the chains' token buffers
# and their copies while they are joined and decoded. Measured as the growth of ru_maxrss over sample(n) + save
# of a tiny model (n = 200,000 masked: 610; n = 1,000,000 markov: 164), with headroom; ar shares masked's path,
# diffusion decodes windows per channel as the token kinds do.
SAMPLE_BYTES = {"ar": 1000, "masked": 1000, "diffusion": 1000, "markov": 400}


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable (/proc/meminfo), or the free pages, and no more
    than the cgroup's limit leaves; None where neither can be read."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    try:  # a container's memory limit (cgroup v2) may be far below the host's free memory
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read().strip())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, avail)


def check_sample_size(n_events: int, kind: str) -> None:
    """Refuse, before any work, a sample that cannot be done: n_events < 1, or one whose trace and
    sampling buffers (`SAMPLE_BYTES` per event) would not fit in the memory available."""
    if n_events < 1:
        raise TraceSynthError(f"--events must be at least 1, got {n_events}")
    avail = available_memory()
    need = n_events * SAMPLE_BYTES.get(kind, max(SAMPLE_BYTES.values()))
    if avail is not None and need > avail:
        raise TraceSynthError(f"--events {n_events:,}: a {kind} sample that long needs about "
                              f"{_gib(need)} of memory and {_gib(avail)} is available; ask for fewer events "
                              "(or sample in parts with different --seed)")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


class LogLines:
    """Progress where no bar can be drawn (a log, CI): a plain line at the first update, at least once a minute
    after (`every` s), and at the last, with the time left."""

    def __init__(self, label: str, total: int, unit: str, console: Any, every: float = 60.0, started: float = 0):
        self.label, self.total, self.unit, self.console, self.every = label, total, unit, console, every
        self.t0, self.last = started or time.monotonic(), -float("inf")  # started: a time.monotonic()

    def __call__(self, done: float, extra: str = "") -> None:
        now = time.monotonic()
        if now - self.last < self.every and 0 < done < self.total:
            return
        self.last, elapsed = now, now - self.t0
        left = f", about {_clock(elapsed / done * (self.total - done))} left" if 0 < done < self.total else ""
        line = f"{time.strftime('%H:%M:%S')} {self.label}: {int(done):,}/{self.total:,} {self.unit}{extra}, "
        self.console.print(line + f"{_clock(elapsed)} elapsed{left}", highlight=False, soft_wrap=True)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class SampleProgress:
    """The progress bar of a long sample: events done of the total, rate and time left (rich, on stderr; in a
    log, :class:`LogLines`).

    Only when asked for (`enabled`), and only once the sample has run `show_after` seconds, so a quick sample
    prints nothing. Use as a context manager and call `update(events_done)`."""

    def __init__(self, total: int, enabled: bool, label: str = "sample", show_after: float = 2.0, console=None):
        self.total, self.enabled, self.label, self.show_after = total, enabled, label, show_after
        self.console = console
        self.t0 = time.monotonic()
        self.bar: Any = None
        self.lines: LogLines | None = None

    def __enter__(self) -> SampleProgress:
        return self

    def update(self, done: float) -> None:
        if not self.enabled:
            return
        if self.bar is None and self.lines is None:
            if time.monotonic() - self.t0 < self.show_after:
                return
            from rich.console import Console

            console = self.console or Console(stderr=True)
            if not console.is_terminal:
                self.lines = LogLines(self.label, self.total, "events", console, started=self.t0)
        if self.lines is not None:
            self.lines(min(done, self.total))
            return
        if self.bar is None:
            import rich.progress as rp

            columns = (rp.TextColumn(f"[bold]{self.label}[/]"), rp.BarColumn(), rp.MofNCompleteColumn(),
                       rp.TextColumn("events"), rp.TimeElapsedColumn(), rp.TextColumn("eta"), rp.TimeRemainingColumn())
            self.bar = rp.Progress(*columns, console=console, transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total)
        self.bar.update(self.task, completed=min(int(done), self.total))

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

"""Timing a collective between real processes, as a parallel replica's ranks run it.

A rank's trace (:mod:`dooly.engines.vllm_parallel`) records each collective as a ``dooly_vllm`` op (all_reduce,
all_gather, reduce_scatter, gather, send, recv) whose single-rank kernel is a copy: timing that says nothing of the
exchange. Here the op runs between ``group_size`` processes, one pinned per core, through vLLM's own CPU
communicator (``CpuCommunicator``: its shared-memory kernels where vLLM's build has them, else torch.distributed
over gloo, as vLLM itself falls back), so the profile DB holds what the exchange costs on this machine.

The workers stay up for a whole profiling run (each start imports torch and vLLM: seconds) and take the same list
of calls over their pipes; rank 0 times them and answers. Timed on the wall clock whatever the profile's clock:
a rank waiting for its peer is latency the replica pays.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atomicio import pid_alive
from dooly.core.errors import DoolyError
from dooly.db.store import Measurement
from dooly.engines._reaper import die_with_parent
from dooly.engines._tmpdirs import owned_tmpdir, remove_segments
from dooly.profile.timing import TimerConfig, quantile
from dooly.trace.signature import Signature

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "gather", "send", "recv")
#: collectives not run between processes, and why (a failure line, never a one-rank copy's time)
UNTIMED = {
    "gather": "vLLM's shared-memory gather hung when called back to back here (its CPU backend gathers the logits "
    "with all_gather, so a CPU trace has none)",
}
_WORKER_TIMEOUT_S = 300.0  # a start (imports) plus one batch of calls; past it a hung exchange is given up


def collective_kind(op: str) -> str | None:
    """``"all_reduce"`` for ``"dooly_vllm.all_reduce.default"``; None for an op that is no collective."""
    parts = op.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == "dooly_vllm" and parts[1] in COLLECTIVES else None


@dataclass(frozen=True)
class CollectiveCall:
    """One collective at concrete sizes: what each rank hands in, along which dimension, among how many ranks."""

    kind: str
    shape: tuple[int, ...]
    dtype: str
    dim: int
    group_size: int


def collective_call(sig: Signature, values: Mapping[str, int]) -> CollectiveCall:
    """The call ``sig`` (a ``dooly_vllm`` collective) makes at request ``values``."""
    kind = collective_kind(sig.op)
    if kind is None:
        raise DoolyError(f"{sig.op} is not a collective")
    shapes, decoded = sig.concrete(values)
    shape, args = shapes[0][0], decoded["args"]
    # the schemas: (x, group_size), or (x, dim, group_size) for the ones along a dimension
    dim = int(args[1]) if len(args) == 3 else 0
    return CollectiveCall(kind, tuple(int(n) for n in shape), sig.inputs[0].dtype, dim, int(args[-1]))


def _communicator(ident: str) -> tuple[dict[str, Any], str]:
    """vLLM's CPU communicators over the world group (a tensor- and a pipeline-parallel one), and the backend."""
    import torch
    import torch.distributed as dist

    os.environ["VLLM_DIST_IDENT"] = ident  # names the shared-memory segments: one set per worker group
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the workers' start is no news to whoever profiles
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator, _CPUSHMDistributed

    group = dist.group.WORLD
    # as in a replica, the collectives and the point-to-point transfers go through two groups' communicators (a
    # send through the one that all-reduced hangs here): one shared-memory segment set each
    comm = {name: CpuCommunicator(group, torch.device("cpu"), group, unique_name=f"{name}:0") for name in ("tp", "pp")}
    return comm, "vllm-shm" if isinstance(comm["tp"].dist_module, _CPUSHMDistributed) else "gloo"


def _op(comms: Mapping[str, Any], call: CollectiveCall, rank: int) -> Any:
    """The collective as a no-argument callable on this rank (send/recv: rank 0 in the role the op names)."""
    import torch

    x = torch.zeros(call.shape, dtype=getattr(torch, call.dtype))  # zeros: repeated in-place sums stay finite
    comm = comms["pp" if call.kind in ("send", "recv") else "tp"]
    if call.kind == "all_reduce":
        return lambda: comm.all_reduce(x)
    if call.kind == "all_gather":
        return lambda: comm.all_gather(x, call.dim)
    if call.kind == "reduce_scatter":
        return lambda: comm.reduce_scatter(x, call.dim)
    sender = 0 if call.kind == "send" else 1
    if rank == sender:
        return lambda: comm.send_tensor_dict({"x": x}, 1 - sender)
    if rank == 1 - sender:
        return lambda: comm.recv_tensor_dict(sender)
    return lambda: None  # a third rank takes no part in a point-to-point transfer


def _measure(comm: Any, call: CollectiveCall, cfg: TimerConfig, rank: int) -> tuple:
    """Rank 0's timing of ``call`` (every rank runs this in step): ``("ok", median, p10, p90, calls, cost)``."""
    import torch
    import torch.distributed as dist

    start = time.perf_counter()
    fn = _op(comm, call, rank)
    for _ in range(max(1, cfg.warmup)):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    inner = int(min(cfg.max_inner, max(1, math.ceil(cfg.min_sample_s / max(one, 1e-9)))))
    ctl = torch.zeros(2, dtype=torch.int64)
    samples: list[float] = []
    while True:
        # rank 0 decides whether to take another sample and how many calls it loops; the broadcast also lines
        # the ranks up, so a sample starts with both at the exchange
        done = len(samples) >= cfg.repeats or (len(samples) >= 3 and time.perf_counter() - start > cfg.budget_s)
        ctl[0], ctl[1] = int(not done), inner
        dist.broadcast(ctl, src=0)
        if not int(ctl[0]):
            break
        t0 = time.perf_counter()
        for _ in range(int(ctl[1])):
            fn()
        samples.append((time.perf_counter() - t0) / int(ctl[1]))
    med, p10, p90 = statistics.median(samples), quantile(samples, 0.1), quantile(samples, 0.9)
    return ("ok", med, p10, p90, len(samples) * inner, time.perf_counter() - start)


def worker_tmpdir(init_file: str) -> None:
    """A worker's temp files (vLLM's IPC sockets among them) go in its group's directory, removed with the group."""
    import tempfile

    os.environ["TMPDIR"] = tempfile.tempdir = os.path.dirname(init_file)


def _worker(rank: int, world: int, init_file: str, ident: str, core: int | None, conn: Any) -> None:
    """One rank: pinned to its core, one torch thread, joins the group, then times what the parent sends."""
    # a rank left waiting in a shared-memory collective would spin for ever: it dies with dooly, even on SIGKILL
    die_with_parent()
    if os.getppid() == 1:  # dooly died before the line above took effect
        return
    worker_tmpdir(init_file)
    if core is not None:
        os.sched_setaffinity(0, {core})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        comm, backend = _communicator(ident)
    except Exception as exc:  # said to the parent in one line, which gives up the group
        conn.send(("error", f"{type(exc).__name__}: {str(exc)[:300]}"))
        return
    conn.send(("ready", backend))
    try:
        while (req := conn.recv()) is not None:
            calls, cfg = req
            out = []
            for c in calls:
                try:
                    out.append(_measure(comm, c, cfg, rank))
                except Exception as exc:  # the same on every rank (an exchange the backend lacks), so none hangs
                    out.append(("error", f"{type(exc).__name__}: {str(exc)[:200]}"))
            conn.send(out)
    finally:
        dist.destroy_process_group()


def _sweep_dead_segments() -> None:
    """Remove vLLM's shared-memory segments of dooly processes that died without closing their group (a SIGKILL:
    the segments are named ``dooly-<pid>-...`` after the group)."""
    for seg in Path("/dev/shm").glob("dooly-*-*"):
        m = re.match(r"dooly-(\d+)-", seg.name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            seg.unlink(missing_ok=True)


class _Group:
    """``world`` worker processes joined in one process group, one per core as far as there are cores.

    ``target(rank, world, init_file, ident, core, conn)`` is each worker's body (default: the collective timer's):
    it answers ``("ready", what)`` once started (or ``("error", why)``), then one answer per request until it
    receives None."""

    def __init__(
        self, world: int, target: Any = None, prefix: str = "dooly-coll-", timeout_s: float = _WORKER_TIMEOUT_S
    ) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch or vLLM state inherited
        # named by pid, so a run SIGKILLed mid-profile leaves nothing the next one does not sweep
        self.dir = str(owned_tmpdir(prefix, owner=self))
        _sweep_dead_segments()
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.ident = ident = f"dooly-{os.getpid()}-{id(self)}"
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.what = "collective workers" if target is None else "rank workers"
        self.timeout_s = timeout_s
        for rank in range(world):
            parent, child = ctx.Pipe()
            core = cores[rank % len(cores)] if cores else None
            args = (rank, world, os.path.join(self.dir, "init"), ident, core, child)
            proc = ctx.Process(target=target or _worker, args=args, daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:  # rank by rank: the first to fail says why, before its peers hang waiting for it
            status, what = self._recv(conn)
            if status != "ready":
                self.close()
                raise DoolyError(f"{self.what} failed to start: {what}")
        self.backend = what

    def _recv(self, conn: Any) -> Any:
        """A worker's answer; a worker that died or hung (a peer gone mid-exchange) gives the group up."""
        deadline = time.monotonic() + self.timeout_s
        while not conn.poll(1.0):
            dead = [p.exitcode for p in self.procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                self.close()
                why = f"a worker exited ({dead[0]})" if dead else f"no answer in {self.timeout_s:.0f} s"
                raise DoolyError(f"{self.what}: {why}")
        return conn.recv()

    def ask(self, request: Any) -> list[Any]:
        """Every rank's answer to ``request`` (the same to each), in rank order."""
        for c in self.conns:
            c.send(request)
        return [self._recv(c) for c in self.conns]

    def run(self, calls: Sequence[CollectiveCall], cfg: TimerConfig) -> list[tuple]:
        return self.ask((list(calls), cfg))[0]

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.conns, self.procs = [], []
        shutil.rmtree(self.dir, ignore_errors=True)
        remove_segments(self.ident)  # a worker killed mid-exchange leaves them behind


class CollectiveTimer:
    """Times collectives between real processes; one worker group per group size, kept until :meth:`close`."""

    def __init__(self) -> None:
        self._groups: dict[int, _Group] = {}

    def backend(self, group_size: int) -> str:
        """The communicator backend the workers of ``group_size`` ranks use (``vllm-shm`` or ``gloo``)."""
        return self._group(group_size).backend

    def _group(self, n: int) -> _Group:
        if n < 2:
            raise DoolyError(f"a collective among {n} rank(s) exchanges nothing")
        if n not in self._groups:
            self._groups[n] = _Group(n)
        return self._groups[n]

    def time(self, calls: Sequence[CollectiveCall], cfg: TimerConfig | None = None) -> list[Measurement | str]:
        """Each call's timing (in order), or one line saying why it could not be timed."""
        cfg = cfg or TimerConfig()
        out: list[Measurement | str] = [UNTIMED.get(c.kind, "") for c in calls]
        for n in sorted({c.group_size for c in calls if c.kind not in UNTIMED}):
            idx = [i for i, c in enumerate(calls) if c.group_size == n and c.kind not in UNTIMED]
            try:
                answers = self._group(n).run([calls[i] for i in idx], cfg)
            except DoolyError:
                self._groups.pop(n, None)  # given up: the next call starts a fresh group
                raise
            for i, ans in zip(idx, answers, strict=True):
                out[i] = Measurement(*ans[1:]) if ans[0] == "ok" else str(ans[1])
        return out

    def close(self) -> None:
        for g in self._groups.values():
            g.close()
        self._groups.clear()

    def __enter__(self) -> CollectiveTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def describe(call: CollectiveCall) -> str:
    """``all_reduce of 4 x 128 float32 among 2`` (a failure line names what was measured)."""
    return f"{call.kind} of {' x '.join(map(str, call.shape))} {call.dtype} among {call.group_size}"


__all__ = [
    "COLLECTIVES",
    "UNTIMED",
    "CollectiveCall",
    "CollectiveTimer",
    "collective_call",
    "collective_kind",
    "describe",
]

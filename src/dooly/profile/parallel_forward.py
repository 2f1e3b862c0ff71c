"""Real forwards of a parallel vLLM replica: its ``tp x pp`` ranks in as many processes, one pinned per core.

What a parallel rank's prediction is checked against (``dooly validate --tp``). Each worker (spawned and watched
as :mod:`dooly.profile.collectives`'s are: dies with dooly, owned temp directory, shared-memory segments swept)
joins a world of ``tp x pp`` processes as vLLM's CPU worker does, builds vLLM's model for its rank with dummy weights
(:class:`~dooly.engines.vllm_ranks.VLLMRankEngine`: the engine ``dooly validate`` times at one device, with the
real process groups), and runs the model at each shape asked for with the inputs the one-device validation uses
(:meth:`~dooly.engines.vllm.VLLMEngine.prepare`: the same batch layout, paged KV cache and attention metadata, a
decode's cache filled by a real prefill). Before each timed sample every rank gets a fresh copy of its inputs,
evicts the caches (as :func:`~dooly.profile.timing.measure_prepared` does) and waits at a barrier, so the ranks
start the forward together; the wall time of the rank that ends the step is reported (rank 0 of the last
stage: with pipeline stages, it ends the step after the stages before it; a rank waiting for its peer in an
all-reduce is latency the replica pays), with its thread-CPU time beside it.
"""

from __future__ import annotations

import os
import statistics
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dooly.core.errors import DoolyError, one_line
from dooly.engines._reaper import die_with_parent
from dooly.profile.collectives import _Group, worker_tmpdir
from dooly.profile.timing import quantile

#: a worker's build (vLLM's start, dummy weights) or one shape's forwards; past it a hung rank is given up
_RANK_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankTiming:
    """The timed rank's forwards at one shape: wall seconds per sample, and the thread-CPU seconds of each."""

    wall_s: tuple[float, ...]
    thread_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.wall_s)

    @property
    def p10_s(self) -> float:
        return quantile(list(self.wall_s), 0.1)

    @property
    def p90_s(self) -> float:
        return quantile(list(self.wall_s), 0.9)


def _request_shape(phase: str, values: Mapping[str, int]) -> Any:
    from dooly.engines.base import RequestShape

    if phase == "prefill":
        return RequestShape.prefill(int(values["requests"]), int(values["tokens"]))
    if phase == "decode":
        return RequestShape.decode(int(values["requests"]), int(values["kv_len"]))
    raise DoolyError(f"unknown phase {phase!r} (prefill or decode)")


def _time_shape(engine: Any, model: Any, phase: str, values: Mapping[str, int], repeats: int, warmup: int) -> tuple:
    """Every rank runs this in step; each timed forward starts with the ranks lined up at a barrier."""
    import copy
    import time

    from dooly.profile.timing import evict_caches

    base = engine.prepare(model, _request_shape(phase, values))
    wall, cpu = [], []
    for i in range(warmup + repeats):
        inputs = copy.deepcopy(base)  # a forward extends the cache in place; each starts from the same state
        evict_caches()
        engine.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.forward(model, inputs)
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        if i >= warmup:
            wall.append(dt)
            cpu.append(dc)
    return ("ok", tuple(wall), tuple(cpu))


def _rank_worker(rank: int, world: int, init_file: str, ident: str, core: int | None, conn: Any) -> None:
    """One rank: pinned to its core; builds the model it is sent, then times the shapes it is sent."""
    die_with_parent()  # a rank left in a shared-memory exchange would spin for ever: it goes with dooly
    if os.getppid() == 1:
        return
    worker_tmpdir(init_file)
    if core is not None:
        os.sched_setaffinity(0, {core})
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM's CPU send/recv wraps a read-only buffer (a torch warning on each process's first transfer; harmless)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    engine = model = None
    try:
        import torch

        conn.send(("ready", ""))
        while (req := conn.recv()) is not None:
            try:
                if req[0] == "build":
                    _, config, dtype, threads, tp = req
                    torch.set_num_threads(threads)
                    from dooly.engines.vllm_ranks import VLLMRankEngine

                    engine = VLLMRankEngine(dtype, tp, rank, f"file://{init_file}", ident, pp=world // tp)
                    torch.manual_seed(0)
                    model = engine.build_model(config)
                    conn.send(("ok", engine.backend()))
                else:
                    _, phase, values, repeats, warmup = req
                    conn.send(_time_shape(engine, model, phase, values, repeats, warmup))
            except Exception as exc:  # said to the parent in one line; a peer left mid-exchange is killed by it
                conn.send(("error", one_line(exc)))
    finally:
        if engine is not None:  # vLLM's groups, with their shared memory (the broadcaster's segment included)
            from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()


class ReplicaRanks:
    """The ``tp x pp`` ranks of a parallel vLLM replica of ``config`` (``tp``-way tensor parallel, ``pp`` pipeline
    stages), built once, timed shape by shape until :meth:`close` (also a context manager). Refuses, in one line
    and before starting anything, a model vLLM would not split so (heads that do not divide by ``tp``, ...)."""

    def __init__(
        self, config: Mapping[str, Any], tp: int = 2, dtype: str = "bfloat16", threads: int = 1, pp: int = 1
    ) -> None:
        from dooly.engines import get_engine

        if tp < 1 or pp < 1 or tp * pp < 2:
            raise DoolyError(f"a parallel replica has at least 2 ranks, not {tp} x {pp}")
        # vLLM's own refusal, before any process starts
        get_engine("vllm", dtype=dtype, tp=tp, pp=pp).vllm_config(config)
        self.tp, self.pp = tp, pp
        self.timed_rank = (pp - 1) * tp  # the last stage's first rank ends the step
        self._group: Any = _Group(tp * pp, target=_rank_worker, prefix="dooly-ranks-", timeout_s=_RANK_TIMEOUT_S)
        try:
            answers = self._ask(("build", dict(config), dtype, int(threads), tp))
        except BaseException:
            self.close()
            raise
        self.backend: str = answers[0]

    def _ask(self, request: tuple) -> list[Any]:
        if self._group is None:
            raise DoolyError("the replica's ranks are closed")
        answers = self._group.ask(request)
        bad = [a[1] for a in answers if a[0] != "ok"]
        if bad:
            self.close()  # a rank that failed may have left its peer waiting in an exchange
            raise DoolyError(f"tensor-parallel rank: {bad[0]}")
        return [a[1:] if len(a) > 2 else a[1] for a in answers]

    def time(self, phase: str, values: Mapping[str, int], repeats: int = 5, warmup: int = 1) -> RankTiming:
        """The forwards of ``phase`` at ``values`` (``warmup`` untimed first), every rank running them, as the rank
        that ends the step (:attr:`timed_rank`) timed them."""
        _request_shape(phase, values)  # a bad phase is refused here, not in the workers
        wall, cpu = self._ask(("time", phase, dict(values), int(repeats), int(warmup)))[self.timed_rank]
        return RankTiming(wall, cpu)

    def pids(self) -> list[int]:
        """The rank processes' ids (empty once closed)."""
        return [p.pid for p in self._group.procs] if self._group is not None else []

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def __enter__(self) -> ReplicaRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["RankTiming", "ReplicaRanks"]

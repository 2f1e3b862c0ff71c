"""vLLM as ground truth: the v1 scheduler preset, CPU KV sizing, the bench-record parser, and one real
`vllm serve` run on CPU (dummy weights, offline), skipped when vLLM is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from dooly.core.batch import Batch
from dooly.core.errors import DoolyError
from dooly.engines._reaper import session_pids
from dooly.simulator import (
    Workload,
    cpu_kv_blocks,
    parse_workload,
    simulate,
    vllm_v1_config,
)
from dooly.simulator.memory import kv_layout

VLLM_MISSING = None
try:
    from dooly.serve.vllm_serving import (
        BenchRun,
        ServeConfig,
        VLLMServer,
        _admitted_scores,
        admission_order,
        in_admission_order,
        validate,
        write_model_dir,
    )

    # found, not imported: collecting the suite must not pay vLLM's import in every worker
    VLLM_MISSING = None if importlib.util.find_spec("vllm") else "vLLM is not installed"
except ImportError as exc:  # pragma: no cover - the module itself needs only numpy
    VLLM_MISSING = str(exc)
needs_vllm = pytest.mark.skipif(VLLM_MISSING is not None, reason=str(VLLM_MISSING))


def _gone_within(pids, limit_s: float) -> bool:
    """Whether every process ``pids()`` lists has exited (zombies count as exited) within ``limit_s``."""

    def alive(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids()):
            return True
        time.sleep(0.1)
    return False


class LinearLatency:
    def iteration_latency(self, batch: Batch) -> float:
        return 0.01 + 1e-4 * batch.num_tokens + 1e-7 * sum(batch.decode)


def _smollm_config():
    from types import SimpleNamespace

    from dooly.core.zoo import resolve_model

    return SimpleNamespace(**resolve_model("smollm2-135m")[1])


def test_cpu_kv_blocks_match_what_vllm_reports():
    # vLLM 0.32 (CPU) logs "CPU KV cache size: 46,592 tokens" for smollm2-135m, 1 GiB, block 128, bf16
    cfg = _smollm_config()
    assert kv_layout(cfg, 2).bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert cpu_kv_blocks(cfg, 1, 128, 2) * 128 == 46592
    assert cpu_kv_blocks(cfg, 2, 128, 2) == 728 and cpu_kv_blocks(cfg, 1, 64, 2) == 728
    with pytest.raises(DoolyError, match="holds no block"):
        cpu_kv_blocks(cfg, 1e-6, 128, 2)


def test_v1_preset_chunks_and_records_token_times():
    cfg = vllm_v1_config(4, 64, 16, 64)
    assert cfg.chunked_prefill and cfg.max_num_batched_tokens == 64
    w = parse_workload("poisson:n=12,rate=50,prompt=40-200,output=2-9,seed=3")
    res = simulate(w, LinearLatency(), cfg)
    for r in res.requests:
        assert len(r.token_times) == r.output_tokens
        assert r.token_times[0] == r.first_token and r.token_times[-1] == r.finished
        assert np.all(np.diff(r.token_times) > 0)
    # the budget binds: no iteration schedules more than 64 tokens, and prompts above it were chunked
    assert max(it.prefill_tokens + it.num_decode for it in res.iterations) <= 64
    assert any(it.num_prefill and it.num_decode for it in res.iterations)  # mixed prefill/decode steps (v1)


def _bench_result(w: Workload, **over) -> dict:
    n = len(w)
    res = {
        "errors": [""] * n,
        "output_lens": list(w.output),
        "ttfts": [0.1 + 0.01 * i for i in range(n)],
        "latencies": [0.1 + 0.01 * i + 0.02 * (o - 1) for i, o in enumerate(w.output)],
        "start_times": list(100.0 + w.arrival),
        "itls": [[0.02] * (int(o) - 1) for o in w.output],
    }
    res.update(over)
    return res


def test_bench_records_become_request_metrics():
    w = Workload(np.array([0.0, 0.5, 1.0]), np.array([10, 20, 30]), np.array([4, 1, 6]))
    run = BenchRun.from_result(w, _bench_result(w))
    np.testing.assert_allclose(run.metrics.ttft, [0.10, 0.11, 0.12])
    np.testing.assert_allclose(run.metrics.tpot[[0, 2]], [0.02, 0.02])
    assert np.isnan(run.metrics.tpot[1])  # one output token: no TPOT
    np.testing.assert_allclose(run.send_lag, 0.0, atol=1e-9)
    with pytest.raises(DoolyError, match="1 of 3 requests failed"):
        BenchRun.from_result(w, _bench_result(w, errors=["", "Traceback\nConnectionError: refused", ""]))
    with pytest.raises(DoolyError, match="produced 3 tokens"):
        BenchRun.from_result(w, _bench_result(w, output_lens=[3, 1, 6]))


def test_requests_admitted_out_of_order_are_simulated_in_that_order():
    """Two requests 0.4 ms apart, the later one admitted first (vLLM's front end does not keep the order of
    near-simultaneous requests): replayed in the order of the server's log, the simulation serves it first, and
    scored against runs that did, its error is the one left once that order is known."""
    log = ("INFO [async_llm.py:578] Added request cmpl-dooly-0-0-a1.\nnoise\n"
           "INFO [async_llm.py:578] Added request cmpl-dooly-2-0-b2.\n"
           "INFO [async_llm.py:578] Added request cmpl-dooly-1-0-c3.\n")  # fmt: skip
    order = admission_order(log, 3)
    assert order.tolist() == [0, 2, 1]
    assert admission_order(log, 4) is None and admission_order(log + log, 3) is None
    w = Workload(np.array([0.0, 1.0, 1.0004]), np.array([200, 250, 60]), np.array([4, 4, 4]))
    retimed, shift = in_admission_order(w, order)
    assert retimed.prompt.tolist() == [200, 60, 250]
    np.testing.assert_allclose(shift, [0.0, 0.0004 + 1e-6, 0.0], atol=1e-12)
    cfg = vllm_v1_config(4, 256, 16, 64)
    plain = simulate(w, LinearLatency(), cfg).metrics.ttft
    assert plain[1] < plain[2]  # in arrival order the long prompt is prefilled first
    # runs that served request 2 first, as the replay does
    sim = simulate(retimed, LinearLatency(), cfg)
    ttft = sim.metrics.ttft[[0, 2, 1]] + shift
    assert ttft[2] < ttft[1]
    runs = []
    for _ in range(2):
        run = BenchRun.from_result(w, _bench_result(w, ttfts=list(ttft)))
        run.admitted = order
        runs.append(run)
    scores = _admitted_scores(w, runs, LinearLatency(), cfg, runs[0].metrics, np.full(3, 0.02))
    assert scores["requests_out_of_order"] == [2, 2]
    assert scores["ttft_mape"] < 1e-6
    from dooly.core import stats

    assert stats.mape(plain, ttft) > 30  # the same runs scored in arrival order
    runs[1].admitted = None
    assert _admitted_scores(w, runs, LinearLatency(), cfg, runs[0].metrics, np.full(3, 0.02)) is None


def test_model_dir_names_the_causal_lm_class(tmp_path):
    pytest.importorskip("transformers")
    name, d = write_model_dir("smollm2-135m", tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    assert name == "smollm2-135m" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30


def test_a_model_whose_weights_and_kv_cache_do_not_fit_is_refused_before_the_server_starts(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from dooly.engines import base
    from dooly.serve import vllm_serving

    monkeypatch.setattr(base, "free_memory_bytes", lambda device: 2 * 2**30)  # 1.8 GiB usable: not 0.25 + 2 GiB
    started = []
    monkeypatch.setattr(vllm_serving.VLLMServer, "__enter__", lambda self: started.append(self))
    wl = parse_workload("poisson:n=2,rate=1,prompt=8-16,output=2-4,seed=0")
    cfg = vllm_serving.ServeConfig(2, 64, kvcache_space_gb=2)
    with pytest.raises(DoolyError, match=r"smollm2-135m: its weights take (at least )?.* MiB in bfloat16 \(and its KV "
                                         r"cache 2\.00 GiB\) and cpu has 2\.00 GiB free"):  # fmt: skip
        vllm_serving.validate("smollm2-135m", wl, cfg, 16, LinearLatency())
    assert not started


# a server slow to stop (SIGTERM ignored, so it is killed after the timeout) holding Python shared memory, as
# vLLM's message queues are: its session's SIGKILL takes the resource tracker that would have unlinked it
HOLD_SHM = (
    "import signal, sys\n"
    "from multiprocessing import shared_memory\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "m = shared_memory.SharedMemory(create=True, size=4096)\n"
    "print(m.name, flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_killed_servers_shared_memory_is_removed(tmp_path):
    server = VLLMServer("smollm2-135m", ServeConfig(max_num_seqs=2, max_num_batched_tokens=128), workdir=tmp_path)
    server.proc = proc = subprocess.Popen([sys.executable, "-c", HOLD_SHM], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    segment = Path("/dev/shm") / proc.stdout.readline().strip()
    try:
        assert segment.exists()
        server.stop(timeout=0.5)
        assert not segment.exists()
    finally:
        segment.unlink(missing_ok=True)
        proc.stdin.close()
        proc.stdout.close()


@needs_vllm
def test_server_that_fails_to_start_is_stopped(tmp_path):
    cfg = ServeConfig(4, 128, startup_timeout_s=2)
    srv = VLLMServer("smollm2-135m", cfg, workdir=tmp_path)
    with pytest.raises(DoolyError, match="did not come up in 2 s"):
        with srv:
            pass
    assert srv.proc is None and srv.sid is not None
    # nothing of its session is left (the engine core it may have spawned included)
    assert _gone_within(lambda: session_pids(srv.sid), 10.0), f"session {srv.sid} of the failed server is alive"


@needs_vllm
def test_real_vllm_serve_against_the_simulator(tmp_path):
    """One server, two real runs of a workload that queues (8 requests at once, 2 sequences at a time)."""
    w = parse_workload("static:n=8,prompt=24-160,output=6-12,seed=1")
    cfg = ServeConfig(max_num_seqs=2, max_num_batched_tokens=128, max_model_len=256)
    affinity = os.sched_getaffinity(0)
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("vllm_dist_*"))
    payload = validate("smollm2-135m", w, cfg, 364, LinearLatency(), real_runs=2, workdir=tmp_path, log=lambda m: None)
    assert os.sched_getaffinity(0) == affinity  # the load generator's pinning is undone
    # the server's temp files (vLLM's vllm_dist_* rendezvous file among them) went with it
    assert set(tmp.glob("vllm_dist_*")) <= before and not list(tmp.glob(f"dooly-vllm-tmp-{os.getpid()}-*"))
    assert [r["kind"] for r in payload["runs"]] == ["warm-up", "real", "real"]
    assert payload["server"]["kv_cache_tokens"] == 364 * 128  # the simulator's sizing is vLLM's
    measured = payload["measured"]
    assert np.all(measured["ttft"] > 0) and np.all(np.isfinite(measured["tpot"]))
    # queueing: with 2 sequences at a time the last requests wait for earlier ones to finish
    assert measured["ttft"].max() > 2 * measured["ttft"].min()
    assert np.all(measured["e2e"] > measured["ttft"])
    noise = payload["run_to_run_pct"]
    assert set(noise) == {"ttft", "tpot", "itl", "ttft_quantiles", "tpot_quantiles"}
    assert all(np.isfinite(v) for v in noise.values())
    assert {r["metric"] for r in payload["table"]} == {"TTFT", "TPOT"}
    assert all(np.isfinite(r["quantile_err_pct"]) for r in payload["table"])
    assert np.isfinite(payload["iteration_mape"])
    # the headline: p50/p90/p99 of TTFT, TPOT, ITL and E2E, each with the two real runs' spread beside it
    pcts = payload["percentiles"]
    assert set(pcts) == {"ttft", "tpot", "itl", "e2e"} and pcts["itl"]["percentiles"] == [50.0, 90.0, 99.0]
    assert all(np.isfinite(s["mean_error_pct"]) and np.isfinite(s["mean_spread_pct"]) for s in pcts.values())
    real_p50s = [r["ttft_p50"] for r in payload["runs"] if r["kind"] == "real"]
    assert pcts["ttft"]["measured"][0] == pytest.approx(np.median(real_p50s))  # each run's p50, then their median
    admitted = payload["admission_order"]  # read from the server's log (--enable-log-requests)
    assert admitted is not None and len(admitted["requests_out_of_order"]) == 2
    assert np.isfinite(admitted["ttft_mape"]) and np.isfinite(admitted["iteration_mape"])


def test_front_end_is_kept_off_the_engine_cores():
    mine = set(os.sched_getaffinity(0))
    one = ServeConfig(max_num_seqs=2, max_num_batched_tokens=128, threads=1)
    assert one.frontend_cores() == ((mine - {0}) or None)
    assert ServeConfig(2, 128, threads=1, pin_frontend=False).frontend_cores() is None
    assert ServeConfig(2, 128, threads=len(mine) + 8).frontend_cores() is None  # no core left: leave it alone


def test_cli_refuses_vllm_cleanly_without_it(tmp_path):
    if VLLM_MISSING is None:
        pytest.skip("vLLM is installed; the refusal path is for machines without it")
    db = tmp_path / "p.db"
    db.write_bytes(b"")
    proc = subprocess.run(
        [sys.executable, "-m", "dooly", "validate-serving", "smollm2-135m", "--db", str(db), "--engine", "vllm"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "vLLM is not importable" in proc.stderr + proc.stdout


def test_vllm_simulation_falls_back_to_hf_profiles_and_says_so(monkeypatch, capsys):
    import dooly.api as serve_cli

    def fake(model, db, dtype, threads, engine, shape=False):
        if engine == "vllm":
            raise DoolyError("no profiles taken with vllm")
        return f"predictor<{engine}>"

    monkeypatch.setattr(serve_cli, "load_latency_model", fake)
    assert serve_cli.serving_latency_model("m", "db", "bfloat16", 1, "vllm") == ("predictor<hf-eager>", "hf-eager")
    assert "ops profiled with hf-eager" in capsys.readouterr().out
    assert serve_cli.serving_latency_model("m", "db", "bfloat16", 1, "hf-eager") == ("predictor<hf-eager>", "hf-eager")

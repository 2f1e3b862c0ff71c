"""`dooly validate-serving --engine vllm --tp N --pp M`: a real tensor / pipeline parallel `vllm serve` against the
simulator's replica. The fast tests fake the server and the profiles: the server's arguments and per-rank core
binding, the refusals, and that the simulation takes the replica's predictor from the path `dooly simulate --tp
--pp` takes. One slow test serves a tiny llama (4 heads, 2 KV heads) on a real TP=2 server, a core per rank."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dooly import api
from dooly.cli import app
from dooly.core.errors import DoolyError
from dooly.serve import vllm_serving
from dooly.serve.vllm_serving import ServeConfig, VLLMServer, validate
from dooly.simulator import PipelineLatency, parse_workload

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "max_position_embeddings": 512}  # fmt: skip
WORKLOAD = "static:n=4,prompt=16-40,output=3-5,seed=1"


def _cores(monkeypatch, n: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_tp2_server_gets_the_parallel_sizes_and_a_core_per_rank(monkeypatch):
    _cores(monkeypatch, 2)
    cfg = ServeConfig(2, 128, tp=2)
    args, env = cfg.args(), cfg.env()
    assert _flag(args, "--tensor-parallel-size") == "2" and _flag(args, "--pipeline-parallel-size") == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"  # vLLM's per-rank lists, ranks separated by "|"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # per rank
    # every core is a rank's: the front end is left unpinned, and the layout says so
    assert cfg.frontend_cores() is None
    assert "no core of their own" in cfg.layout() and "rank 1 on core 1" in cfg.layout()


def test_pp2_server_and_ranks_of_several_threads(monkeypatch):
    _cores(monkeypatch, 8)
    cfg = ServeConfig(2, 128, pp=2)
    assert _flag(cfg.args(), "--pipeline-parallel-size") == "2" and _flag(cfg.args(), "--tensor-parallel-size") == "1"
    assert cfg.env()["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    # tp 2 x pp 2 of 2 threads each: ranks in vLLM's order (stage x tp + rank), the front end on what is left
    big = ServeConfig(2, 128, threads=2, tp=2, pp=2)
    assert big.env()["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3|4-5|6-7"
    assert big.frontend_cores() is None
    _cores(monkeypatch, 10)
    assert big.frontend_cores() == {8, 9} and "front end and load generator on cores 8-9" in big.layout()
    # one rank: the binding and the arguments of a plain server
    one = ServeConfig(2, 128, threads=2)
    assert one.env()["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and _flag(one.args(), "--tensor-parallel-size") == "1"


def test_the_server_is_started_with_the_replica_s_arguments_and_binding(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    _cores(monkeypatch, 2)
    started = {}

    class Proc:
        pid, returncode = 999999, None

        def poll(self):
            return None

        def send_signal(self, sig):
            assert sig == signal.SIGTERM

        def wait(self, timeout=None):
            return 0

    def spawn(cmd, **kw):
        started.update(cmd=cmd, **kw)
        return Proc()

    monkeypatch.setattr(vllm_serving._reaper, "spawn", spawn)
    monkeypatch.setattr(vllm_serving._reaper, "kill_session", lambda pid, sig: None)
    monkeypatch.setattr(VLLMServer, "_healthy", lambda self: True)
    with VLLMServer("qwen2.5-0.5b", ServeConfig(2, 128, tp=2), workdir=tmp_path):
        pass
    assert _flag(started["cmd"], "--tensor-parallel-size") == "2"
    assert started["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert started["preexec_fn"] is None  # not pinned onto a rank's core


def test_refusals(monkeypatch, tmp_path):
    _cores(monkeypatch, 2)
    db = tmp_path / "p.db"
    with pytest.raises(DoolyError, match=r"--tp 2 --pp 1 serves a parallel replica with `vllm serve`: give --engine"):
        api.validate_serving("qwen2.5-0.5b", db, engine="hf-eager", tp=2, save=False)
    with pytest.raises(DoolyError, match=r"4 ranks of 1 thread\(s\) need 4 cores, dooly has 2 here"):
        api.validate_serving("qwen2.5-0.5b", db, engine="vllm", tp=2, pp=2, threads=1, save=False)
    with pytest.raises(DoolyError, match=r"2 ranks of 2 thread\(s\) need 4 cores"):
        api.validate_serving("qwen2.5-0.5b", db, engine="vllm", tp=2, threads=2, save=False)
    # on the command line: one line, before anything starts
    res = CliRunner().invoke(app, ["validate-serving", "qwen2.5-0.5b", "--db", str(db), "--tp", "2"])
    assert isinstance(res.exception, DoolyError) and "\n" not in str(res.exception)


class LinearLatency:
    def iteration_latency(self, batch) -> float:  # type: ignore[no-untyped-def]
        return 0.01 + 1e-4 * batch.num_tokens


class FakeRank:
    """A stage's predictor: a constant iteration, and a collectives' share for the report's lines."""

    collective_notes = ("two ranks timed",)
    method = "interp"

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def iteration_latency(self, batch) -> float:  # type: ignore[no-untyped-def]
        return 0.01 * (1 + self.stage)

    def collectives_share(self, phase, values) -> float:  # type: ignore[no-untyped-def]
        return 0.25


@pytest.fixture
def fake_profiles(monkeypatch):
    """Stage predictors from the layout asked for; `vllm_serving.validate` records what it was given."""
    pytest.importorskip("transformers")
    loads, seen = [], {}

    def load(model, db, dtype, threads, engine, shape=False, tp=1, pp=1, pp_stage=0, method="auto"):
        loads.append((engine, tp, pp, pp_stage))
        return FakeRank(pp_stage)

    def fake_validate(model, w, config, blocks, latency, real_runs, log=print, warmup_runs=1):
        seen.update(config=config, blocks=blocks, latency=latency)
        return {"kind": "validation", "layout": {"describe": config.layout()}}

    monkeypatch.setattr(api, "load_latency_model", load)
    monkeypatch.setattr(api, "warm_traces", lambda *a: None)
    monkeypatch.setattr(vllm_serving, "vllm_available", lambda: None)
    monkeypatch.setattr(vllm_serving, "validate", fake_validate)
    return loads, seen


def test_validation_simulates_the_pipeline_replica_as_simulate_does(monkeypatch, tmp_path, fake_profiles):
    loads, seen = fake_profiles
    _cores(monkeypatch, 2)
    calls = []
    real = api.replica_latency_model
    monkeypatch.setattr(api, "replica_latency_model", lambda *a: calls.append(a) or real(*a))
    lines = []
    hooks = api.ServeHooks(report=lines.append)
    api.validate_serving("qwen2.5-0.5b", tmp_path / "p.db", workload=WORKLOAD, engine="vllm", pp=2, threads=1,
                         save=False, hooks=hooks)  # fmt: skip
    assert loads == [("vllm", 1, 2, 0), ("vllm", 1, 2, 1)]  # a predictor per stage, each its own rank's
    lat = seen["latency"]
    assert isinstance(lat, PipelineLatency) and [s.model.stage for s in lat.stages] == [0, 1]
    assert seen["config"].pp == 2 and seen["config"].tp == 1
    assert any(line.startswith("stage 1: collectives: 25.0%") for line in lines)
    # a stage caches its own layers in the space each rank sets aside: twice one device's blocks
    assert seen["blocks"] == api.vllm_cpu_kv_blocks("qwen2.5-0.5b", 2, 128, "bfloat16")
    # `dooly simulate --pp 2` takes the same path with the same layout
    loads.clear()
    api.simulate("qwen2.5-0.5b", tmp_path / "p.db", workload=WORKLOAD, engine="vllm", pp=2, save=False)
    assert loads == [("vllm", 1, 2, 0), ("vllm", 1, 2, 1)]
    assert [c[6:8] for c in calls] == [(1, 2), (1, 2)]  # (tp, pp) of validate-serving's call, then simulate's


def test_validation_of_a_tp2_replica_uses_the_rank_s_predictor(monkeypatch, tmp_path, fake_profiles):
    loads, seen = fake_profiles
    _cores(monkeypatch, 2)
    api.validate_serving("qwen2.5-0.5b", tmp_path / "p.db", workload=WORKLOAD, engine="vllm", tp=2, threads=1,
                         save=False)  # fmt: skip
    assert loads == [("vllm", 2, 1, 0)]  # rank 0 of the TP=2 replica, no fallback to one device's profiles
    assert seen["latency"].model.stage == 0 and seen["config"].tp == 2
    # 2 KV heads over 2 ranks: each rank's space holds half the heads, twice the blocks
    assert seen["blocks"] == api.vllm_cpu_kv_blocks("qwen2.5-0.5b", 2, 128, "bfloat16")


def test_missing_rank_profiles_name_the_profile_command(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    _cores(monkeypatch, 2)
    monkeypatch.setattr(vllm_serving, "vllm_available", lambda: None)
    db = tmp_path / "p.db"
    want = f"`dooly profile qwen2.5-0.5b --db {db} --engine vllm --tp 2`"
    with pytest.raises(DoolyError, match="no such profile database") as exc:  # no DB at all
        api.validate_serving("qwen2.5-0.5b", db, engine="vllm", tp=2, threads=1, save=False)
    assert want in str(exc.value)

    def unprofiled(*a, **kw):
        raise DoolyError(f"{db}: 40 signatures of qwen2.5-0.5b have no profile for x (run `dooly profile x --db y`)")

    monkeypatch.setattr(api, "load_latency_model", unprofiled)
    monkeypatch.setattr(api, "warm_traces", lambda *a: None)
    with pytest.raises(DoolyError) as exc:
        api.validate_serving("qwen2.5-0.5b", db, engine="vllm", pp=2, threads=1, save=False)
    msg = str(exc.value)
    assert "40 signatures of qwen2.5-0.5b have no profile" in msg and "dooly profile x" not in msg
    assert f"--engine vllm --tp 1 --pp 2 --pp-stage 0` and `dooly profile qwen2.5-0.5b --db {db}" in msg
    assert msg.endswith("--pp-stage 1`)")


@pytest.mark.slow  # a real TP=2 `vllm serve` (two ranks, a core each): ~1-2 min on 2 cores
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a TP=2 replica needs 2 cores")
def test_real_tp2_vllm_serve(tmp_path):
    """The tiny llama on a real TP=2 server, scored against a constant-per-token stand-in predictor."""
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LLAMA))
    w = parse_workload(WORKLOAD)
    cfg = ServeConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256, tp=2)
    blocks = api.vllm_cpu_kv_blocks(str(path), api.kv_devices(str(path), 2), 128, cfg.dtype)
    shm = set(Path("/dev/shm").glob("vllm_dist_*"))
    payload = validate(str(path), w, cfg, blocks, LinearLatency(), real_runs=1, workdir=tmp_path / "w", log=print)
    assert set(Path("/dev/shm").glob("vllm_dist_*")) <= shm  # the ranks' shared-memory segments went with them
    assert payload["layout"]["tp"] == 2 and payload["layout"]["omp_bind"] == "0|1"
    assert payload["server"]["kv_cache_tokens"] == blocks * 128  # the simulator's sizing is the replica's
    assert np.all(payload["measured"]["ttft"] > 0) and np.all(np.isfinite(payload["measured"]["tpot"]))

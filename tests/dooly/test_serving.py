"""The real-engine serving loop: numerically the same tokens as plain greedy decoding, whatever the batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dooly.engines import get_engine
from dooly.engines.hf import HFEagerEngine
from dooly.engines.hf_serving import HFExecutor
from dooly.serve import serving
from dooly.simulator import SchedulerConfig, Workload

transformers = pytest.importorskip("transformers")
ENGINE = get_engine()


def _build(cfg, seed: int = 0) -> torch.nn.Module:
    """A float32 causal LM with random weights from a transformers config object."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_model():
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    return _build(cfg, seed=0)


def _serve_and_capture(model, workload, config):
    holder = {}

    class Spy(HFEagerEngine):
        def executor(self, *a, **k):
            holder["ex"] = super().executor(*a, **k)
            return holder["ex"]

    res = serving.serve(workload, model, config, Spy(), threads=1, warmup=False)
    return res, holder["ex"]


def _greedy(model, prompt, n):
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize(
    "config",
    [
        SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64),
        SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, chunked_prefill=True, block_size=4),
        # two blocks of 16 per request at most: forces recompute preemption mid-decode
        SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, block_size=8, num_kv_blocks=9),
    ],
    ids=["whole", "chunked", "preempting"],
)
def test_tokens_match_unbatched_greedy(tiny_model, config):
    w = Workload(np.array([0.0, 0.0, 0.001]), np.array([20, 9, 30]), np.array([7, 12, 5]))
    res, ex = _serve_and_capture(tiny_model, w, config)
    assert all(r.generated == r.output_tokens for r in res.requests)
    if config.num_kv_blocks == 9:
        assert res.summary.preemptions > 0
    for r in res.requests:
        toks = ex.tokens[r.id]
        assert len(toks) == r.prompt_tokens + r.output_tokens
        assert toks[r.prompt_tokens :] == _greedy(tiny_model, toks[: r.prompt_tokens], r.output_tokens)
    assert ex.owner == [] and ex.slot == {}  # every slot released


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_serving_on_cuda_gives_the_cpu_tokens(tiny_model):
    """The executor keeps its KV slots and inputs on the model's device; greedy tokens are the CPU's."""
    import copy

    w = Workload(np.array([0.0, 0.0, 0.001]), np.array([20, 9, 30]), np.array([7, 12, 5]))
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, chunked_prefill=True, block_size=4)
    cpu, ex_cpu = _serve_and_capture(tiny_model, w, config)
    gpu, ex_gpu = _serve_and_capture(copy.deepcopy(tiny_model).cuda(), w, config)
    assert ex_gpu.k[0].is_cuda
    assert all(r.generated == r.output_tokens for r in gpu.requests)
    assert ex_gpu.tokens == ex_cpu.tokens


def test_measured_metrics_are_consistent(tiny_model):
    w = Workload(np.array([0.0, 0.01, 0.02, 0.03]), np.array([16, 24, 8, 12]), np.array([5, 3, 6, 1]))
    res = serving.serve(w, tiny_model, SchedulerConfig(max_num_seqs=2), ENGINE, threads=1, warmup=True)
    m = res.metrics
    assert np.all(m.ttft > 0) and np.all(m.ttft <= m.e2e)
    assert np.isnan(m.tpot[3]) and np.all(m.tpot[:3] > 0)
    assert np.all(m.arrival + m.ttft >= w.arrival)  # nobody is served before it arrives
    assert len(res.batches) == len(res.iterations) and res.summary.max_batch_size <= 2


def test_sliding_window_models_are_refused():
    cfg = transformers.MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        sliding_window=16,
    )
    model = _build(cfg)
    from dooly.core.errors import DoolyError

    with pytest.raises(DoolyError, match="full-attention"):
        HFExecutor(model, 2, 64)


def test_thread_clock_is_a_virtual_timeline(tiny_model):
    # the second request arrives 1000 s later: the thread clock jumps the idle gap instead of sleeping
    w = Workload(np.array([0.0, 1000.0]), np.array([12, 12]), np.array([4, 4]))
    res = serving.serve(w, tiny_model, SchedulerConfig(), ENGINE, threads=1, warmup=False, clock="thread")
    its = res.iterations
    assert all(b.start >= a.end for a, b in zip(its, its[1:], strict=False))  # one iteration at a time
    assert its[-1].end > 1000.0 and res.metrics.e2e.max() < 60.0
    np.testing.assert_allclose(res.metrics.ttft[1], its[[i.start >= 1000 for i in its].index(True)].end - 1000.0)
    with pytest.raises(serving.DoolyError, match="unknown clock"):
        serving.serve(w, tiny_model, SchedulerConfig(), ENGINE, clock="sundial")


def test_real_runs_average_and_their_spread(tiny_model):
    w = Workload(np.array([0.0, 0.0, 5.0]), np.array([12, 20, 8]), np.array([4, 3, 5]))
    runs = [serving.serve(w, tiny_model, SchedulerConfig(), ENGINE, threads=1, clock="thread") for _ in range(2)]
    avg = serving.average_runs(runs)
    a, b = runs[0].metrics, runs[1].metrics
    np.testing.assert_allclose(avg.metrics.ttft, (a.ttft + b.ttft) / 2)  # median of two runs = their mean
    assert avg.batches is runs[0].batches  # same schedule: the first run's iterations stand for all
    spread = serving.request_spread(runs)
    want = np.mean(np.abs(a.ttft - b.ttft) / ((a.ttft + b.ttft) / 2)) * 100
    assert spread["ttft"] == pytest.approx(want) and spread["tpot"] >= 0
    assert serving.request_spread(runs[:1])["ttft"] != serving.request_spread(runs[:1])["ttft"]  # NaN with one run
    assert serving.average_runs(runs[:1]) is runs[0]


def test_distribution_error_ignores_which_request_waited():
    from dooly.core import stats

    measured = np.array([0.01, 0.02, 0.5, 0.9, 1.2])
    swapped = measured[[1, 0, 3, 2, 4]]  # the same latencies, handed to other requests
    assert stats.mape(swapped, measured) > 40  # per request: two requests wrong by half or more
    assert stats.quantile_error_pct(swapped, measured) == 0.0
    assert stats.quantile_error_pct(measured * 1.1, measured) == pytest.approx(10.0)
    runs = np.stack([measured, swapped * 1.2])
    assert stats.quantile_spread_pct(runs) == pytest.approx(stats.spread_pct(np.stack([measured, measured * 1.2])))
    assert np.isnan(stats.quantile_spread_pct(runs[:1]))  # one run: no floor


def test_percentile_errors_score_each_runs_percentiles_with_their_spread():
    from dooly.core import stats

    base = np.linspace(0.01, 1.0, 200)
    runs = [base, base * 1.1]  # two real runs, the second 10% slower throughout
    s = stats.percentile_errors(base * 1.05, runs)
    assert s["percentiles"] == [50.0, 90.0, 99.0]
    np.testing.assert_allclose(s["measured"], np.percentile(base, [50, 90, 99]) * 1.05)  # median of the runs'
    np.testing.assert_allclose(s["error_pct"], 0.0, atol=1e-9)
    assert s["mean_spread_pct"] == pytest.approx(100 * 0.1 / 1.05)  # (max - min) / mean of the two runs
    assert stats.percentile_errors(base[::-1] * 1.2, runs[:1])["mean_error_pct"] == pytest.approx(20.0)
    assert np.isnan(stats.percentile_errors(base, runs[:1])["mean_spread_pct"])  # one run: no noise floor


def test_pooled_itl_takes_every_gap_of_every_request():
    from types import SimpleNamespace

    reqs = [
        SimpleNamespace(token_times=[1.0, 1.5, 2.5]),
        SimpleNamespace(token_times=[3.0]),
        SimpleNamespace(token_times=[0.0, 0.25]),
    ]
    np.testing.assert_allclose(serving.pooled_itl(reqs), [0.5, 1.0, 0.25])
    assert len(serving.pooled_itl([])) == 0

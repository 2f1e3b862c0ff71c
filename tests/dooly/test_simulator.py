"""The serving simulator against analytic latency models: invariants and a hand-computed timeline."""

from __future__ import annotations

import numpy as np
import pytest

from dooly.batch import Batch
from dooly.errors import DoolyError
from dooly.simulator import SchedulerConfig, Workload, generate_workload, simulate


class ConstantLatency:
    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds = seconds
        self.batches: list[Batch] = []

    def iteration_latency(self, batch: Batch) -> float:
        self.batches.append(batch)
        return self.seconds


class LinearLatency:
    """A roofline-ish stand-in: fixed overhead + per token + per cached token attended."""

    def iteration_latency(self, batch: Batch) -> float:
        attended = sum(n * (c + n) for n, c in batch.prefill) + sum(k + 1 for k in batch.decode)
        return 0.002 + 1e-4 * batch.num_tokens + 1e-7 * attended


def wl(arrival, prompt, output) -> Workload:
    return Workload(np.array(arrival, float), np.array(prompt), np.array(output))


def test_hand_computed_timeline_whole_prefill():
    # A arrives at 0, B at 0.5; one second per iteration. vLLM v0 gives prefills priority:
    # [0,1] prefill A; [1,2] prefill B; [2,3] decode A,B; [3,4] decode A,B -> both finish at 4.
    res = simulate(wl([0.0, 0.5], [4, 4], [3, 3]), ConstantLatency(1.0), SchedulerConfig(max_num_batched_tokens=64))
    m = res.metrics
    np.testing.assert_allclose(m.ttft, [1.0, 1.5])
    np.testing.assert_allclose(m.e2e, [4.0, 3.5])
    np.testing.assert_allclose(m.tpot, [1.5, 1.0])
    assert [(it.num_prefill, it.num_decode) for it in res.iterations] == [(1, 0), (1, 0), (0, 2), (0, 2)]


def test_batch_shapes_passed_to_predictor():
    lat = ConstantLatency(1.0)
    simulate(wl([0.0, 0.0], [5, 3], [3, 2]), lat, SchedulerConfig(max_num_batched_tokens=64))
    # one prefill of both, then decodes with KV lengths = tokens already cached
    assert lat.batches[0] == Batch(prefill=((3, 0), (5, 0)))
    assert lat.batches[1] == Batch(decode=(3, 5))
    assert lat.batches[2] == Batch(decode=(6,))
    assert len(lat.batches) == 3


def test_chunked_prefill_timeline():
    # budget 4 tokens: a 10-token prompt takes chunks 4,4,2 -> first token after 3 iterations
    lat = ConstantLatency(0.5)
    res = simulate(
        wl([0.0], [10], [2]), lat, SchedulerConfig(max_num_batched_tokens=4, chunked_prefill=True, block_size=4)
    )
    assert [b.prefill for b in lat.batches[:3]] == [((4, 0),), ((4, 4),), ((2, 8),)]
    assert lat.batches[3] == Batch(decode=(10,))
    assert res.metrics.ttft[0] == pytest.approx(1.5)
    assert res.metrics.e2e[0] == pytest.approx(2.0)


@pytest.mark.parametrize("chunked", [False, True])
def test_conservation_and_ordering(chunked):
    w = generate_workload(80, rate=40.0, prompt="8-200", output="1-40", seed=3)
    cfg = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, chunked_prefill=chunked, num_kv_blocks=600)
    res = simulate(w, LinearLatency(), cfg)
    assert all(r.finished is not None and r.generated == r.output_tokens for r in res.requests)
    # every generated token is accounted for by exactly one prefill completion or decode
    decoded = sum(it.num_decode for it in res.iterations)
    first_tokens = sum(r.preemptions + 1 for r in res.requests)
    assert decoded + first_tokens == int(w.output.sum())
    m = res.metrics
    assert np.all(m.ttft > 0) and np.all(m.ttft <= m.e2e + 1e-12)
    assert all(it.kv_blocks_used <= it.kv_blocks_total for it in res.iterations)
    assert all(it.num_prefill + it.num_decode <= cfg.max_num_seqs for it in res.iterations)
    assert all(it.end > it.start for it in res.iterations)
    assert all(r.kv_blocks == 0 for r in res.requests)


def test_chunked_prefill_respects_token_budget():
    w = generate_workload(60, rate=100.0, prompt="50-400", output="2-20", seed=1)
    lat = ConstantLatency(0.01)
    cfg = SchedulerConfig(max_num_batched_tokens=128, chunked_prefill=True, num_kv_blocks=2000)
    res = simulate(w, lat, cfg)
    assert max(b.num_tokens for b in lat.batches) <= 128
    assert any(len(b.prefill) and len(b.decode) for b in lat.batches)  # mixed batches happen
    assert max(it.prefill_tokens for it in res.iterations) == 128  # and the budget is actually used


def test_preemption_when_kv_is_small():
    w = generate_workload(40, rate=1000.0, prompt="60-100", output="40-80", seed=2)
    small = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096, block_size=16, num_kv_blocks=40)
    res = simulate(w, LinearLatency(), small)
    assert res.summary.preemptions > 0
    assert max(it.kv_blocks_used for it in res.iterations) <= 40
    assert all(r.generated == r.output_tokens for r in res.requests)
    big = simulate(w, LinearLatency(), SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096))
    assert big.summary.preemptions == 0
    # recompute costs time: the squeezed replica is slower end to end
    assert res.summary.e2e["mean"] > big.summary.e2e["mean"]


def test_preemption_with_chunked_prefill():
    w = generate_workload(40, rate=1000.0, prompt="60-100", output="40-80", seed=2)
    cfg = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=64, chunked_prefill=True, num_kv_blocks=40)
    res = simulate(w, LinearLatency(), cfg)
    assert res.summary.preemptions > 0
    assert all(r.generated == r.output_tokens for r in res.requests)
    assert max(it.kv_blocks_used for it in res.iterations) <= 40


def test_deterministic():
    w = generate_workload(50, rate=20.0, prompt="ln:100:0.6", output="5-30", seed=9)
    a = simulate(w, LinearLatency(), SchedulerConfig(num_kv_blocks=100))
    b = simulate(w, LinearLatency(), SchedulerConfig(num_kv_blocks=100))
    np.testing.assert_array_equal(a.metrics.e2e, b.metrics.e2e)
    assert a.summary.row() == b.summary.row()


def test_multiple_replicas_cut_latency():
    w = generate_workload(60, rate=200.0, prompt="100", output="20", seed=4)
    one = simulate(w, LinearLatency(), SchedulerConfig(max_num_seqs=4))
    two = simulate(w, LinearLatency(), SchedulerConfig(max_num_seqs=4), num_replicas=2)
    assert two.summary.e2e["p90"] < one.summary.e2e["p90"]
    assert {it.replica for it in two.iterations} == {0, 1}


def test_max_num_seqs_bounds_batch():
    w = generate_workload(30, rate=1e6, prompt="10", output="10", seed=0)
    res = simulate(w, ConstantLatency(0.01), SchedulerConfig(max_num_seqs=5))
    assert res.summary.max_batch_size == 5


def test_unservable_request_is_refused():
    with pytest.raises(DoolyError, match="max_num_batched_tokens"):
        simulate(wl([0.0], [500], [10]), ConstantLatency(), SchedulerConfig(max_num_batched_tokens=256))
    with pytest.raises(DoolyError, match="KV blocks"):
        simulate(wl([0.0], [500], [10]), ConstantLatency(), SchedulerConfig(num_kv_blocks=4, chunked_prefill=True))


def test_single_token_outputs_have_no_tpot():
    res = simulate(wl([0.0, 0.0], [8, 8], [1, 4]), ConstantLatency(1.0))
    assert np.isnan(res.metrics.tpot[0]) and res.metrics.tpot[1] == pytest.approx(1.0)
    assert res.metrics.e2e[0] == pytest.approx(1.0)


def test_sweep_picks_best_under_slo():
    from dooly.simulator.search import SLO, best, config_grid, sweep

    w = generate_workload(60, rate=30.0, prompt="100-300", output="10-30", seed=7)
    configs = config_grid(SchedulerConfig(), max_num_batched_tokens=(128, 512), max_num_seqs=(2, 16))
    loose = sweep(w, LinearLatency(), configs, SLO(ttft_p90=10.0, tpot_p90=1.0))
    assert len(loose) == 8
    # 300-token prompts cannot be prefilled whole within 128 tokens: infeasible, not silently dropped
    whole_128 = [p for p in loose if p.config.max_num_batched_tokens == 128 and not p.config.chunked_prefill]
    assert whole_128 and all(p.summary is None for p in whole_128)
    top = best(loose)
    assert top is not None and top.meets_slo
    assert top.summary.throughput_tokens == max(p.summary.throughput_tokens for p in loose if p.summary)
    # two sequences at a time cannot keep up: an SLO on TTFT rules those configs out
    strict = sweep(w, LinearLatency(), configs, SLO(ttft_p90=0.05))
    assert not any(p.meets_slo for p in strict if p.config.max_num_seqs == 2)
    assert best(sweep(w, LinearLatency(), configs, SLO(ttft_p90=1e-6))) is None

"""The serving simulator against analytic latency models: invariants and a hand-computed timeline."""

from __future__ import annotations

import numpy as np
import pytest

from dooly.core.batch import Batch
from dooly.core.errors import DoolyError
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


# -- KV-cache blocks sized from memory ------------------------------------------------------------------------

GIB = 2**30
# a generic decoder config (nothing here names an architecture but model_type, which transformers needs)
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": True}  # fmt: skip


def _zoo(name: str) -> dict:
    from dooly.core.zoo import load_config

    return load_config(name).config


def test_kv_bytes_per_token_gqa_matches_hand_formula():
    from dooly.simulator import MemoryModel

    # grouped-query attention: 8 KV heads serve 32 query heads; 32 layers, head dim 128, bf16
    llama = MemoryModel(_zoo("llama-3.1-8b"), 80, name="llama")
    assert (llama.layout.num_layers, llama.layout.num_kv_heads, llama.layout.head_dim) == (32, 8, 128)
    assert llama.layout.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    # no num_key_value_heads and no head_dim in the config: all heads, hidden / heads
    opt = MemoryModel(_zoo("opt-125m"), 1, name="opt")
    assert opt.layout.bytes_per_token == 2 * 12 * 12 * (768 // 12) * 2
    # an fp8 cache halves it; a float32 model doubles it
    assert MemoryModel(_zoo("llama-3.1-8b"), 80, kv_cache_dtype="fp8").layout.bytes_per_token == 65536
    assert MemoryModel(_zoo("llama-3.1-8b"), 80, dtype="float32").layout.bytes_per_token == 262144
    # windowed layers are counted as full but reported (gemma-2 alternates sliding and full layers)
    gemma = MemoryModel(_zoo("gemma-2-2b"), 24, name="gemma")
    assert gemma.layout.sliding_layers == 13 and gemma.layout.num_layers == 26
    assert "sliding-window layers counted as full" in gemma.plan().describe()


def test_parameter_count_from_config_matches_published():
    from dooly.simulator import MemoryModel

    # counted on the meta device; the zoo files carry the published parameter counts
    for name, billions in (("smollm2-135m", 0.135), ("qwen2.5-0.5b", 0.49)):
        assert MemoryModel(_zoo(name), 1).num_params / 1e9 == pytest.approx(billions, rel=0.02)


def test_num_blocks_is_what_memory_leaves():
    from dooly.simulator import MemoryModel

    m = MemoryModel(TINY, 0.01, gpu_memory_utilization=0.5, activation_gb=0.001, name="tiny")
    plan = m.plan(block_size=16)
    weights = m.num_params * 2
    expected = (int(0.01 * GIB * 0.5) - weights - int(0.001 * GIB)) // (256 * 16)
    assert m.layout.bytes_per_token == 2 * 2 * 2 * 16 * 2 == 256
    assert plan.num_blocks == expected and plan.weight_bytes == weights
    # a bigger token budget reserves more activation memory, so it leaves fewer blocks (estimated reserve)
    est = MemoryModel(TINY, 0.05, name="tiny")
    assert est.plan(16, max_num_batched_tokens=8192).num_blocks < est.plan(16, max_num_batched_tokens=512).num_blocks
    cfg = est.configure(SchedulerConfig(max_num_batched_tokens=512))
    assert cfg.num_kv_blocks == est.plan(16, 512, cfg.max_num_seqs).num_blocks


def test_model_that_does_not_fit_is_refused():
    from dooly.simulator import MemoryModel

    with pytest.raises(DoolyError, match=r"llama: model weights 14\.96 GiB exceed memory 7\.20 GiB"):
        MemoryModel(_zoo("llama-3.1-8b"), 8, name="llama").plan()
    # weights fit, but nothing is left once activations are reserved
    with pytest.raises(DoolyError, match="leave no KV-cache block"):
        MemoryModel(_zoo("smollm2-135m"), 1, activation_gb=0.65, name="smol").plan()
    with pytest.raises(DoolyError, match="gpu_memory_utilization"):
        MemoryModel(TINY, 1, gpu_memory_utilization=1.5)
    with pytest.raises(DoolyError, match="unknown dtype"):
        MemoryModel(TINY, 1, kv_cache_dtype="float99")


def test_fewer_blocks_from_less_memory_means_more_preemptions():
    from dooly.simulator import MemoryModel

    w = generate_workload(40, rate=1000.0, prompt="60-100", output="40-80", seed=2)
    params = MemoryModel(TINY, 1).num_params

    def run(blocks_wanted: int):
        # the device size that leaves `blocks_wanted` blocks of 16 tokens at 256 bytes per token
        gb = (params * 2 + blocks_wanted * 256 * 16 + 512) / 0.9 / GIB
        mem = MemoryModel(TINY, gb, activation_gb=0.0, num_params=params)
        cfg = mem.configure(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096))
        assert cfg.num_kv_blocks == blocks_wanted
        return simulate(w, LinearLatency(), cfg)

    small, mid, big = run(40), run(120), run(1000)
    assert small.summary.preemptions > mid.summary.preemptions > big.summary.preemptions == 0
    assert small.summary.e2e["mean"] > big.summary.e2e["mean"]


# -- routing across replicas ------------------------------------------------------------------------------


def skewed_workload(n: int = 80) -> Workload:
    # every other request is long: round-robin over 2 replicas sends all the long ones to replica 0
    arrival = np.arange(n) * 0.05
    output = np.where(np.arange(n) % 2 == 0, 120, 4)
    return wl(arrival, np.full(n, 64), output)


def test_round_robin_is_the_default_and_unchanged():
    w = generate_workload(30, rate=50.0, prompt="10-50", output="5-20", seed=1)
    default = simulate(w, LinearLatency(), SchedulerConfig(max_num_seqs=4), num_replicas=3)
    named = simulate(w, LinearLatency(), SchedulerConfig(max_num_seqs=4), num_replicas=3, router="round_robin")
    assert [r.replica for r in default.requests] == [i % 3 for i in range(30)]
    np.testing.assert_array_equal(default.metrics.e2e, named.metrics.e2e)
    assert default.replica_counts() == [10, 10, 10]


def test_least_outstanding_balances_a_skewed_workload():
    w = skewed_workload()
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512)
    rr = simulate(w, LinearLatency(), cfg, num_replicas=2, router="round_robin")
    lor = simulate(w, LinearLatency(), cfg, num_replicas=2, router="least_outstanding")

    def output_tokens_per_replica(res) -> list[int]:
        tokens = [0, 0]
        for r in res.requests:
            tokens[r.replica] += r.output_tokens
        return tokens

    rr_tokens, lor_tokens = output_tokens_per_replica(rr), output_tokens_per_replica(lor)
    assert rr_tokens[1] == 40 * 4  # round-robin: every short request on replica 1
    assert abs(lor_tokens[0] - lor_tokens[1]) < abs(rr_tokens[0] - rr_tokens[1]) / 2
    assert lor.summary.ttft["p99"] < rr.summary.ttft["p99"]
    assert lor.summary.e2e["mean"] < rr.summary.e2e["mean"]
    # routing only chooses the replica: every request is still served once
    assert sum(lor.replica_counts()) == len(w) and all(r.generated == r.output_tokens for r in lor.requests)


def test_random_router_is_reproducible_with_a_seed():
    w = generate_workload(60, rate=50.0, prompt="10-50", output="5-20", seed=1)
    cfg = SchedulerConfig(max_num_seqs=4)

    def routes(seed: int):
        res = simulate(w, LinearLatency(), cfg, num_replicas=3, router="random", router_seed=seed)
        return [r.replica for r in res.requests], res

    a, ra = routes(7)
    b, rb = routes(7)
    c, _ = routes(8)
    assert a == b and a != c
    np.testing.assert_array_equal(ra.metrics.e2e, rb.metrics.e2e)
    assert set(a) == {0, 1, 2} and a != [i % 3 for i in range(60)]


def test_unknown_router_and_replica_count_are_refused():
    w = wl([0.0], [4], [2])
    with pytest.raises(DoolyError, match="unknown router 'fastest'"):
        simulate(w, ConstantLatency(), router="fastest")
    with pytest.raises(DoolyError, match="num_replicas"):
        simulate(w, ConstantLatency(), num_replicas=0)


def test_sweep_derives_blocks_per_config_and_routes():
    from dooly.simulator import MemoryModel
    from dooly.simulator.search import SLO, config_grid, sweep

    w = generate_workload(30, rate=30.0, prompt="50-200", output="5-20", seed=3)
    mem = MemoryModel(TINY, 0.01, name="tiny")
    configs = config_grid(
        SchedulerConfig(), max_num_batched_tokens=(256, 2048), max_num_seqs=(8,), chunked_prefill=(True,)
    )
    points = sweep(w, LinearLatency(), configs, SLO(), num_replicas=2, memory=mem, router="least_outstanding")
    blocks = [p.config.num_kv_blocks for p in points]
    assert blocks == [mem.plan(16, 256, 8).num_blocks, mem.plan(16, 2048, 8).num_blocks] and blocks[0] > blocks[1]
    assert all(p.summary is not None for p in points)


# -- the CLI ----------------------------------------------------------------------------------------------


def test_cli_memory_and_router(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import dooly.api
    from dooly.cli.app import app

    monkeypatch.setattr(dooly.api, "load_latency_model", lambda model, db, *a: LinearLatency())
    workload = "poisson:n=30,rate=20,prompt=32-128,output=4-16"
    base = ["simulate", "smollm2-135m", "--db", str(tmp_path / "p.db"), "--workload", workload]

    def run(app, args):
        res = CliRunner().invoke(app, args)
        res.text = " ".join(res.output.split())  # rich wraps long lines at the runner's width
        return res

    res = run(app, [*base, "--memory-gb", "1", "--replicas", "2", "--router", "least_outstanding"])
    assert res.exit_code == 0, res.output
    from dooly.simulator import MemoryModel

    derived = MemoryModel(_zoo("smollm2-135m"), 1).plan(16, 2048, 32).num_blocks
    assert f"{derived} blocks per replica, derived from memory" in res.text
    assert "requests per replica:" in res.text and f"kv_blocks={derived}" in res.text
    res = run(app, [*base, "--memory-gb", "1", "--num-kv-blocks", "500"])
    assert res.exit_code == 0, res.output
    assert f"500 blocks per replica from --num-kv-blocks (memory would give {derived})" in res.text
    res = run(app, [*base, "--memory-gb", "1", "--sweep"])
    assert res.exit_code == 0, res.output
    assert "KV blocks" in res.output
    res = run(app, [*base, "--memory-gb", "0.2"])
    assert res.exit_code != 0 and "exceed memory" in str(res.exception)
    res = run(app, [*base, "--router", "fastest"])
    assert res.exit_code != 0 and "unknown router" in str(res.exception)


def test_scheduling_policies_by_name() -> None:
    from dooly.simulator import SCHEDULING_POLICIES, scheduling_policy

    assert SchedulerConfig(chunked_prefill=True).policy == "chunked" and SchedulerConfig().policy == "whole"
    assert set(SCHEDULING_POLICIES) == {"whole", "chunked"}
    with pytest.raises(DoolyError, match=r"^unknown scheduling policy 'fifo' \(known: whole, chunked\)$"):
        scheduling_policy("fifo")

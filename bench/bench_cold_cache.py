"""How to time a weight-reading op so it costs what it costs inside the model: one model's matmuls, three ways.

For every matmul shape of a smollm2-135m decode pass (3 requests: q, k, v, o, gate, up, down per layer, and the
LM head) it times one call three ways and sums them with the pass's multiplicities:

* ``hot``: a loop over the same weight (everything cached);
* ``evicted``: one call after :func:`dooly.profile.evict_caches` (every cache level cold, code too);
* ``profiler``: what the profiler does, ``time_calls`` over rotated copies of the weight (more bytes than the
  L3 in all, so each call reads its weight from memory while code and dispatcher stay warm);

and measures the same pass's matmuls inside a real forward (torch.profiler self time of ``aten::mm``). The rounds
are interleaved, so a slow minute of the machine shows in one round rather than in one method.

    .venv/bin/python bench/bench_cold_cache.py --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from dooly.core.zoo import resolve_model
from dooly.engines import get_engine
from dooly.engines.base import RequestShape
from dooly.profile import TimerConfig, evict_caches, time_calls


def one_call_after(prepare, call, n: int = 30) -> float:
    samples = []
    for i in range(n):
        prepare(i)
        t0 = time.thread_time()
        call(i)
        samples.append(time.thread_time() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = get_engine(dtype="bfloat16")
    _, cfg = resolve_model("smollm2-135m")
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    # (in, out, calls per pass): the decode pass's matmuls
    shapes = [
        (h, h, 2 * layers),
        (h, kv, 2 * layers),
        (h, inter, 2 * layers),
        (inter, h, layers),
        (h, cfg["vocab_size"], 1),
    ]
    bf = torch.bfloat16
    weights = {}
    for k, n, _ in shapes:
        copies = max(2, min(48, (96 * 2**20) // (k * n * 2)))  # as the profiler rotates: > 2x the L3 in all
        weights[(k, n)] = ([torch.randn(n, k, dtype=bf) for _ in range(copies)], torch.randn(3, k, dtype=bf))
    model = engine.build_model(cfg)
    base = engine.prepare(model, RequestShape.decode(3, 100))
    for _ in range(2):
        engine.forward(model, copy.deepcopy(base))

    print(
        f"matmuls of one smollm2-135m decode pass (3 requests, KV 100), ms per pass; {sum(c for *_, c in shapes)} calls"
    )
    print(f"{'round':>5s} {'hot':>8s} {'evicted':>8s} {'profiler':>8s} {'in model':>9s}")
    for r in range(args.rounds):
        tot = {"hot": 0.0, "evicted": 0.0, "profiler": 0.0}
        for k, n, count in shapes:
            ws, x = weights[(k, n)]

            def mm(i: int, ws: list[torch.Tensor] = ws, x: torch.Tensor = x) -> torch.Tensor:
                return torch.mm(x, ws[i % len(ws)].t())

            tot["hot"] += count * one_call_after(lambda i: None, lambda i: mm(0))
            tot["evicted"] += count * one_call_after(lambda i: evict_caches(), mm)
            timer = TimerConfig(warmup=1, repeats=30, budget_s=60.0)
            tot["profiler"] += count * time_calls(mm, "cpu", timer, clock="thread").median_s
        runs = 3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            for _ in range(runs):
                inputs = copy.deepcopy(base)
                evict_caches()
                engine.forward(model, inputs)
        in_model = next(e for e in p.key_averages() if e.key == "aten::mm").self_cpu_time_total / 1e6 / runs
        cols = " ".join(f"{tot[m] * 1e3:8.1f}" for m in ("hot", "evicted", "profiler"))
        print(f"{r + 1:5d} {cols} {in_model * 1e3:9.1f}", flush=True)


if __name__ == "__main__":
    main()

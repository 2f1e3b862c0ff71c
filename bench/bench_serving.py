"""Serving-simulator speed: simulated requests and iterations per second of wall time.

Prints figures (no assertions). With ``--db PATH --model NAME`` it also times the simulator driven by the
real profile-DB predictor (the cost a sweep pays per configuration).

    .venv/bin/python bench/bench_serving.py [--db profiles.db --model smollm2-135m]
"""

from __future__ import annotations

import argparse
import time

from dooly.core.batch import Batch
from dooly.simulator import SchedulerConfig, generate_workload, simulate


class Analytic:
    def iteration_latency(self, batch: Batch) -> float:
        attended = sum(n * (c + n) for n, c in batch.prefill) + sum(k + 1 for k in batch.decode)
        return 0.002 + 1e-4 * batch.num_tokens + 1e-8 * attended


def bench(latency, label: str, n: int) -> None:
    w = generate_workload(n, rate=20.0, prompt="32-1024", output="8-256", seed=0)
    for chunked in (False, True):
        cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, chunked_prefill=chunked, num_kv_blocks=2000)
        t = time.perf_counter()
        res = simulate(w, latency, cfg)
        dt = time.perf_counter() - t
        print(
            f"{label:10s} chunked={chunked!s:5s} {n} requests, {res.summary.iterations} iterations in {dt:.2f} s: "
            f"{n / dt:,.0f} req/s, {res.summary.iterations / dt:,.0f} iterations/s "
            f"(simulated {res.summary.duration:.0f} s of serving, {res.summary.preemptions} preemptions)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=2000)
    args = ap.parse_args()
    bench(Analytic(), "analytic", args.n)
    if args.db:
        from dooly.api import load_latency_model

        bench(load_latency_model(args.model, args.db), "predictor", args.n)


if __name__ == "__main__":
    main()

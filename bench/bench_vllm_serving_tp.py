"""Simulated vs real vLLM serving of a tensor-parallel replica: `dooly validate-serving --engine vllm --tp 2`.

A real `vllm serve --tensor-parallel-size 2` (CPU backend, dummy weights, a core per rank) serves a workload that
queues under vLLM's own load generator; dooly simulates it with the TP=2 rank's predictor, as `dooly simulate
--tp 2` does. The DB is profiled first where it lacks the model: the one-device profile with its calibration and
the rank's (`dooly profile --engine vllm --tp 2`, which calibrates the rank's framework overhead on the replica's
own forwards); a DB that holds them is only read. Figures only, no assertions; the load average is printed
before each step (run it on an otherwise idle machine of at least 2 cores):

    .venv/bin/python bench/bench_vllm_serving_tp.py [--db out/bench-vllm-tp/profiles.db] [--model qwen2.5-0.5b]

One run on the 2-vCPU EPYC (bf16, load 0.93 before; profiles 3.5 min one-device + 1 min the rank's; serving 84 s
with the server's 41 s start): percentile error (p50/p90/p99 averaged) TTFT 12.9%, TPOT 11.9%, ITL 13.5%, E2E
14.8%, the two real runs 9.5 / 4.0 / 6.2 / 7.9% apart; iteration 15.7% (runs apart 7.6%), every one simulated
faster than served. The front end has no core of its own there (both cores are the ranks'). That run's rank took
the one-device overhead; with the replica calibrated (bde9995; load 0.80 before, serving 76 s): TTFT 5.7%, TPOT
8.6%, ITL 9.4%, E2E 5.8%, the real runs 7.5 / 9.1 / 10.0 / 5.7% apart; iteration 7.7% (runs apart 12.0%).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

MODEL = "qwen2.5-0.5b"  # 14 heads, 2 KV heads: both divide by 2
WORKLOAD = "static:n=8,prompt=24-160,output=6-12,seed=1"


def _step(title: str, cmd: list[str]) -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"== {title} (load average {load}): {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"== {title}: {time.perf_counter() - t0:.0f} s wall", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", type=Path, default=Path("out/bench-vllm-tp/profiles.db"))
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--workload", default=WORKLOAD)
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=128)
    ap.add_argument("--real-runs", type=int, default=2)
    ap.add_argument("--no-profile", action="store_true", help="the DB holds the profiles already: serve only")
    args = ap.parse_args()

    dooly = [sys.executable, "-m", "dooly"]
    args.db.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_profile:  # each resumes: a DB that holds the model times nothing again
        _step("one-device profile", [*dooly, "profile", args.model, "--db", str(args.db), "--engine", "vllm"])
        rank = ["--engine", "vllm", "--tp", str(args.tp)]
        _step(f"TP={args.tp} rank profile", [*dooly, "profile", args.model, "--db", str(args.db), *rank])
    serve = [*dooly, "validate-serving", args.model, "--db", str(args.db), "--engine", "vllm", "--tp", str(args.tp)]
    serve += ["--workload", args.workload, "--max-num-seqs", str(args.max_num_seqs)]
    serve += ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--real-runs", str(args.real_runs)]
    _step(f"TP={args.tp} serving", serve)


if __name__ == "__main__":
    main()

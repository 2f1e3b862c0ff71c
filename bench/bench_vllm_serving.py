"""Simulated vs real vLLM serving: TTFT / TPOT / iteration-latency MAPE, run-to-run spread beside each.

For each model, a real `vllm serve` (CPU backend, dummy weights, one OpenMP thread) serves a workload that
queues (more requests in flight than ``--max-num-seqs``) twice under vLLM's own load generator; dooly
simulates the same requests with vLLM v1's scheduler and the profile DB's predictor. Figures only, no
assertions. The DB is profiled first (``dooly profile --engine vllm``) when it does not exist; the ops are
vLLM's own profiles only where the DB has them (printed as "ops profiled with").

    .venv/bin/python bench/bench_vllm_serving.py [--db out/bench-vllm/profiles.db] [--models a b] [--unprofiled CONFIG]

``--unprofiled`` models (default: a 40-layer smollm2-135m, bench/configs/serving/) are never profiled: every
signature they need is already in the DB, so they show reuse end to end against the real server.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MODELS = ("smollm2-135m", "smollm2-360m")
#: never profiled, every signature in the DB: smollm2-135m's layers, 40 of them instead of 30
UNPROFILED = (str(Path(__file__).parent / "configs" / "serving" / "smollm2-135m-deep40.json"),)
WORKLOAD = "poisson:n=24,rate=3,prompt=32-256,output=16-48,seed=0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", type=Path, default=Path("out/bench-vllm/profiles.db"))
    ap.add_argument("--models", nargs="*", default=list(MODELS), help="profiled into the DB when it does not exist")
    ap.add_argument("--unprofiled", nargs="*", default=list(UNPROFILED), help="never profiled, also simulated")
    ap.add_argument("--workload", default=WORKLOAD)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--real-runs", type=int, default=2)
    ap.add_argument("--warmup-runs", type=int, default=1, help="served first on each server, not scored")
    ap.add_argument("--no-pin-frontend", action="store_true",
                    help="let the API server and load generator share the engine's core (default: the other cores)")
    ap.add_argument("--dtype", help="engine dtype (default: bfloat16 where the CPU has AVX-512 BF16 or AMX, "
                    "else float32)")
    ap.add_argument("--json", type=Path, help="also write every validation (per-request figures) here")
    args = ap.parse_args()

    from dooly.serve.vllm_serving import ServeConfig, cpu_serving_dtype, validate, vllm_available

    why = vllm_available()
    if why:
        print(f"skipped: {why}")
        return
    from dooly.api import serving_latency_model, vllm_cpu_kv_blocks
    from dooly.simulator import CachedLatency, parse_workload

    dtype = args.dtype or cpu_serving_dtype()
    if not args.db.exists():
        args.db.parent.mkdir(parents=True, exist_ok=True)
        print(f"profiling {' '.join(args.models)} into {args.db} (vLLM engine) ...", flush=True)
        cmd = [sys.executable, "-m", "dooly", "profile", *args.models, "--db", str(args.db), "--engine", "vllm",
               "--dtype", dtype, "--threads", "1"]
        subprocess.run(cmd, check=True)
    w = parse_workload(args.workload)
    print(f"workload {args.workload}; max_num_seqs={args.max_num_seqs} "
          f"max_num_batched_tokens={args.max_num_batched_tokens}, block 128, 1 GiB KV, 1 thread, {dtype}; "
          f"{args.warmup_runs} warm-up + {args.real_runs} scored runs per server, front end "
          f"{'on the engine core too' if args.no_pin_frontend else 'on the other cores'}")  # fmt: skip
    print(f"{'model':20s} {'ops from':9s} {'TTFT MAPE':>10s} {'(runs)':>8s} {'TPOT MAPE':>10s} {'(runs)':>8s} "
          f"{'iter MAPE':>10s} {'(runs)':>8s} {'TTFT dist':>10s} {'(runs)':>8s} {'TPOT dist':>10s} {'(runs)':>8s} "
          f"{'TTFT p50 meas/sim ms':>22s} {'wall s':>7s} admitted: out of order, TTFT / TPOT / iter MAPE")  # fmt: skip
    payloads = []
    for model in [*args.models, *args.unprofiled]:
        t0 = time.perf_counter()
        pred, profiled_with = serving_latency_model(model, args.db, dtype, 1, "vllm")
        cfg = ServeConfig(args.max_num_seqs, args.max_num_batched_tokens, dtype=dtype, max_model_len=512,
                          pin_frontend=not args.no_pin_frontend)
        blocks = vllm_cpu_kv_blocks(model, cfg.kvcache_space_gb, cfg.block_size, cfg.dtype)
        p = validate(model, w, cfg, blocks, CachedLatency(pred), args.real_runs, log=lambda m: None,
                     warmup_runs=args.warmup_runs)
        rows = {r["metric"]: r for r in p["table"]}
        noise = p["run_to_run_pct"]
        print(
            f"{Path(model).stem:20s} {profiled_with:9s} {rows['TTFT']['mape_pct']:9.1f}% {noise['ttft']:7.1f}% "
            f"{rows['TPOT']['mape_pct']:9.1f}% {noise['tpot']:7.1f}% {p['iteration_mape']:9.1f}% {noise['itl']:7.1f}% "
            f"{rows['TTFT']['quantile_err_pct']:9.1f}% {noise['ttft_quantiles']:7.1f}% "
            f"{rows['TPOT']['quantile_err_pct']:9.1f}% {noise['tpot_quantiles']:7.1f}% "
            f"{rows['TTFT']['measured_p50'] * 1e3:10.0f}/{rows['TTFT']['simulated_p50'] * 1e3:<11.0f} "
            f"{time.perf_counter() - t0:7.0f} {_admitted(p.get('admission_order'))}",
            flush=True,
        )
        payloads.append(p)
    print("MAPE: per request; dist: the distribution's error at p10/p25/p50/p75/p90, averaged. (runs): spread "
          "between the real runs, (max-min)/mean per request (dist: per quantile) averaged; iteration latency is "
          "each request's median inter-token latency (vLLM reports no iteration timings). admitted: the "
          "requests each run's front end handed to the engine out of arrival order, and the TTFT / TPOT / "
          "iteration MAPE of the simulation in that order (from the server's log)")  # fmt: skip
    _print_percentiles(payloads, [*args.models, *args.unprofiled])
    if args.json:
        args.json.write_text(json.dumps(payloads, default=lambda a: np.asarray(a).tolist(), indent=1))


def _print_percentiles(payloads: list[dict], models: list[str]) -> None:
    """The headline figures: p50/p90/p99 errors as `vllm bench serve` reports them, the runs' spread beside each."""
    print("percentile error, p50/p90/p99 averaged (runs apart at the same percentiles):")
    for model, p in zip(models, payloads, strict=True):
        pct = p["percentiles"].items()
        cells = [f"{m.upper()} {s['mean_error_pct']:.1f}% ({s['mean_spread_pct']:.1f}%)" for m, s in pct]
        print(f"  {Path(model).stem:20s} " + "  ".join(cells))


def _admitted(adm: dict | None) -> str:
    if not adm:
        return "-"
    return (f"{'/'.join(map(str, adm['requests_out_of_order']))}: {adm['ttft_mape']:.1f}% / {adm['tpot_mape']:.1f}% / "
            f"{adm['iteration_mape']:.1f}%")  # fmt: skip


if __name__ == "__main__":
    main()

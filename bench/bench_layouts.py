"""Which device layout should serve a 70B model on 8 devices? `dooly simulate --sweep-layouts`, timed.

1. Profiles (resumable, into ``--db``) two small llamas (bench/configs/llama-768.json, llama-512-128k.json) with
   vLLM: one device (calibrated: the framework overhead every rank borrows), rank 0 of TP=2 (its all-reduces and
   all-gathers timed between two processes, the only group size two cores can run) and both stages of PP=2 (the
   send and receive of the hidden states). Nothing of the 70B itself is measured: its ranks are priced from the
   shape model, and its collectives among 4 and 8 ranks by the ring model over the group-size-2 points (an
   extrapolation).
2. Traces every stage rank of every layout of the 70B into the DB's trace cache (once; timed apart).
3. Times the sweep itself (what a user reruns) and prints the table and the layout to pick.

    .venv/bin/python bench/bench_layouts.py --db /tmp/dooly_layouts.db       # resumable; rerun to time again
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dooly.api import ProfileHooks, ServeHooks, profile_models, warm_traces
from dooly.core.zoo import load_config
from dooly.layout_sweep import sweep_layouts
from dooly.simulator.layouts import enumerate_layouts, vllm_refusal

CONFIGS = Path(__file__).parent / "configs"
# a llama of 768 (GQA) and one with Llama 3's vocabulary of 128256 and rope (logits, argmax and rotary cache at the
# 70B's sizes)
SMALL = [str(CONFIGS / "llama-768.json"), str(CONFIGS / "llama-512-128k.json")]
# one wide layer (hidden 6144) on the tiny grid: weights far past the caches, streamed as a decode streams a 70B
# rank's; no shape of it is the 70B's, so it informs the shape model only (a tiny grid would extrapolate badly)
WIDE = str(CONFIGS / "llama-6144-wide.json")
# priced on this CPU (a 70B decode step takes most of a second here, a 1k-token prefill tens of seconds): a light load
WORKLOAD = "poisson:n=100,rate=0.1,prompt=128-1024,output=16-128,seed=0"


def _profile(db: Path, grid: str) -> float:
    """The small llamas' profiles: one device, TP=2, and each stage of PP=2, and one wide layer on the tiny grid;
    returns the wall seconds."""
    t0 = time.perf_counter()
    quiet = ProfileHooks(log=lambda *_: None, report=lambda *_: None)
    runs = [{}, {"tp": 2, "calibration": "none"}]
    runs += [{"pp": 2, "pp_stage": s, "calibration": "none"} for s in (0, 1)]
    for kw in runs:
        print(f"profiling {len(SMALL)} small llamas, {kw or 'one device'}", flush=True)
        profile_models(SMALL, db, engine="vllm", grid=grid, hooks=quiet, **kw)
    print("profiling one wide layer (tiny grid)", flush=True)
    profile_models([WIDE], db, engine="vllm", grid="tiny", calibration="none", hooks=quiet)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default="/tmp/dooly_layouts.db")
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--memory-gb", type=float, default=80.0, help="Memory per device (an H100's 80 GB).")
    ap.add_argument("--workload", default=WORKLOAD)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--slo-ttft", type=float, default=30.0, help="p90 TTFT, seconds (of this CPU's time).")
    ap.add_argument("--slo-tpot", type=float, default=1.5, help="p90 TPOT, seconds.")
    ap.add_argument("--grid", default="default", help="Profiling grid of the small llama (default or tiny).")
    args = ap.parse_args()
    db = Path(args.db)

    prof_s = _profile(db, args.grid)
    print(f"profiles: {prof_s:.1f} s wall (a rerun finds them in the DB)")

    cfg = load_config(args.model).config
    t0 = time.perf_counter()
    for lay in enumerate_layouts(args.devices):
        if not vllm_refusal(cfg, lay.tp, lay.pp):
            warm_traces(args.model, db, "vllm", "bfloat16", lay.tp, lay.pp)
    print(f"tracing every stage rank of the {args.model} layouts: {time.perf_counter() - t0:.1f} s (cached in the DB)")

    t0 = time.perf_counter()
    sweep = sweep_layouts(
        args.model,
        db,
        devices=args.devices,
        workload=args.workload,
        max_seqs=args.max_num_seqs,
        max_tokens=args.max_num_batched_tokens,
        memory_gb=args.memory_gb,
        slo_ttft=args.slo_ttft,
        slo_tpot=args.slo_tpot,
        hooks=ServeHooks(),
    )
    wall = time.perf_counter() - t0
    from dooly.cli.serve import print_layouts

    print_layouts(sweep)
    print(f"sweep of {len(sweep.points)} layouts of {args.devices} devices: {wall:.1f} s wall")


if __name__ == "__main__":
    main()

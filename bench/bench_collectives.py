"""What a tensor-parallel rank's collectives cost on this CPU: all-reduce, all-gather and a pipeline stage's send,
between two processes pinned one per core, through vLLM's CPU communicator (as ``dooly profile --tp 2`` times
them), over the tokens of a prefill at a model's hidden size. Each size is timed ``--rounds`` times, interleaved,
and the table shows the median with half the rounds' range beside it.

    .venv/bin/python bench/bench_collectives.py --hidden 896 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics

from dooly.profile import TimerConfig
from dooly.profile.collectives import CollectiveCall, CollectiveTimer

KINDS = ("all_reduce", "all_gather", "send")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=896, help="Row size (qwen2.5-0.5b's hidden size by default).")
    ap.add_argument("--tokens", default="1,4,16,64,256,1024", help="Rows per message, comma-separated.")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    calls = [CollectiveCall(k, (t, args.hidden), args.dtype, 0, 2) for t in tokens for k in KINDS]
    runs: list[list[float]] = [[] for _ in calls]
    with CollectiveTimer() as timer:
        print(f"backend: {timer.backend(2)}; 2 ranks, one per core; {args.dtype}, rows of {args.hidden}")
        for _ in range(args.rounds):
            for i, m in enumerate(timer.time(calls, TimerConfig())):
                if isinstance(m, str):
                    raise SystemExit(f"{calls[i]}: {m}")
                runs[i].append(m.median_s)
    print(f"{'tokens':>7} {'KiB':>8} " + " ".join(f"{k + ' us':>18}" for k in KINDS))
    for t in tokens:
        cells = []
        for k in KINDS:
            xs = runs[calls.index(CollectiveCall(k, (t, args.hidden), args.dtype, 0, 2))]
            cells.append(f"{1e6 * statistics.median(xs):9.1f} ±{1e6 * (max(xs) - min(xs)) / 2:6.1f}")
        kib = t * args.hidden * (2 if args.dtype in ("bfloat16", "float16") else 4) / 1024
        print(f"{t:>7} {kib:>8.1f} " + " ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()

"""How many chains a saved token model should sample in parallel, chosen on the data it was trained on.

A token model's long trace is a few chains of overlapping windows; a chain drifts the longer it runs, so more
(shorter) chains can be closer to real. For each chain count, the model samples `--events` events per trace
it learned (unguided, or with `--guide kernel` as the shipped model samples by default) and this prints the
3-gram JSD of event types to that trace's *training* block (never the held-out one: this is how the shipped
`models/all` got its `config.chains`), and the mean over traces. With `--seeds 0 1 2` each figure is the mean
over those sampling seeds (one seed's sample can sit far from another's). Beside each, `(real ...)`: the training
block cut into as many pieces of `--events / chains` events from random places (one draw per seed), joined, and
scored the same way: a trace's phases are long, so a few pieces sample them unevenly, and a faithful model sampled
in that many chains would score about that, not 0 (an order-4 Markov chain, one chain that forgets all but four
events, is held in no phase and can sit lower).

    .venv/bin/python bench/bench_chains.py models/all --chains 8 16 32 --seeds 0 1 2
    .venv/bin/python bench/bench_chains.py models/all --chains 32 48 64 79 --seeds 0 1 2 --guide kernel

At `--events` 20000 and a context of 256, 79 chains is the most there can be: a chain is at least one window.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from tracesynth.evaluate.metrics import ngram_jsd, pieces_ngram_jsd  # noqa: E402
from tracesynth.generators import load_generator  # noqa: E402
from tracesynth.io import read_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, nargs="?", default=REPO / "models" / "all",
                    help="a conditional token model written by scripts/train_models.py (default: models/all)")
    ap.add_argument("--chains", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="sampling seeds (each figure: their mean)")
    ap.add_argument("--guide", choices=["none", "kernel"], default="none", help="sample unguided or kernel-guided")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_generator(args.model)
    training = (getattr(model, "history", {}) or {}).get("training")
    if not training:
        sys.exit(f"{args.model}: no training record (history.training): not written by scripts/train_models.py")
    jsd: dict[int, list[float]] = {c: [] for c in args.chains}
    floor: dict[int, list[float]] = {c: [] for c in args.chains}  # real data cut into as many pieces
    for d in training["data"]:
        train = read_trace(REPO / "data" / d["file"]).slice(0, int(d["train_events"]))
        for c in args.chains:
            model.config.chains = c
            per_seed = [ngram_jsd(train, model.sample(args.events, seed=s, workload=d["workload"], guide=args.guide), 3)
                        for s in args.seeds]  # fmt: skip
            jsd[c].append(float(np.mean(per_seed)))
            pieces = model.chains_for(args.events)  # as many as sample() drew
            rngs = [np.random.default_rng(s) for s in args.seeds]
            per_draw = [pieces_ngram_jsd(train, pieces, args.events // pieces, 3, r) for r in rngs]
            floor[c].append(float(np.mean(per_draw)))
        cells = [f"{c} chains {jsd[c][-1]:.3f} (real {floor[c][-1]:.3f})" for c in args.chains]
        print(f"{d['workload']:10s} " + "  ".join(cells), flush=True)
    means = [f"{c} chains {np.mean(jsd[c]):.3f} (real {np.mean(floor[c]):.3f})" for c in args.chains]
    print("mean       " + "  ".join(means))


if __name__ == "__main__":
    main()

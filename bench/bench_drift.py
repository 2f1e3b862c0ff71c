"""How far a saved autoregressive model drifts from real as it runs on: its events, pooled over many short
continuations of real traces, scored segment by segment against the training block.

For each trace the model learned (its `history.training`, as `bench_chains.py`), `--chains` chains each start
from `--prime` real events at a random place of the training block (none: a cold start, as `sample` does), with
the kernel guide's state replayed over them, and draw the rest of one window (`context - prime` events). Per
segment of `--segment` events after the prime, this prints the 3-gram JSD (bits) of event types of the drawn
events, pooled over the chains (3-grams inside a chain only), to the whole training block, beside the same
figure for the events that really followed those primes (the floor: real segments of that size and number). A
network that predicts the next event well but drifts as it feeds on its own draws shows a gap that grows segment
by segment; `sample` concatenates chains of about `events / chains` events, so that growth is what more chains
trade against more chain starts (`bench_chains.py`).

    .venv/bin/python bench/bench_drift.py models/all --workloads scimark2 stream fio
    .venv/bin/python bench/bench_drift.py --prime 0 --shares 5   # and which event types the drift moves
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from tracesynth.evaluate.metrics import counts_jsd, ngram_counts  # noqa: E402
from tracesynth.generators import load_generator  # noqa: E402
from tracesynth.generators.ar import Autoregressive  # noqa: E402
from tracesynth.generators.guide import KernelGuide  # noqa: E402
from tracesynth.generators.tokens import CHANNELS  # noqa: E402
from tracesynth.io import read_trace  # noqa: E402


def trigrams(rows: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray]:
    """Event 3-gram keys and counts, pooled over rows (no 3-gram crosses from one row to the next)."""
    parts = [ngram_counts(np.asarray(r, np.int64), 3, base) for r in rows]
    keys, inv = np.unique(np.concatenate([k for k, _ in parts]), return_inverse=True)
    return keys, np.bincount(inv, weights=np.concatenate([c for _, c in parts]))


@torch.no_grad()
def continue_primes(
    model: Autoregressive, enc: dict, starts: np.ndarray, prime: int, workload: int, guide: str, seed: int
) -> np.ndarray:
    """Event tokens [chains, context - prime] drawn after the real events enc[starts : starts + prime]."""
    L, b = model.config.context, len(starts)
    idx = starts[:, None] + np.arange(prime)
    tokens = {c: torch.zeros(b, L, dtype=torch.long) for c in CHANNELS}
    for c in CHANNELS:
        real = model.codec.relabel_tids(enc[c][idx]) if c == "tid" else enc[c][idx]
        tokens[c][:, :prime] = torch.from_numpy(real)
    tokens["workload"] = torch.full((b,), workload, dtype=torch.long)
    known = torch.zeros(b, L, dtype=torch.bool)
    known[:, :prime] = True
    kernel = None
    if guide == "kernel":
        kernel = KernelGuide(model.codec, model.kernel, b, L)
        kernel.start_window(None, None)
        kernel.replay(tokens, prime)  # the kernel state the real prefix leaves: who runs where, which calls are open
    model._fill(tokens, known, torch.Generator().manual_seed(seed), kernel)
    return tokens["event"][:, prime:].numpy()


def print_shares(
    names: list[str], whole: np.ndarray, drawn: np.ndarray, real: np.ndarray, segment: int, k: int
) -> None:
    """The k event types whose share of the drawn events moves most from the first segment to the last: their
    share in the training block, in the drawn first and last segments, and in the real last segment."""
    last = slice((drawn.shape[1] // segment - 1) * segment, drawn.shape[1] // segment * segment)

    def share(x: np.ndarray) -> np.ndarray:
        return np.bincount(x.ravel(), minlength=len(names)) / max(x.size, 1)

    first_d, last_d, last_r, train = (
        share(drawn[:, :segment]),
        share(drawn[:, last]),
        share(real[:, last]),
        share(whole),
    )
    for i in np.argsort(-np.abs(last_d - first_d))[:k]:
        print(
            f"{'':15s}{names[i]:34s} training {train[i]:6.2%}  drawn first {first_d[i]:6.2%} last {last_d[i]:6.2%}"
            f"  real last {last_r[i]:6.2%}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "model",
        type=Path,
        nargs="?",
        default=REPO / "models" / "all",
        help="a conditional autoregressive model written by scripts/train_models.py (default: models/all)",
    )
    ap.add_argument("--workloads", nargs="+", default=None, help="the traces it learned to score (default: all)")
    ap.add_argument("--chains", type=int, default=300, help="continuations pooled per segment")
    ap.add_argument("--prime", type=int, nargs="+", default=[0, 64], help="real events before each continuation")
    ap.add_argument("--segment", type=int, default=64, help="events per scored segment")
    ap.add_argument("--guide", choices=["kernel", "none"], default="kernel")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--shares",
        type=int,
        default=0,
        metavar="K",
        help="also the K event types whose share moves most from the first segment to the last",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_generator(args.model)
    training = (getattr(model, "history", {}) or {}).get("training")
    if not isinstance(model, Autoregressive) or not training:
        sys.exit(f"{args.model}: not an autoregressive model written by scripts/train_models.py")
    L = model.config.context
    if not all(0 <= p <= L - args.segment for p in args.prime):
        sys.exit(f"--prime must leave at least one segment of {args.segment} events in the context of {L}")
    print(
        f"{args.model}: {args.chains} chains per row, guide {args.guide}; 3-gram JSD (bits) to the training "
        f"block per segment of {args.segment} drawn events, model / the real events that followed the same primes"
    )
    for d in training["data"]:
        if args.workloads and d["workload"] not in args.workloads:
            continue
        train = read_trace(REPO / "data" / d["file"]).slice(0, int(d["train_events"]))
        enc = model._tokens(train)
        V = model.vocab["event"]
        whole = trigrams([enc["event"]], V)
        rng = np.random.default_rng(args.seed)
        for prime in args.prime:
            starts = rng.integers(0, len(train) - L, args.chains)
            drawn = continue_primes(
                model, enc, starts, prime, model.workloads.index(d["workload"]), args.guide, args.seed
            )
            real = enc["event"][starts[:, None] + np.arange(prime, L)]
            cells = []
            for a in range(0, L - prime - args.segment + 1, args.segment):
                seg = slice(a, a + args.segment)
                cells.append(
                    f"{a:3d}+: {counts_jsd(trigrams(drawn[:, seg], V), whole):.3f} / "
                    f"{counts_jsd(trigrams(real[:, seg], V), whole):.3f}"
                )
            print(f"{d['workload']:9s} prime {prime:3d}  " + "  ".join(cells), flush=True)
            if args.shares:
                print_shares(model.codec.token_names("event"), enc["event"], drawn, real, args.segment, args.shares)


if __name__ == "__main__":
    main()

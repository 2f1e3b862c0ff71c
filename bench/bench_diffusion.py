"""Diffusion generator benchmark: throughput, long context, sampler quality, and the done-when check.

Figures, printed side by side (and written to --out as JSON):

1. throughput: training and sampling events/s for L=256/1024/4096, 2- vs 6-channel (with the
   2ch/6ch compute ratio), ancestral-1000 vs strided DDIM. Sampling cost is one denoiser pass per
   step, so sampler events/s = windows * L / (steps * measured seconds per pass).
2. patching: what packing P events into one transformer token costs in quality at L=256 and 1024,
   where the plain (P=1) design still fits: same training time, event-type and bigram JSD.
3. done-when: a 6-channel L=1024 model trained for a few minutes on scimark2 samples 100k events;
   event-type JSD to the real test block (< 0.05 passes); every sampled window decodes into a
   valid Trace; the fast sampler vs ancestral on the same model (event-type and bigram JSD).

JSD is the Jensen-Shannon divergence in bits (0 = identical, 1 = disjoint). Real data is split by
time into train / validation / test blocks (0.8 / 0.1 / 0.1); the model sees only the first 0.9.

    .venv/bin/python bench/bench_diffusion.py            # full: about 30 minutes on 2 shared cores
    .venv/bin/python bench/bench_diffusion.py --quick    # about 9 minutes, smaller budgets
    .venv/bin/python bench/bench_diffusion.py --only done --train-seconds 240   # just the done-when check

Training runs are time-limited, so on a busier machine they take fewer steps (and score a little
worse); the steps actually taken are printed beside every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from tracesynth import divergence  # noqa: E402
from tracesynth.channels import ChannelCodec  # noqa: E402
from tracesynth.generators.diffusion import GaussianDiffusion, GaussianDiffusionConfig  # noqa: E402
from tracesynth.generators.diffusion.model import TraceDenoiser  # noqa: E402
from tracesynth.generators.diffusion.schedule import NoiseSchedule  # noqa: E402
from tracesynth.generators.diffusion.train import DiffusionLoss  # noqa: E402
from tracesynth.splits import split_by_time  # noqa: E402
from tracesynth.trace import Trace  # noqa: E402


# -- quality ----------------------------------------------------------------------------------
def jsd(p: Counter, q: Counter) -> float:
    """Jensen-Shannon divergence (bits) between two count tables."""
    keys = sorted(set(p) | set(q))
    return divergence.jsd(np.array([p.get(k, 0) for k in keys]), np.array([q.get(k, 0) for k in keys]))


def event_counts(t: Trace) -> Counter:
    return Counter(t.event_counts())


def bigram_counts(t: Trace) -> Counter:
    codes, vocab = t.codes("event")
    if len(codes) < 2:
        return Counter()
    pairs = codes[:-1].astype(np.int64) * len(vocab) + codes[1:]
    u, c = np.unique(pairs, return_counts=True)
    return Counter({(vocab[k // len(vocab)], vocab[k % len(vocab)]): int(n) for k, n in zip(u, c, strict=True)})


def quality(sample: Trace, real: Trace) -> dict[str, float]:
    return {
        "event_jsd": jsd(event_counts(sample), event_counts(real)),
        "bigram_jsd": jsd(bigram_counts(sample), bigram_counts(real)),
    }


def check_valid(synth: GaussianDiffusion, sample: Trace) -> int:
    """Every window of the sample decodes into a valid Trace on its own; returns windows checked."""
    L = synth.config.context
    n = 0
    for a in range(0, len(sample), L):
        part = Trace(sample.slice(a, a + L).table, sample.metadata)  # validates: ts sorted, no nulls
        assert set(part.event_counts()) <= set(synth.codec.events), "unknown event name"
        n += 1
    sample.validate()
    return n


# -- throughput -------------------------------------------------------------------------------
def train_rate(cfg: GaussianDiffusionConfig, vocab: dict[str, int], steps: int) -> float:
    """Training events/s of one configuration on random tokens (cost does not depend on values)."""
    torch.manual_seed(0)
    model = TraceDenoiser(cfg, vocab)
    loss_mod = DiffusionLoss(model, NoiseSchedule(cfg.timesteps), cfg.aux_weight, cfg.prediction)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B, L = cfg.batch_size, cfg.context
    batch = {c: torch.randint(0, vocab[c], (B, L)) for c in model.discrete}
    batch["dt"] = torch.randn(B, L)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        t = torch.randint(0, cfg.timesteps, (B,))
        loss, _ = loss_mod(batch, t, torch.randn(B, L, model.latent))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i:  # the first step pays one-off costs
            times.append(time.perf_counter() - t0)
    return B * L / float(np.median(times))


@torch.no_grad()
def pass_seconds(cfg: GaussianDiffusionConfig, vocab: dict[str, int], windows: int, reps: int) -> float:
    """Seconds of one denoiser pass over `windows` windows (one sampler step)."""
    torch.manual_seed(0)
    model = TraceDenoiser(cfg, vocab).eval()
    x = torch.randn(windows, cfg.context, model.latent)
    t = torch.full((windows,), 500)
    model.soft_snap(model(x, t))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.soft_snap(model(x, t))  # a sampler step: denoiser pass plus the clamp to token embeddings
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_throughput(codec6: ChannelCodec, quick: bool) -> list[dict]:
    rows = []
    for L in (256, 1024, 4096):
        for ch in (2, 6):
            cfg = GaussianDiffusionConfig(context=L, channels=ch, batch_size=max(1, 8192 // L))
            vocab = {c: v for c, v in codec6.vocab_sizes.items() if c in cfg.channel_names}
            tr = train_rate(cfg, vocab, 2 if quick else 4)
            w = max(1, 8192 // L)
            sec = pass_seconds(cfg, vocab, w, 2 if quick else 4)
            row = {
                "L": L,
                "channels": ch,
                "patch": cfg.patch_size,
                "tokens": L // cfg.patch_size,
                "train_ev_s": tr,
                "ddim50_ev_s": w * L / (50 * sec),
                "ancestral1000_ev_s": w * L / (1000 * sec),
            }
            rows.append(row)
            print(
                f"  L={L:5d} ch={ch} P={row['patch']:2d} tokens={row['tokens']:4d}  train {tr:9,.0f} ev/s   "
                f"sample ddim-50 {row['ddim50_ev_s']:8,.0f} ev/s   "
                f"ancestral-1000 {row['ancestral1000_ev_s']:7,.1f} ev/s",
                flush=True,
            )
    print("  2ch/6ch compute ratio (6ch events/s over 2ch events/s; 1.0 = same cost, 0.5 = 2ch costs half):")
    for L in (256, 1024, 4096):
        r2 = next(r for r in rows if r["L"] == L and r["channels"] == 2)
        r6 = next(r for r in rows if r["L"] == L and r["channels"] == 6)
        print(
            f"    L={L:5d}  train {r6['train_ev_s'] / r2['train_ev_s']:.2f}   "
            f"sample {r6['ddim50_ev_s'] / r2['ddim50_ev_s']:.2f}",
            flush=True,
        )
    return rows


# -- training runs ----------------------------------------------------------------------------
def fit_for(train: Trace, seconds: float, **kw) -> GaussianDiffusion:
    cfg = GaussianDiffusionConfig(steps=100_000, time_limit=seconds, checkpoint_every=100_000, **kw)
    t0 = time.perf_counter()
    synth = GaussianDiffusion(cfg).fit([train])
    h = synth.history
    print(
        f"    trained {h['steps']} steps, fit in {time.perf_counter() - t0:.0f} s with calibration "
        f"({h['train_events_per_s']:,.0f} events/s), loss {h['loss']:.3f}, val {h['val_loss']:.3f}; "
        + (
            f"soft-clamp temperature {synth.config.clamp_temperature} (calibrated on the validation block)"
            if synth.config.clamp == "soft"
            else f"{synth.config.clamp} clamp"
        ),
        flush=True,
    )
    return synth


def bench_patching(train: Trace, test: Trace, seconds: float, n_events: int) -> list[dict]:
    """Equal training time per variant: plain (P=1) vs patched (P=4) at L=256 and 1024, and the
    network's parametrisation (x0 with soft clamping, the default, vs noise prediction with hard)."""
    variants = [
        ("L=256  P=1 (plain)", {"context": 256, "patch": 1}),
        ("L=256  P=4", {"context": 256, "patch": 4}),
        ("L=1024 P=1 (plain)", {"context": 1024, "patch": 1}),
        ("L=1024 P=4 (default)", {"context": 1024, "patch": 4}),
        ("L=1024 P=4 eps-prediction, hard clamp", {"context": 1024, "patch": 4, "prediction": "eps", "clamp": "hard"}),
    ]
    rows = []
    for label, kw in variants:
        print(f"  {label}: train {seconds:.0f} s", flush=True)
        synth = fit_for(train, seconds, batch_size=max(2, 8192 // kw["context"]), **kw)
        t0 = time.perf_counter()
        s = synth.sample(n_events, seed=0)
        q = quality(s, test)
        rows.append({"variant": label, **kw, "steps": synth.history["steps"], **q})
        print(
            f"    sample {n_events:,} (ddim-50) in {time.perf_counter() - t0:.0f} s: "
            f"event JSD {q['event_jsd']:.4f}  bigram JSD {q['bigram_jsd']:.4f}",
            flush=True,
        )
    return rows


def bench_done_when(train: Trace, test: Trace, seconds: float, n_events: int, n_anc: int, out: Path) -> dict:
    print(f"  L=1024, 6 channels, patch 4: train {seconds:.0f} s", flush=True)
    synth = fit_for(train, seconds, context=1024, channels=6)
    model_dir = out.with_suffix("") / "scimark2-L1024"
    synth.save(model_dir)
    t0 = time.perf_counter()
    s = GaussianDiffusion.load(model_dir).sample(n_events, seed=0)
    dt = time.perf_counter() - t0
    windows = check_valid(synth, s)
    q = quality(s, test)
    ok = q["event_jsd"] < 0.05 and len(s) == n_events
    print(
        f"    sampled {len(s):,} events (ddim-50) in {dt:.0f} s ({len(s) / dt:,.0f} ev/s); {windows} windows all "
        f"decode into valid Traces; event JSD to the test block {q['event_jsd']:.4f} "
        f"({'PASS' if ok else 'FAIL'} < 0.05), bigram JSD {q['bigram_jsd']:.4f}",
        flush=True,
    )
    # reference: how far the real train block is from the real test block
    ref = quality(train, test)
    print(
        f"    reference (real train block vs test block): event JSD {ref['event_jsd']:.4f}, "
        f"bigram {ref['bigram_jsd']:.4f}"
    )
    # fast vs ancestral on the same model and the same number of events
    cmp_rows = {}
    for name, kw in (
        ("ddim-10", {"sampler": "ddim", "sampling_steps": 10}),
        ("ddim-50", {"sampler": "ddim"}),
        ("ancestral-1000", {"sampler": "ancestral"}),
    ):
        t0 = time.perf_counter()
        smp = synth.sample(n_anc, seed=1, **kw)
        el = time.perf_counter() - t0
        cmp_rows[name] = {**quality(smp, test), "seconds": el, "events": len(smp)}
        r = cmp_rows[name]
        print(
            f"    {name:15s} {len(smp):,} events in {el:5.0f} s ({len(smp) / el:7,.0f} ev/s): "
            f"event JSD {r['event_jsd']:.4f}  bigram JSD {r['bigram_jsd']:.4f}",
            flush=True,
        )
    sub = test.slice(0, n_anc)
    print(
        f"    reference (first {n_anc:,} real test events vs the test block): "
        f"bigram JSD {quality(sub, test)['bigram_jsd']:.4f}"
    )
    return {
        "train": synth.history,
        "sample_100k": {**q, "windows_valid": windows, "pass": ok},
        "samplers": cmp_rows,
        "real_train_vs_test": ref,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=REPO / "data" / "scimark2.parquet")
    ap.add_argument("--quick", action="store_true", help="small budgets (about 9 minutes)")
    ap.add_argument("--train-seconds", type=float, default=None, help="training time of the done-when model")
    ap.add_argument("--only", choices=("throughput", "patching", "done"), action="append", help="run only these parts")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "bench_diffusion.json")
    args = ap.parse_args()
    if not args.data.exists():
        print(f"skip: {args.data} is absent (the shipped dataset lives under data/)")
        return
    parts = set(args.only or ("throughput", "patching", "done"))
    # One thread by default: on a shared, busy 2-core machine a second torch thread mostly spins.
    torch.set_num_threads(args.threads)
    real = Trace.load(args.data)
    train, val, test = split_by_time(real, (0.8, 0.1, 0.1))
    train_val = Trace.concat([train, val])
    print(
        f"data: {args.data.name}: {len(real):,} events, {real.n_event_types} event types; "
        f"train+val {len(train_val):,}, test {len(test):,}; torch threads {torch.get_num_threads()}"
    )
    res: dict = {"data": str(args.data), "quick": args.quick}
    if "throughput" in parts:
        d = GaussianDiffusionConfig()
        print(
            f"throughput (random weights and tokens; d_model {d.d_model}, {d.n_layers} layers, patch = L // 256):",
            flush=True,
        )
        res["throughput"] = bench_throughput(ChannelCodec.fit([real]), args.quick)
    if "patching" in parts:
        print("patching and parametrisation at equal training time (6 channels):", flush=True)
        res["patching"] = bench_patching(train_val, test, 40 if args.quick else 120, 8192 if args.quick else 32768)
    if "done" in parts:
        print("done-when check (scimark2, L=1024):", flush=True)
        secs = args.train_seconds or (60 if args.quick else 240)
        res["done"] = bench_done_when(train_val, test, secs, 100_000, 2048 if args.quick else 8192, args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=float))
    print(f"figures written to {args.out}")


if __name__ == "__main__":
    main()

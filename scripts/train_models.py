"""Train the shipped checkpoint (`make models`): one conditional autoregressive model (`tracesynth fit
--kind ar --conditional`) on the first 70% (by event order) of every trace in data/, for a fixed
wall-time budget on this machine's cores. The last 30% of each trace is never seen by it, so the
demo and `bench/bench_generators.py --load models/all` score it there.

    .venv/bin/python scripts/train_models.py                       # models/all, 70 min
    .venv/bin/python scripts/train_models.py --seconds 60 --out /tmp/m  # a quick try

Writes MODEL_DIR (safetensors + JSON; its config.json "history" holds the data files with their
sha256, the training blocks, steps, seconds, the command and the machine) and MODEL_DIR.log (the
training log). Sample it with `tracesynth sample models/all --workload fio --events 10000`.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from atomicio import atomic_path  # noqa: E402
from tracesynth.collect import sha256_file  # noqa: E402
from tracesynth.errors import TraceSynthError  # noqa: E402
from tracesynth.generators.ar import ARConfig, Autoregressive  # noqa: E402
from tracesynth.io import read_trace  # noqa: E402
from tracesynth.optim import resolve_device  # noqa: E402
from tracesynth.splits import split_by_time  # noqa: E402

TRAIN_FRACTION = 0.7  # the checkpoint learns the first 70% of each trace's events; the rest is held out


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


@torch.no_grad()
def _held_out_loss(model: Autoregressive, test, max_windows: int = 64) -> float:
    """The training loss on up to `max_windows` disjoint windows of a trace's held-out block."""
    w = model.windows([test], stride=model.config.context)
    return float(model.loss({c: torch.from_numpy(v[:max_windows]) for c, v in w.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=REPO / "data", help="directory of the shipped traces (*.parquet)")
    ap.add_argument("--out", type=Path, default=REPO / "models" / "all", help="model directory to write")
    ap.add_argument("--seconds", type=float, default=4200, help="training wall time")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--chains", type=int, default=32,
                    help="chains sampled in parallel (sampling only): the model drifts over long chains; 32 gave "
                         "the lowest 3-gram JSD to the training blocks (bench/bench_chains.py; figures in "
                         "models/README.md)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core)")
    ap.add_argument("--device", default="cpu", help="where to train: cpu, cuda or cuda:N (sampling stays on the CPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    try:
        dev = resolve_device(args.device)
    except TraceSynthError as e:
        sys.exit(str(e))
    files = sorted(args.data.glob("*.parquet"))
    if not files:
        sys.exit(f"{args.data}: no *.parquet traces to train on")
    log_path = args.out.with_name(args.out.name + ".log")
    lines: list[str] = []

    def say(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    say(f"$ {shlex.join(['python', *sys.argv])}")
    say(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, {_cpu()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads, commit {_commit()}"
        + (f", training on {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else ""))
    blocks, held_out, data = [], [], []
    for f in files:
        trace = read_trace(f)
        train, test = split_by_time(trace, (TRAIN_FRACTION, 1 - TRAIN_FRACTION))
        blocks.append(train)
        held_out.append(test)
        data.append({"file": f.name, "sha256": sha256_file(f), "workload": trace.metadata.get("workload"),
                     "events": len(trace), "train_events": len(train), "train_fraction": TRAIN_FRACTION})
        say(f"{f.name}: training on its first {len(train):,} of {len(trace):,} events")
    cfg = ARConfig(context=args.context, d_model=args.d_model, n_layers=args.layers, batch_size=args.batch_size,
                   steps=10**9, time_limit=args.seconds, conditional=True, seed=args.seed, chains=args.chains,
                   device=args.device)
    model = Autoregressive(cfg)
    t0 = time.perf_counter()
    recent: list[float] = []

    def progress(step: int, loss: float) -> None:
        recent.append(loss)
        if step % 250 == 0:
            say(f"step {step:6d}  {time.perf_counter() - t0:6.0f} s  loss {sum(recent) / len(recent):.4f}")
            recent.clear()

    model.fit(blocks, progress=progress)
    h = model.history
    say(f"done: {h['steps']} steps in {h['train_seconds']:.0f} s ({h['train_events_per_s']:,.0f} events/s), "
        f"final loss {h['final_loss']:.4f}, {model.n_params:,} weights")
    for d, test in zip(data, held_out, strict=True):
        d["held_out_loss"] = _held_out_loss(model, test)
    say("held-out loss (per channel, nats; the last 30% of each trace): "
        + ", ".join(f"{d['workload']} {d['held_out_loss']:.4f}" for d in data))
    model.history["training"] = {"command": lines[0][2:], "machine": lines[1], "data": data}
    model.save(args.out)
    with atomic_path(log_path) as tmp:
        tmp.write_text("\n".join(lines) + "\n")
    say(f"wrote {args.out} and {log_path}")


if __name__ == "__main__":
    main()

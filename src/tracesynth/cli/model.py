"""`tracesynth fit` and `tracesynth sample`: train the diffusion generator, sample synthetic traces."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from tracesynth.cli.app import app, console
from tracesynth.errors import TraceSynthError


@app.command()
def fit(
    data: list[Path] = typer.Argument(..., help="Real traces to learn from (Parquet, or any readable format)."),
    output: Path = typer.Option(..., "-o", "--output", help="Model directory to write."),
    context: int = typer.Option(1024, "--context", help="Events per window (L)."),
    channels: int = typer.Option(6, "--channels", help="6 (event, dt, cpu, tid, comm, ret) or 2 (event, dt)."),
    steps: int = typer.Option(1000, "--steps", help="Training steps (in total, counting resumed ones)."),
    time_limit: float = typer.Option(0.0, "--time-limit", help="Stop training after this many seconds (0 = no limit)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Windows per step (per process under torchrun)."),
    patch: int = typer.Option(0, "--patch", help="Events per transformer token; 0 = context // 256."),
    stride: int = typer.Option(0, "--stride", help="Window stride in events; 0 = context // 2."),
    d_model: int = typer.Option(64, "--d-model", help="Transformer width."),
    layers: int = typer.Option(2, "--layers", help="Transformer blocks."),
    lr: float = typer.Option(3e-3, "--lr", help="Peak learning rate."),
    checkpoint_every: int = typer.Option(200, "--checkpoint-every", help="Write the model every N steps."),
    seed: int = typer.Option(0, "--seed", help="Seed of weights, batches and noise."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (cuda:N)."),
    resume: bool = typer.Option(False, "--resume", help="Continue training the model in -o from its last checkpoint."),
    threads: int = typer.Option(
        0, "--threads", help="torch CPU threads (0 = torch's default; 1 is faster on a busy CPU)."
    ),
    anonymize: bool = typer.Option(
        False,
        "--anonymize",
        help="Anonymise each trace before fitting (as `tracesynth anonymize`). Without it the model keeps the "
        "traces' real command names (vocab.json) and real thread ids (ret values of gettid, clone, ...).",
    ),
    salt: str = typer.Option(
        None,
        "--salt",
        envvar="TRACESYNTH_SALT",
        help="Salt of the comm hashes with --anonymize (default: random; give the same one to --resume, and one "
        "under torchrun).",
    ),
) -> None:
    """Train the diffusion generator on real traces (run under `torchrun` for several processes).

    The model holds the traces' real command names and thread ids unless --anonymize is given.
    """
    from tracesynth.diffusion import TraceSynth, TraceSynthConfig
    from tracesynth.diffusion.synth import is_main_process
    from tracesynth.io import read_trace

    _set_threads(threads)
    traces = [read_trace(p) for p in data]
    if anonymize:
        from tracesynth.anonymize import anonymize as anonymize_trace
        from tracesynth.cli.trace_io import salt_or_random

        if not salt and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise TraceSynthError("--anonymize under torchrun needs --salt (every process must hash alike)")
        key = salt_or_random(salt)  # one salt for all traces: the same program gets the same label in each
        traces = [anonymize_trace(t, key) for t in traces]
    if resume and output.exists():
        synth = TraceSynth.load(output)
        if synth.step >= steps:
            raise TraceSynthError(f"already trained for {synth.step} steps; ask for more with --steps", output)
        synth.config.steps = steps
        synth.config.device = device
        synth.config.time_limit = time_limit
        if is_main_process():
            console.print(f"resuming {output} at step {synth.step}")
    else:
        cfg = TraceSynthConfig(
            context=context,
            channels=channels,
            steps=steps,
            time_limit=time_limit,
            batch_size=batch_size,
            patch=patch or None,
            stride=stride or None,
            d_model=d_model,
            n_layers=layers,
            lr=lr,
            checkpoint_every=checkpoint_every,
            seed=seed,
            device=device,
        )
        synth = TraceSynth(cfg)
    synth.fit(traces, checkpoint_dir=output, progress=True)
    if is_main_process():
        h = synth.history
        console.print(
            f"{output}: {synth.step} steps on {h.get('train_windows', 0):,} windows of {synth.config.context} events, "
            f"loss {h.get('loss', float('nan')):.4f}, val {h.get('val_loss') or float('nan'):.4f}, "
            f"{h.get('train_events_per_s', 0):,.0f} events/s"
        )


@app.command()
def sample(
    model: Path = typer.Argument(..., help="Model directory written by `tracesynth fit`."),
    events: int = typer.Option(..., "--events", help="Number of events to generate."),
    output: Path = typer.Option(..., "-o", "--output", help="Parquet trace to write."),
    seed: int = typer.Option(0, "--seed", help="The same seed gives the same trace."),
    sampler: str = typer.Option(None, "--sampler", help="ddim (fast, strided) or ancestral (all 1000 steps)."),
    sampling_steps: int = typer.Option(None, "--sampling-steps", help="Steps of the ddim sampler."),
    repair: Path = typer.Option(None, "--repair", help="Constraint rules (JSON) to repair the sample with."),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: the model's)."),
    threads: int = typer.Option(
        0, "--threads", help="torch CPU threads (0 = torch's default; 1 is faster on a busy CPU)."
    ),
) -> None:
    """Generate a synthetic trace from a trained model."""
    from tracesynth.diffusion import TraceSynth

    _set_threads(threads)
    synth = TraceSynth.load(model)
    rules = None
    if repair is not None:
        try:
            from tracesynth.constraints import Rules
        except ImportError as exc:
            raise TraceSynthError(f"constraint repair is unavailable ({exc})", repair) from None
        rules = Rules.load(repair)
    trace = synth.sample(
        events, seed=seed, repair=rules, sampler=sampler, sampling_steps=sampling_steps, progress=True, device=device
    )
    trace.save(output)
    span = trace.duration_ns / 1e9
    msg = f"{model} -> {output}: {len(trace):,} events, {trace.n_event_types} event types, {span:.3f} s"
    rep = synth.last_repair_report
    if rep is not None:
        before, after = getattr(rep, "violations_before", "?"), getattr(rep, "violations_after", "?")
        msg += f"; repair: violations {before} -> {after}"
    console.print(msg)


def _set_threads(n: int) -> None:
    if n > 0:
        import torch

        torch.set_num_threads(n)

"""`tracesynth fit` and `tracesynth sample`: train a generator, sample synthetic traces, repair them.

Generators are built and loaded through tracesynth.generator's registry, so `sample` reads any saved
kind; repair is its own step after sampling (tracesynth.constraints.repair_trace).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import typer

from tracesynth.bounds import check_sample_size
from tracesynth.cli.app import app, console
from tracesynth.errors import TraceSynthError
from tracesynth.generator import get_kind, load_generator, make_generator, saved_kind


@app.command()
def fit(
    ctx: typer.Context,
    data: list[Path] = typer.Argument(..., help="Real traces to learn from (Parquet, or any readable format)."),
    output: Path = typer.Option(..., "-o", "--output", help="Model directory to write."),
    kind: str = typer.Option(
        "ar",
        "--kind",
        help="Generator: ar (autoregressive transformer, the shipped models/all's kind), diffusion (the paper's "
        "Gaussian model), masked (discrete diffusion) or markov.",
    ),
    order: int = typer.Option(4, "--order", help="Markov order (with --kind markov)."),
    context: int = typer.Option(None, "--context", help="Events per window (L); if not given 256 for ar, else 1024."),
    channels: int = typer.Option(6, "--channels", help="6 (event, dt, cpu, tid, comm, ret) or 2 (event, dt)."),
    steps: int = typer.Option(1000, "--steps", help="Training steps (in total, counting resumed ones)."),
    time_limit: float = typer.Option(0.0, "--time-limit", help="Stop training after this many seconds (0 = no limit)."),
    batch_size: int = typer.Option(
        None, "--batch-size", help="Windows per step (per process under torchrun); if not given 32 for ar, else 8."
    ),
    patch: int = typer.Option(0, "--patch", help="Events per transformer token; 0 = context // 256."),
    stride: int = typer.Option(0, "--stride", help="Window stride in events; 0 = context // 2."),
    d_model: int = typer.Option(None, "--d-model", help="Transformer width; if not given 128 for ar, else 64."),
    layers: int = typer.Option(2, "--layers", help="Transformer blocks."),
    lr: float = typer.Option(None, "--lr", help="Peak learning rate; if not given 0.001 for ar, else 0.003."),
    checkpoint_every: int = typer.Option(
        200, "--checkpoint-every", min=1, help="ar, masked, diffusion: write a checkpoint to -o every N steps (a "
        "loadable, sampleable model with its training state)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of weights, batches and noise."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (cuda:N)."),
    resume: bool = typer.Option(
        False, "--resume", help="ar, masked, diffusion: continue training the model in -o from its last checkpoint "
        "on the same traces (a fresh fit if -o holds none); its network and recipe are the checkpoint's, --steps "
        "and --time-limit count the steps and seconds of both runs. Not markov (it fits in one pass)."
    ),
    conditional: bool = typer.Option(
        False, "--conditional", help="masked/ar: one model for the traces' workloads (sample it with --workload)."
    ),
    threads: int = typer.Option(
        0, "--threads", help="torch CPU threads (0 = torch's default; 1 is faster on a busy CPU)."
    ),
    init: Path = typer.Option(
        None,
        "--init",
        help="masked/ar: start from this fitted model's network (e.g. the shipped models/all) instead of random "
        "weights, and fine-tune it on the traces; its size and kind are kept. Worth it for a short trace.",
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
    """Train a generator on real traces (an autoregressive transformer unless --kind says otherwise; the diffusion
    model also runs under `torchrun` for several processes).

    The model holds the traces' real command names and thread ids unless --anonymize is given.
    """
    from tracesynth.io import read_trace

    start = load_generator(init) if init is not None else None
    saved = saved_kind(output) if resume and _holds_model(output) else None
    if saved is not None and start is not None:
        raise TraceSynthError("--init and --resume: a resumed fit continues its checkpoint's network; drop --init")
    if start is not None or saved is not None:
        kind = kind if _given(ctx, "kind") else (saved or start).name
    gen_kind = get_kind(kind)
    if gen_kind.cls is None:
        raise TraceSynthError(f"a {kind} generator cannot be saved; score it in a pipeline config instead")
    if saved is not None and saved.name != gen_kind.name:
        raise TraceSynthError(f"--resume: it holds a {saved.name} model, not a {kind} one", output)
    if resume and gen_kind.name == "markov":
        raise TraceSynthError("--resume applies to ar, masked and diffusion models: a markov one fits in one pass")
    if conditional and gen_kind.name not in ("masked", "ar"):
        raise TraceSynthError(f"--conditional applies to masked and ar models, not a {kind} one")
    if start is not None and gen_kind.name not in ("masked", "ar"):
        raise TraceSynthError(f"--init applies to masked and ar models, not a {kind} one"
                              + (" (use --resume)" if gen_kind.name == "diffusion" else ""))
    _check_output(output, gen_kind)  # before the training, not after it
    defaults = _DEFAULTS.get(gen_kind.name, _DEFAULTS["other"])  # for the size and optimiser options not given
    opts = {"context": context, "channels": channels, "steps": steps, "time_limit": time_limit,
            "batch_size": batch_size, "patch": patch, "stride": stride, "d_model": d_model, "layers": layers,
            "lr": lr, "checkpoint_every": checkpoint_every, "seed": seed, "device": device,
            "conditional": conditional, "order": order}
    opts.update({k: defaults[k] for k in defaults if opts[k] is None})
    _set_threads(threads)
    traces = [read_trace(p) for p in data]
    if anonymize:
        from tracesynth.anonymize import anonymize as anonymize_trace
        from tracesynth.cli.trace_io import salt_or_random

        if not salt and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise TraceSynthError("--anonymize under torchrun needs --salt (every process must hash alike)")
        key = salt_or_random(salt)  # one salt for all traces: the same program gets the same label in each
        traces = [anonymize_trace(t, key) for t in traces]
    if gen_kind.name == "diffusion":
        _fit_diffusion(traces, output, opts, resume=saved is not None)
        return
    if gen_kind.name in ("masked", "ar"):
        gen = _fit_token(ctx, gen_kind.name, traces, output, opts, start, init, resume=saved is not None)
        what = f"{gen.fit_info['train_steps']} steps, {gen.n_params:,} weights"
    else:
        gen = make_generator({"kind": kind, "order": order}).fit(traces)
        what = f"{gen.n_params:,} table entries"
    gen.save(output)
    origin = f", started from {init}" if start is not None else ""
    origin += ", resumed" if saved is not None else ""
    console.print(f"{output}: {gen.name} fitted on {sum(len(t) for t in traces):,} events{origin}, {what}")


def _holds_model(output: Path) -> bool:
    """Whether -o is a model directory to resume (rather than a new, empty or missing one)."""
    return output.is_dir() and (output / "config.json").exists()


def _check_output(output: Path, gen_kind) -> None:
    """Refuse up front an -o the model could not be written to (a path under a file, a directory holding
    other files): the refusal `atomic_path` gives when the model is saved, but before the training."""
    import atomicio

    above = output.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise atomicio.OutputPathError(above, "is not a directory; the model cannot be written under it")
    contents = getattr(gen_kind.cls(), "contents", None) or _CONTENTS.get(gen_kind.name)
    atomicio._check_replaceable(output, True, contents)  # the very check atomic_path makes when it saves


# what a model directory of a kind without a `contents` attribute holds (atomic_path's `contents`)
_CONTENTS = {"markov": ("config.json", "tables.safetensors")}


def _fit_token(ctx: typer.Context, kind: str, traces: list, output: Path, opts: dict, start, init: Path | None,
               resume: bool):
    """Fit (or, with `resume`, continue fitting) a masked or ar model, checkpointing into `output`."""
    if resume:
        gen = load_generator(output)
        done = gen.history.get("steps") or 0
        if done >= opts["steps"]:
            raise TraceSynthError(f"already trained for {done} steps; ask for more with --steps", output)
        gen.config.steps, gen.config.device = opts["steps"], opts["device"]
        gen.config.time_limit = opts["time_limit"] or None
        console.print(f"resuming {output} at step {done}")
        cfg = {"steps": opts["steps"], "time_limit": gen.config.time_limit}
    else:
        cfg = {"context": opts["context"], "steps": opts["steps"], "time_limit": opts["time_limit"] or None,
               "lr": opts["lr"], "d_model": opts["d_model"], "n_layers": opts["layers"],
               "batch_size": opts["batch_size"], "seed": opts["seed"], "conditional": opts["conditional"],
               "device": opts["device"], "channels": opts["channels"]}
        if start is not None:
            cfg = _init_config(ctx, start, kind, cfg, init)
        gen = make_generator({"kind": kind, "config": cfg})
    _fit_with_progress(gen, traces, start, cfg, checkpoint_dir=output, checkpoint_every=opts["checkpoint_every"],
                       resume=resume)
    return gen


def _fit_diffusion(traces: list, output: Path, opts: dict, resume: bool) -> None:
    from tracesynth.diffusion import TraceSynth, TraceSynthConfig
    from tracesynth.diffusion.synth import is_main_process

    if resume:
        synth = TraceSynth.load(output)
        if synth.step >= opts["steps"]:
            raise TraceSynthError(f"already trained for {synth.step} steps; ask for more with --steps", output)
        synth.config.steps = opts["steps"]
        synth.config.device = opts["device"]
        synth.config.time_limit = opts["time_limit"]
        synth.config.checkpoint_every = opts["checkpoint_every"]
        if is_main_process():
            console.print(f"resuming {output} at step {synth.step}")
    else:
        cfg = TraceSynthConfig(
            context=opts["context"],
            channels=opts["channels"],
            steps=opts["steps"],
            time_limit=opts["time_limit"],
            batch_size=opts["batch_size"],
            patch=opts["patch"] or None,
            stride=opts["stride"] or None,
            d_model=opts["d_model"],
            n_layers=opts["layers"],
            lr=opts["lr"],
            checkpoint_every=opts["checkpoint_every"],
            seed=opts["seed"],
            device=opts["device"],
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


# the network and optimiser of a fit where the option is not given: ar's are the shipped checkpoint's recipe
# (scripts/train_models.py), the other kinds' those they were measured with (docs/tracesynth-results.md)
_DEFAULTS = {
    "ar": {"context": 256, "batch_size": 32, "d_model": 128, "lr": 1e-3},
    "other": {"context": 1024, "batch_size": 8, "d_model": 64, "lr": 3e-3},
}


def _fit_with_progress(gen, traces: list, start, cfg: dict, **fit_args) -> None:
    """Fit a token model with a progress bar: steps done of `steps`, loss, time (and its limit)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    limit = f" (limit {cfg['time_limit']:g} s)" if cfg.get("time_limit") else ""
    columns = (TextColumn("[bold]fit[/]"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn(), TextColumn(limit))  # fmt: skip
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("fit", total=cfg["steps"], loss=float("nan"))
        gen.fit(traces, progress=lambda step, loss: bar.update(task, completed=step, loss=loss), init=start,
                **fit_args)


def _given(ctx: typer.Context, param: str) -> bool:
    """Whether the command's option `param` was set by the user (on the command line or from its variable)."""
    source = ctx.get_parameter_source(param)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


# fit's options that size the network, and the config field each sets
_SIZE_OPTIONS = {"context": "context", "d_model": "d_model", "layers": "n_layers", "channels": "channels"}


def _init_config(ctx: typer.Context, start, kind: str, asked: dict, init: Path) -> dict:
    """The config of a fit that starts from the fitted model `start`: its network size (a size option given
    that differs is an error), its sampler settings, and the training settings asked for (learning rate and
    batch size: the start's unless given)."""
    if start.name != kind:
        raise TraceSynthError(f"--init is a {start.name} model: fit it with --kind {start.name}", init)
    cfg = asdict(start.config)
    for param, key in _SIZE_OPTIONS.items():
        if _given(ctx, param) and asked[key] != cfg[key]:
            raise TraceSynthError(f"--{param.replace('_', '-')} {asked[key]}: the network is the size of --init's "
                                  f"({key} {cfg[key]}); drop the option", init)  # fmt: skip
    cfg.update({k: asked[k] for k in ("steps", "time_limit", "seed", "conditional", "device")})
    cfg.update({k: asked[k] for k, param in (("lr", "lr"), ("batch_size", "batch_size")) if _given(ctx, param)})
    return cfg


@app.command()
def sample(
    model: Path = typer.Argument(..., help="Model directory written by `tracesynth fit`."),
    events: int = typer.Option(..., "--events", min=1, help="Number of events to generate."),
    output: Path = typer.Option(..., "-o", "--output", help="Parquet trace to write."),
    seed: int = typer.Option(0, "--seed", help="The same seed gives the same trace."),
    sampler: str = typer.Option(None, "--sampler", help="ddim (fast, strided) or ancestral (all 1000 steps)."),
    sampling_steps: int = typer.Option(None, "--sampling-steps", help="Steps of the ddim sampler."),
    repair: Path = typer.Option(None, "--repair", help="Constraint rules (JSON) to repair the sample with."),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: the model's)."),
    workload: str = typer.Option(None, "--workload", help="The workload to draw (a model fitted with --conditional)."),
    guide: str = typer.Option(
        None, "--guide", help="ar, markov: kernel (keep draws within the kernel invariants; ar's default) or none "
        "(markov's default).",
    ),
    threads: int = typer.Option(
        0, "--threads", help="torch CPU threads (0 = torch's default; 1 is faster on a busy CPU)."
    ),
) -> None:
    """Generate a synthetic trace from a saved generator (any kind), optionally repaired."""
    from tracesynth.constraints import Rules, repair_trace

    rules = Rules.load(repair) if repair is not None else None  # a bad rules file fails before sampling
    gen_kind = saved_kind(model)
    check_sample_size(events, gen_kind.name)  # before the model is loaded: an impossible --events fails at once
    given = {"sampler": sampler, "sampling_steps": sampling_steps, "device": device, "workload": workload,
             "guide": guide}
    opts = {k: v for k, v in given.items() if v is not None}
    unknown = [f"--{k.replace('_', '-')}" for k in opts if k not in gen_kind.sample_options]
    if unknown:
        raise TraceSynthError(f"{', '.join(unknown)} does not apply to a {gen_kind.name} model", model)
    if "progress" in gen_kind.sample_options:
        opts["progress"] = True
    _set_threads(threads)
    trace = gen_kind.load(model).sample(events, seed=seed, **opts)
    msg = ""
    if rules is not None:
        trace, rep = repair_trace(trace, rules, seed=seed)
        msg = f"; repair: violations {rep.violations_before} -> {rep.violations_after}"
    trace.save(output)
    span = trace.duration_ns / 1e9
    console.print(f"{model} -> {output}: {len(trace):,} events, {trace.n_event_types} event types, {span:.3f} s{msg}",
                  soft_wrap=True)  # one line whatever the paths: logs and scripts read it


def _set_threads(n: int) -> None:
    if n > 0:
        import torch

        torch.set_num_threads(n)

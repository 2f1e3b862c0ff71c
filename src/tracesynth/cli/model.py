"""`tracesynth fit` and `tracesynth sample`: train a generator, sample synthetic traces, repair them.

Generators are built and loaded through the registry (tracesynth.generators), so `sample` reads any saved
kind; repair is its own step after sampling (tracesynth.constraints.repair_trace).
"""

from __future__ import annotations

import os
from dataclasses import asdict, fields
from pathlib import Path

import typer

from tracesynth.bounds import LogLines, check_sample_size
from tracesynth.cli.app import app, console
from tracesynth.errors import TraceSynthError
from tracesynth.generators import get_kind, load_generator, make_generator, saved_kind

# fit's option help; an option left out takes the default of the kind's config class (ARConfig, MaskedConfig,
# GaussianDiffusionConfig, MarkovConfig), the same one a pipeline config's {"kind": ...} gets
_FIT_HELP = {
    "data": "Real traces to learn from (Parquet, or any readable format).",
    "kind": "Generator: ar (autoregressive transformer, the shipped models/all's kind), diffusion (the paper's "
    "Gaussian model), masked (discrete diffusion), block (block diffusion) or markov.",
    "order": "Markov order (with --kind markov; default 4).",
    "context": "Events per window (L); if not given 256 for ar, else 1024.",
    "channels": "6 (event, dt, cpu, tid, comm, ret) or 2 (event, dt); default 6.",
    "steps": "Training steps (in total, counting resumed ones); default 1000.",
    "time_limit": "Stop training after this many seconds (0 = no limit, the default).",
    "batch_size": "Windows per step (per process under torchrun); if not given 32 for ar, else 8.",
    "patch": "diffusion: events per transformer token; 0 = context // 256.",
    "stride": "diffusion: window stride in events; 0 = context // 2.",
    "d_model": "Transformer width; if not given 128 for ar, else 64.",
    "layers": "Transformer blocks; default 2.",
    "lr": "Peak learning rate; if not given 0.001 for ar, else 0.003.",
    "checkpoint_every": "ar, masked, block, diffusion: write a checkpoint to -o every N steps (a loadable, "
    "sampleable model with its training state); default 200.",
    "seed": "Seed of weights, batches and noise; default 0.",
    "device": "cpu or cuda (cuda:N); default cpu.",
    "resume": "ar, masked, block, diffusion: continue training the model in -o from its last checkpoint on the "
    "same traces (a fresh fit if -o holds none); its network and recipe are the checkpoint's, --steps and "
    "--time-limit count the steps and seconds of both runs. Not markov (it fits in one pass).",
    "conditional": "masked/ar/block: one model for the traces' workloads (sample it with --workload).",
    "threads": "torch CPU threads (0 = torch's default; 1 is faster on a busy CPU).",
    "init": "masked/ar/block: start from this fitted model's network (e.g. the shipped models/all) instead of "
    "random weights, and fine-tune it on the traces; its size and kind are kept (a block model may start from an "
    "ar one). Worth it for a short trace.",
    "anonymize": "Anonymise each trace before fitting (as `tracesynth anonymize`). Without it the model keeps the "
    "traces' real command names (vocab.json) and real thread ids (ret values of gettid, clone, ...).",
    "salt": "Salt of the comm hashes with --anonymize (default: random; give the same one to --resume, and one under "
    "torchrun).",
}


@app.command()
def fit(
    ctx: typer.Context,
    data: list[Path] = typer.Argument(..., help=_FIT_HELP["data"]),
    output: Path = typer.Option(..., "-o", "--output", help="Model directory to write."),
    kind: str = typer.Option("ar", "--kind", help=_FIT_HELP["kind"]),
    order: int = typer.Option(None, "--order", help=_FIT_HELP["order"]),
    context: int = typer.Option(None, "--context", help=_FIT_HELP["context"]),
    channels: int = typer.Option(None, "--channels", help=_FIT_HELP["channels"]),
    steps: int = typer.Option(None, "--steps", help=_FIT_HELP["steps"]),
    time_limit: float = typer.Option(None, "--time-limit", help=_FIT_HELP["time_limit"]),
    batch_size: int = typer.Option(None, "--batch-size", help=_FIT_HELP["batch_size"]),
    patch: int = typer.Option(None, "--patch", help=_FIT_HELP["patch"]),
    stride: int = typer.Option(None, "--stride", help=_FIT_HELP["stride"]),
    d_model: int = typer.Option(None, "--d-model", help=_FIT_HELP["d_model"]),
    layers: int = typer.Option(None, "--layers", help=_FIT_HELP["layers"]),
    lr: float = typer.Option(None, "--lr", help=_FIT_HELP["lr"]),
    checkpoint_every: int = typer.Option(None, "--checkpoint-every", min=1, help=_FIT_HELP["checkpoint_every"]),
    seed: int = typer.Option(None, "--seed", help=_FIT_HELP["seed"]),
    device: str = typer.Option(None, "--device", help=_FIT_HELP["device"]),
    resume: bool = typer.Option(False, "--resume", help=_FIT_HELP["resume"]),
    conditional: bool = typer.Option(False, "--conditional", help=_FIT_HELP["conditional"]),
    threads: int = typer.Option(0, "--threads", help=_FIT_HELP["threads"]),
    init: Path = typer.Option(None, "--init", help=_FIT_HELP["init"]),
    anonymize: bool = typer.Option(False, "--anonymize", help=_FIT_HELP["anonymize"]),
    salt: str = typer.Option(None, "--salt", envvar="TRACESYNTH_SALT", help=_FIT_HELP["salt"]),
) -> None:
    """Train a generator on real traces (an autoregressive transformer unless --kind says otherwise; every kind
    but markov also trains under `torchrun` for several processes: DDP, only rank 0 writes).

    The model holds the traces' real command names and thread ids unless --anonymize is given.
    """
    start, saved, gen_kind = _fit_kind(ctx, kind, output, init, resume, conditional)
    _check_output(output, gen_kind)  # before the training, not after it
    options = _config_options(gen_kind, ctx.params)
    _set_threads(threads)
    traces = _read_traces(data, anonymize, salt)
    if gen_kind.name == "diffusion":
        _fit_diffusion(gen_kind, traces, output, options, resume=saved is not None)
        return
    if gen_kind.name in TOKEN_KINDS:
        fit_args = {"checkpoint_every": checkpoint_every} if checkpoint_every else {}
        gen = _fit_token(gen_kind, traces, output, options, start, init, resume=saved is not None, **fit_args)
        what = f"{gen.fit_info['train_steps']} steps, {gen.n_params:,} weights"
    else:
        gen = make_generator(gen_kind.config(options)).fit(traces)
        what = f"{gen.n_params:,} table entries"
    if not _is_main():  # under torchrun: rank 0 writes the model and prints
        return
    gen.save(output)
    origin = f", started from {init}" if start is not None else ""
    origin += ", resumed" if saved is not None else ""
    console.print(f"{output}: {gen.name} fitted on {sum(len(t) for t in traces):,} events{origin}, {what}")


def _fit_kind(ctx: typer.Context, kind: str, output: Path, init: Path | None, resume: bool, conditional: bool):
    """(the model --init starts from, the kind -o holds to --resume, the kind to fit), checked against the options."""
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
        raise TraceSynthError(
            "--resume applies to ar, masked, block and diffusion models: a markov one fits in one pass"
        )
    if conditional and gen_kind.name not in TOKEN_KINDS:
        raise TraceSynthError(f"--conditional applies to masked, ar and block models, not a {kind} one")
    if start is not None and gen_kind.name not in TOKEN_KINDS:
        raise TraceSynthError(
            f"--init applies to masked, ar and block models, not a {kind} one"
            + (" (use --resume)" if gen_kind.name == "diffusion" else "")
        )
    return start, saved, gen_kind


# fit's options that set a config field of another name
_FIELDS = {"layers": "n_layers"}
# option values that mean "not given": a --time-limit, --patch or --stride of 0 is "none", as the config's default
_UNSET = {"time_limit": 0, "patch": 0, "stride": 0, "conditional": False}


def _config_options(gen_kind, params: dict) -> dict:
    """The config fields fit's options set (`params`: the command's parameters): the options given that are fields
    of the kind's config; one not given takes the config class's default. An option of another kind is ignored."""
    names = {f.name for f in fields(gen_kind.config_cls())}
    given = {_FIELDS.get(k, k): v for k, v in params.items() if v is not None and not (k in _UNSET and v == _UNSET[k])}
    return {k: v for k, v in given.items() if k in names}


def _read_traces(data: list[Path], anonymize: bool, salt: str | None) -> list:
    """The traces to fit, each anonymised (with one salt for all) with --anonymize."""
    from tracesynth.io import read_trace

    traces = [read_trace(p) for p in data]
    if anonymize:
        from tracesynth.anonymize import anonymize as anonymize_trace
        from tracesynth.cli.trace_io import salt_or_random

        if not salt and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise TraceSynthError("--anonymize under torchrun needs --salt (every process must hash alike)")
        key = salt_or_random(salt)  # one salt for all traces: the same program gets the same label in each
        traces = [anonymize_trace(t, key) for t in traces]
    return traces


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
    contents = getattr(gen_kind.cls(), "contents", None)  # what the kind's save() writes
    atomicio.check_replaceable(output, True, contents)  # the very check atomic_path makes when it saves


def _fit_token(gen_kind, traces: list, output: Path, options: dict, start, init: Path | None, resume: bool, **fit_args):
    """Fit (or, with `resume`, continue fitting) a masked or ar model, checkpointing into `output`."""
    if resume:
        asked = gen_kind.config(options)  # the options given, the others the kind's defaults
        gen = load_generator(output)
        done = gen.history.get("steps") or 0
        if done >= asked.steps:
            raise TraceSynthError(f"already trained for {done} steps; ask for more with --steps", output)
        gen.config.steps, gen.config.device, gen.config.time_limit = asked.steps, asked.device, asked.time_limit
        if _is_main():
            console.print(f"resuming {output} at step {done}")
    elif start is not None:
        gen = make_generator(gen_kind.config(_init_config(start, gen_kind, options, init)))
    else:
        gen = make_generator(gen_kind.config(options))
    _fit_with_progress(gen, traces, start, checkpoint_dir=output, resume=resume, **fit_args)
    return gen


def _fit_diffusion(gen_kind, traces: list, output: Path, options: dict, resume: bool) -> None:
    if resume:
        asked = gen_kind.config(options)
        synth = load_generator(output)
        if synth.step >= asked.steps:
            raise TraceSynthError(f"already trained for {synth.step} steps; ask for more with --steps", output)
        for key in ("steps", "device", "time_limit", "checkpoint_every"):
            setattr(synth.config, key, getattr(asked, key))
        if _is_main():
            console.print(f"resuming {output} at step {synth.step}")
    else:
        synth = make_generator(gen_kind.config(options))
    synth.fit(traces, checkpoint_dir=output, progress=True)
    if _is_main():
        h = synth.history
        console.print(
            f"{output}: {synth.step} steps on {h.get('train_windows', 0):,} windows of {synth.config.context} events, "
            f"loss {h.get('loss', float('nan')):.4f}, val {h.get('val_loss') or float('nan'):.4f}, "
            f"{h.get('train_events_per_s', 0):,.0f} events/s"
        )


def _fit_with_progress(gen, traces: list, start, **fit_args) -> None:
    """Fit a token model with a progress bar: steps done of `steps`, loss, time (and its limit)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    limit = f" (limit {gen.config.time_limit:g} s)" if gen.config.time_limit else ""
    columns = (
        TextColumn("[bold]fit[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeElapsedColumn(),
        TextColumn(limit),
    )
    if not console.is_terminal:  # a log: a line at least once a minute (rank 0 alone, as the bar)
        lines = LogLines("fit", gen.config.steps, "steps", console)
        show = _is_main()
        gen.fit(traces, progress=lambda step, loss: show and lines(step, f", loss {loss:.4f}"), init=start, **fit_args)
        return
    with Progress(*columns, console=console, disable=not _is_main()) as bar:
        task = bar.add_task("fit", total=gen.config.steps, loss=float("nan"))
        gen.fit(traces, progress=lambda step, loss: bar.update(task, completed=step, loss=loss), init=start, **fit_args)


def _is_main() -> bool:
    """Rank 0 under torchrun (the process that writes and prints); the one process otherwise."""
    from tracesynth.generators.distributed import is_main_process  # torch: imported only when a model is fitted

    return is_main_process()


def _given(ctx: typer.Context, param: str) -> bool:
    """Whether the command's option `param` was set by the user (on the command line or from its variable)."""
    source = ctx.get_parameter_source(param)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


# the config fields that size the network, and the option that sets each
TOKEN_KINDS = ("masked", "ar", "block")  # the token models: checkpoints, --resume, --init, --conditional

_SIZE_OPTIONS = {"context": "context", "d_model": "d_model", "n_layers": "layers", "channels": "channels"}


_TRAINING = ("steps", "time_limit", "seed", "conditional", "device")  # a fit from --init takes these as asked


def _init_config(start, gen_kind, options: dict, init: Path) -> dict:
    """The config of a fit that starts from the fitted model `start`: its network size (a size option given
    that differs is an error), its sampler settings, and the training settings asked for (learning rate and
    batch size: the start's unless given)."""
    if start.name != gen_kind.name and (start.name, gen_kind.name) != ("ar", "block"):  # block runs ar's network
        raise TraceSynthError(f"--init is a {start.name} model: fit it with --kind {start.name}", init)
    cfg = asdict(start.config)
    for key, param in _SIZE_OPTIONS.items():
        if key in options and options[key] != cfg[key]:
            raise TraceSynthError(
                f"--{param.replace('_', '-')} {options[key]}: the network is the size of --init's "
                f"({key} {cfg[key]}); drop the option",
                init,
            )
    asked = gen_kind.config({k: v for k, v in options.items() if k in _TRAINING})  # the others: the kind's defaults
    cfg.update({k: getattr(asked, k) for k in _TRAINING})
    cfg.update({k: options[k] for k in ("lr", "batch_size") if k in options})
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
        None,
        "--guide",
        help="ar, markov: kernel (keep draws within the kernel invariants; ar's default) or none (markov's default).",
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
    given = {
        "sampler": sampler,
        "sampling_steps": sampling_steps,
        "device": device,
        "workload": workload,
        "guide": guide,
    }
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
    console.print(
        f"{model} -> {output}: {len(trace):,} events, {trace.n_event_types} event types, {span:.3f} s{msg}",
        soft_wrap=True,
    )  # one line whatever the paths: logs and scripts read it


def _set_threads(n: int) -> None:
    if n > 0:
        import torch

        torch.set_num_threads(n)

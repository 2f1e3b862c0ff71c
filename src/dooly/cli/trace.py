"""`dooly trace` (operators and signatures of models, no per-model code) and `dooly zoo` (the model zoo)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dooly.cli.app import app
from dooly.engines import DEFAULT_ENGINE

out = Console()
err = Console(stderr=True)


@app.command("trace")
def trace_cmd(
    models: list[str] = typer.Argument(..., help="Zoo model names, config.json files or local model directories."),
    phase: str = typer.Option("both", "--phase", help="prefill, decode, chunk (chunked prefill) or both."),
    json_out: Path | None = typer.Option(None, "--json", help="Write every trace (records + signatures) here."),
    device: str = typer.Option("cpu", "--device", help="Engine device: cpu, cuda or auto."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="Engine weight/activation dtype."),
    show_ops: bool = typer.Option(False, "--ops", help="Also list each model's unique signatures."),
    engine_name: str = typer.Option(DEFAULT_ENGINE, "--engine", help="Inference engine: hf-eager (default) or vllm."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size: trace rank 0 of the replica (vllm)."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel size (vllm)."),
    pp_stage: int = typer.Option(0, "--pp-stage", help="The pipeline stage to trace, 0-based (vllm)."),
) -> None:
    """Run one dummy request per phase through the engine and print, per model, the operators it ran, its unique
    signatures and how many of them the other models given here share."""
    from dooly.core.errors import DoolyError
    from dooly.core.zoo import load_config
    from dooly.engines import get_engine
    from dooly.trace.signature import ModelTrace, traces_to_json
    from dooly.trace.tracer import trace_model

    phases = ["prefill", "decode"] if phase == "both" else [phase]
    if any(p not in ("prefill", "decode", "chunk") for p in phases):
        raise DoolyError(f"--phase must be prefill, decode, chunk or both, got {phase!r}")
    configs = [load_config(m) for m in models]  # fail on a bad name before any tracing
    engine = get_engine(engine_name, device=device, dtype=dtype, tp=tp, pp=pp, pp_stage=pp_stage)
    traces: list[ModelTrace] = []
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err
    ) as bar:
        task = bar.add_task("tracing", total=len(configs) * len(phases))
        for cfg in configs:
            for ph in phases:
                bar.update(task, description=f"tracing {cfg.name} ({ph})")
                traces.append(trace_model(cfg.config, ph, name=cfg.name, engine=engine))
                bar.advance(task)

    table = Table(title=f"dooly trace ({engine.trace_context}, {dtype})")
    for col in ("model", "phase", "branches", "ops", "kernels", "unique", "shared", "seconds"):
        table.add_column(col, justify="left" if col in ("model", "phase") else "right")
    for t in traces:
        mine = set(t.all_unique())
        others = set()
        for o in traces:
            if o.model != t.model:
                others |= set(o.all_unique())
        shared = len(mine & others)
        pct = f"{shared} ({100 * shared / len(mine):.0f}%)" if mine else "0"
        table.add_row(
            t.model,
            t.phase,
            str(len(t.branches())),
            str(len(t.records)),
            str(len(t.kernels())),
            str(len(mine)),
            pct if len(configs) > 1 else "-",
            f"{t.meta['seconds']:.1f}",
        )
    out.print(table)
    out.print("branches: passes the code takes over request sizes (each traced); ops, kernels: aten calls and the")
    out.print("calls that are not views, of the first branch; unique: distinct signatures of all branches;")
    out.print("shared: unique signatures that another model given here also has")
    for t in traces:
        for i, b in enumerate(t.branches()):
            if b.guards:
                what = f"{t.model} {t.phase}" + (f" branch {i + 1} ({len(b.records)} ops)" if t.sides else "")
                out.print(f"{what} valid while: {' and '.join(b.guards)}", highlight=False)
    if show_ops:
        _print_ops(traces)
    if json_out is not None:
        from atomicio import atomic_path

        with atomic_path(json_out) as tmp:
            tmp.write_text(traces_to_json(traces))
        err.print(f"wrote {len(traces)} traces to {json_out}")


def _print_ops(traces: list) -> None:
    """Each trace's unique signatures, the most repeated first."""
    for t in traces:
        ops = Table(title=f"{t.model} {t.phase}: unique signatures (x multiplicity)")
        ops.add_column("x", justify="right")
        ops.add_column("signature")
        ops.add_column("key")
        for sig, n in sorted(t.unique().items(), key=lambda kv: -kv[1]):
            ops.add_row(str(n), str(sig), sig.key[:12])
        out.print(ops)


@app.command("zoo")
def zoo_cmd() -> None:
    """List the model zoo (published architecture numbers; weights are random, nothing downloads)."""
    from dooly.core.zoo import list_models

    table = Table(title="dooly model zoo")
    cols = ("name", "family", "params (B)", "layers", "hidden", "heads/kv", "source")
    rows = []
    for m in list_models():
        c = m.config
        heads = c.get("num_attention_heads", "?")
        kv = c.get("num_key_value_heads", heads)
        family = m.family if m.family == c.get("model_type") else f"{m.family} ({c.get('model_type')})"
        params = "" if m.params_billion is None else f"{m.params_billion:g}"
        layers, hidden = str(c.get("num_hidden_layers", "?")), str(c.get("hidden_size", "?"))
        rows.append((m.name, family, params, layers, hidden, f"{heads}/{kv}", m.hf_repo))
    # Every column but the source keeps its full text (the name is what users type next); on a narrow
    # terminal the source is cut short.
    for i, col in enumerate(cols):
        width = None if col == "source" else max(len(col), *(len(r[i]) for r in rows))
        numeric = col in ("params (B)", "layers", "hidden")
        table.add_column(col, justify="right" if numeric else "left", no_wrap=True, min_width=width)
    for row in rows:
        table.add_row(*row)
    out.print(table)

"""`tracesynth constraints mine|check` and `tracesynth repair`: mined rules, checked and enforced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from atomicio import atomic_path
from tracesynth.cli.app import app, console
from tracesynth.errors import TraceSynthError
from tracesynth.io import read_trace

if TYPE_CHECKING:
    from tracesynth.constraints import Rules
# tracesynth.constraints (~40 ms) is imported by these commands only, not by every `tracesynth` run

constraints_app = typer.Typer(
    name="constraints",
    help="Mine constraints from real traces and check traces against them.",
    no_args_is_help=True,
)
app.add_typer(constraints_app, name="constraints")


@constraints_app.command("mine")
def mine(
    data: list[Path] = typer.Argument(..., help="Real traces (Parquet, or any readable format)."),
    output: Path = typer.Option(..., "-o", "--output", help="Rules document to write (JSON)."),
    train_fraction: float = typer.Option(
        1.0, "--train-fraction", help="Mine from the first fraction (in time) of each trace, e.g. 0.8."
    ),
) -> None:
    """Learn rules from real traces: kernel invariants (always enforced) and learned rules (transitions,
    time bounds, CPU affinity, value sets), each calibrated across time blocks of the traces, each held out
    in turn: an entry that did not hold in every block is advisory, not enforced."""

    from tracesynth.constraints import mine_rules
    from tracesynth.splits import split_by_time

    if not 0 < train_fraction <= 1:
        raise TraceSynthError(f"--train-fraction must be in (0, 1], got {train_fraction}")
    traces = []
    with Progress(
        TextColumn("reading"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True
    ) as bar:
        task = bar.add_task("traces", total=len(data))
        for path in data:
            trace = read_trace(path)
            if train_fraction < 1:
                trace = split_by_time(trace, (train_fraction, 1 - train_fraction))[0]
            traces.append(trace)
            bar.advance(task)
    rules = mine_rules(traces)
    rules.save(output)
    out = Console()
    p = rules.params
    out.print(
        f"[bold]{output}[/]: rules from {sum(len(t) for t in traces):,} events in {len(traces)} trace(s); learned "
        f"rules calibrated across {p['calibration_blocks']} time blocks of each trace, each held out in turn "
        f"(enforced where they held in every block that exercised them, at least {p['calibration_min_blocks']}, "
        f"and the false-positive rate is at most {p['max_fp_rate']:.2%}; the rest are advisory)"
    )
    out.print(rule_table(rules))


def rule_table(rules: Rules) -> Table:
    """One row per rule: its kind, enforced and advisory entries, the time blocks that exercised it and its
    calibrated false-positive rate."""
    table = Table("rule", "kind", "enforced", "advisory", "blocks", "calibrated on", "calibrated FP", box=None,
                  pad_edge=False)
    for name, row in rules.rule_table().items():
        fp = row["fp_rate"]
        blocks = f"{row['blocks']}/{row['blocks_total']}" if "blocks_total" in row else "-"  # version-2 rules: none
        table.add_row(
            name,
            row["kind"],
            f"{row['enforced']:,}",
            f"{row.get('advisory', 0):,}",
            blocks,
            f"{row['calibration_applies']:,} events",
            "n/a" if fp is None else f"{fp:.3%}",
        )
    return table


@constraints_app.command("check")
def check(
    trace_path: Path = typer.Argument(..., metavar="TRACE", help="Trace to check (Parquet or any readable format)."),
    rules_path: Path = typer.Option(..., "--rules", help="Rules document written by `constraints mine`."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the report as JSON here."),
) -> None:
    """Count violations per rule, with the first examples (event index, found, expected)."""
    from tracesynth.constraints import Rules, check_trace

    rules = Rules.load(rules_path)
    trace = read_trace(trace_path)
    report = check_trace(trace, rules)
    Console().print(report.table(title=f"{trace_path} (rules: {rules_path})"))
    if json_out is not None:
        with atomic_path(json_out) as tmp:
            tmp.write_text(json.dumps(report.to_dict(), indent=1, sort_keys=True) + "\n")


@app.command("repair")
def repair(
    trace_path: Path = typer.Argument(..., metavar="TRACE", help="Trace to repair (Parquet or any readable format)."),
    rules_path: Path = typer.Option(..., "--rules", help="Rules document written by `constraints mine`."),
    output: Path = typer.Option(..., "-o", "--output", help="Repaired trace to write (Parquet)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the values sampled by the repair."),
) -> None:
    """Fix every violation with the smallest edit the rules allow; report the edit rate."""
    from tracesynth.constraints import Rules, check_trace, repair_trace

    rules = Rules.load(rules_path)
    trace = read_trace(trace_path)
    with console.status(f"repairing {len(trace):,} events"):
        fixed, rep = repair_trace(trace, rules, seed=seed)
    after = check_trace(fixed, rules)
    fixed.save(output)
    out = Console()
    table = Table("rule", "fixes", box=None, pad_edge=False)
    for name, n in rep.fixes.items():
        if n:
            table.add_row(name, f"{n:,}")
    out.print(
        f"[bold]{output}[/]: {rep.violations_before:,} violations -> {after.total:,}; "
        f"{rep.changed:,} of {rep.events_in:,} events changed (edit rate {rep.edit_rate:.2%}: "
        f"{rep.modified:,} modified, {rep.inserted:,} inserted, {rep.deleted:,} deleted) in {rep.rounds} round(s)"
    )
    out.print("columns changed: " + ", ".join(f"{k} {v:,}" for k, v in rep.columns.items()))
    out.print(table)

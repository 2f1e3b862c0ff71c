"""The `tracesynth` Typer app; command modules in this package register on it."""

from __future__ import annotations

import signal
import sys

import typer
from rich.console import Console

from atomicio import OutputPathError
from tracesynth.errors import TraceSynthError

app = typer.Typer(
    name="tracesynth",
    help="Learn from real kernel traces (LTTng, perf, strace) and generate synthetic ones.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    """Entry point: expected failures become one line on stderr and exit status 1."""
    # SIGTERM unwinds like Ctrl-C, so half-written outputs are removed on the way out.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        app()
    except (TraceSynthError, OutputPathError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)

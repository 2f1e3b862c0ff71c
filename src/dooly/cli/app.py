"""The `dooly` Typer app; command modules in this package register on it."""

from __future__ import annotations

import signal
import sys

import typer
from rich.console import Console
from rich.markup import escape

from atomicio import OutputPathError
from dooly.core.errors import DoolyError

app = typer.Typer(
    name="dooly",
    help="Profile LLM inference without per-model code, predict latency and simulate serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)


try:  # typer >= 0.26 carries its own copy of click; its errors are not click's
    from typer._click import exceptions as _usage
except ImportError:  # pragma: no cover - an older typer on click
    from click import exceptions as _usage


def _usage_line(exc: _usage.UsageError) -> str:
    """A usage error as one line: `PROG COMMAND: --option: what is wrong (see --help)`."""
    where = exc.ctx.command_path if exc.ctx is not None else "dooly"
    param = getattr(exc, "param", None)
    if isinstance(exc, _usage.BadParameter) and not isinstance(exc, _usage.MissingParameter) and param is not None:
        what = f"{' / '.join(param.opts) or param.human_readable_name}: {exc.message}"
    else:
        what = exc.format_message()
    return f"{where}: {' '.join(what.split()).rstrip('.')} (see --help)"


def main() -> None:
    """Entry point: expected failures become one line on stderr and exit status 1; a usage error (a bad option
    or argument) is one line and exit status 2."""
    # SIGTERM unwinds like Ctrl-C, so half-written outputs are removed on the way out.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        code = app(standalone_mode=False)  # click's errors come here rather than as its multi-line usage box
    except _usage.NoArgsIsHelpError:
        sys.exit(2)  # the help was printed
    except _usage.UsageError as exc:
        console.print(f"[bold red]error:[/] {escape(_usage_line(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except (DoolyError, OutputPathError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except (KeyboardInterrupt, typer.Abort):
        console.print("interrupted")
        sys.exit(130)
    if isinstance(code, int) and not isinstance(code, bool) and code:
        sys.exit(code)  # a command's typer.Exit(code)

"""`tracesynth` command line. Each module below registers its commands on the shared app."""

import os
import sys

# Piped to a file or a CI log, rich falls back to 80 columns and cuts table cells ("request…"); a log
# should hold the whole table. Set before the modules below create their consoles.
if "COLUMNS" not in os.environ and not sys.stdout.isatty():
    os.environ["COLUMNS"] = "200"

from tracesynth.cli import collect, constraints, demo, evaluate, info, model, trace_io  # noqa: E402, F401  (registers commands)
from tracesynth.cli.app import app, main  # noqa: E402

__all__ = ["app", "main"]

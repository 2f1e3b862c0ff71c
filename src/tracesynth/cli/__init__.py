"""`tracesynth` command line. Each module below registers its commands on the shared app."""

from tracesynth.cli import collect, constraints, demo, evaluate, info, model, trace_io  # noqa: F401  (registers commands)
from tracesynth.cli.app import app, main

__all__ = ["app", "main"]

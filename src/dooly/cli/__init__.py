"""`dooly` command line. Each module below registers its commands on the shared app."""

from dooly.cli import profile, serve, trace  # noqa: F401  (registers commands)
from dooly.cli.app import app, main

__all__ = ["app", "main"]

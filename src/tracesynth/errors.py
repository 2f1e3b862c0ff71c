"""The one exception type the CLI turns into a one-line error and a non-zero exit."""

from __future__ import annotations

from pathlib import Path


class TraceSynthError(Exception):
    """An expected failure (bad input, missing tool): reported as one line, no traceback."""

    def __init__(self, message: str, path: str | Path | None = None):
        self.path = None if path is None else str(path)
        super().__init__(f"{self.path}: {message}" if self.path else message)

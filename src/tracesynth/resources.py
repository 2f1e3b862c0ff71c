"""Where tracesynth finds what it ships: pipeline configs (package data) and the recorded dataset.

The configs travel inside the package, so they are found the same way from a checkout and from a
wheel. The dataset (data/, a few MB of Parquet) stays in the repository: commands that need it take
`--data DIR`, else TRACESYNTH_DATA, else ./data, else the data/ of the source checkout this package
was imported from.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from tracesynth.errors import TraceSynthError

MANIFEST = "manifest.json"


def configs_dir() -> Path:
    """The directory of shipped pipeline configs (demo.json, experiment-*.json, ...)."""
    return Path(str(resources.files("tracesynth") / "configs"))


def source_checkout() -> Path | None:
    """The repository root when this package is imported from a source checkout (src/ layout)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "src" / "tracesynth").is_dir() else None


def dataset_dir(explicit: str | Path | None = None) -> Path:
    """The recorded dataset to read: the first of --data, $TRACESYNTH_DATA, ./data, the checkout's data/."""
    if explicit is not None:
        d = Path(explicit)
        if not d.is_dir():
            raise TraceSynthError("no such dataset directory", d)
        return d
    env = os.environ.get("TRACESYNTH_DATA")
    if env:
        if not Path(env).is_dir():
            raise TraceSynthError("TRACESYNTH_DATA names no directory", env)
        return Path(env)
    checkout = source_checkout()
    for d in (Path("data"), checkout / "data" if checkout else None):
        if d is not None and (d / MANIFEST).is_file():
            return d
    raise TraceSynthError(
        "no dataset found: pass --data DIR (a clone's data/, or one built by `tracesynth datasets --build`) "
        "or set TRACESYNTH_DATA"
    )


def default_dataset_output() -> Path:
    """Where `tracesynth datasets --build` writes: the checkout's data/ when there is one, else ./data."""
    checkout = source_checkout()
    return checkout / "data" if checkout else Path("data")

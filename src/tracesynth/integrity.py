"""Checks of a saved model's tensor files before they are used, so that a damaged or foreign file is one
line naming it rather than garbage samples or a page of state-dict mismatches.

`save` stores a sha256 of each tensor file in config.json ("sha256": {file name: hex digest}); `load` checks
them (`verify_hashes`; a model saved before the hashes has none and is not checked) and then compares each
tensor's shape with the one the config implies (`check_shapes`), before any tensor reaches the network.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tracesynth.errors import TraceSynthError

HASHES = "sha256"  # the config.json key


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_hashes(directory: Path, names: Iterable[str]) -> dict[str, str]:
    """{name: sha256} of the files `names` in `directory` (the ones present)."""
    return {name: sha256_of(directory / name) for name in names if (directory / name).is_file()}


def verify_hashes(directory: Path, meta: Mapping[str, Any], optional: Iterable[str] = ()) -> None:
    """Each file config.json lists must be there with its sha256 (an `optional` one may be gone: a model whose
    training state was deleted to make it smaller); a config.json without hashes (a model saved before they
    were stored) passes."""
    hashes = meta.get(HASHES)
    if hashes is None:
        return
    if not isinstance(hashes, dict) or not all(isinstance(v, str) for v in hashes.values()):
        raise TraceSynthError(f"config.json: {HASHES} must map file names to hex digests", directory)
    for name, want in sorted(hashes.items()):
        path = directory / name
        if Path(name).name != name:  # a hash may only vouch for a file of the model itself
            raise TraceSynthError(f"config.json: {HASHES} names {name!r}, not a file of the model", directory)
        if not path.is_file():
            if name in optional:
                continue
            raise TraceSynthError("missing (config.json lists it)", path)
        if sha256_of(path) != want:
            raise TraceSynthError("sha256 mismatch, the file is damaged (or not this model's)", path)


def _shape(shape: Iterable[int]) -> str:
    return str(tuple(int(s) for s in shape))


def check_shapes(path: Path, got: Mapping[str, Any], want: Mapping[str, Iterable[int]]) -> None:
    """Every tensor `want`s ({name: shape}) must be in `got` ({name: tensor or shape}) with that shape, and no
    other: else one line naming the file and the first tensor that differs."""
    for name in sorted(want):
        if name not in got:
            raise TraceSynthError(f"no tensor {name} (the config wants one of shape {_shape(want[name])})", path)
        shape = getattr(got[name], "shape", got[name])
        if tuple(shape) != tuple(want[name]):
            raise TraceSynthError(f"tensor {name} has shape {_shape(shape)}, the config wants {_shape(want[name])}",
                                  path)
    extra = sorted(set(got) - set(want))
    if extra:
        raise TraceSynthError(f"tensor {extra[0]} is not one of this model's ({len(extra)} unexpected)", path)

"""Where a CTF trace's metadata lives: in its directory, or nested per domain and session as LTTng writes it.
Its own module so that the readers and `io.detect_format` share it without importing each other."""

from __future__ import annotations

from pathlib import Path


def find_ctf_metadata(path: Path) -> list[Path]:
    """The CTF `metadata` files under a directory (an LTTng session nests them per domain)."""
    if (path / "metadata").is_file():
        return [path / "metadata"]
    return sorted(p for p in path.rglob("metadata") if p.is_file())

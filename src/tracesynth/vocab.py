"""String vocabularies: strings <-> dense integer codes, shared by readers, models and evaluation.

Readers grow one batch by batch (`grow`), so every batch's dictionary lands on stable global codes;
models and scores fix one on real data and map any trace's dictionary column onto it (`lookup`),
unknown names to a default code. Both are vectorised: one dict lookup per distinct string, never
one per event.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa


def remap(codes: np.ndarray, names: Sequence[str], index: Mapping[str, int], default: int = -1) -> np.ndarray:
    """Codes into `names` (a dictionary column's codes, -1 = null) as int64 codes of `index`;
    names missing from `index`, and nulls, get `default`."""
    table = np.asarray([index.get(v, default) for v in names] + [default], dtype=np.int64)
    return table[np.where(np.asarray(codes) < 0, len(names), codes)]


class Vocab:
    """Strings -> codes 0..n-1 in order of first addition; None and the `nulls` strings have no code (-1)."""

    def __init__(self, values: Iterable[str] = (), nulls: Iterable[str] = ()) -> None:
        self.values: list[str] = []
        self.index: dict[str, int] = {}
        self.nulls = frozenset(nulls)  # strings a source writes for "unknown"
        for v in values:
            self.add(v)

    def __len__(self) -> int:
        return len(self.values)

    def __contains__(self, v: object) -> bool:
        return v in self.index

    def add(self, v: str | None) -> int:
        """The code of `v`, adding it if new (-1 for None and the null strings)."""
        if v is None or v in self.nulls:
            return -1
        code = self.index.get(v)
        if code is None:
            code = self.index[v] = len(self.values)
            self.values.append(v)
        return code

    def add_all(self, names: Iterable[str | None]) -> np.ndarray:
        """int32 codes of several names, adding the new ones."""
        return np.array([self.add(v) for v in names], dtype=np.int32)

    def grow(self, arr: pa.Array) -> np.ndarray:
        """int32 codes of a string or dictionary array, adding its new strings; nulls -> -1."""
        arr = arr if pa.types.is_dictionary(arr.type) else arr.dictionary_encode()
        local = np.append(self.add_all(arr.dictionary.to_pylist()), np.int32(-1))
        idx = arr.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        return local[idx]

    def lookup(self, codes: np.ndarray, names: Sequence[str], default: int = -1) -> np.ndarray:
        """A dictionary column (codes into `names`) as int64 codes of this vocabulary, which does not
        grow: unknown names and nulls get `default`."""
        return remap(codes, names, self.index, default)

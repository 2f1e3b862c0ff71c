"""Plain JSON values from results that hold numpy scalars/arrays and non-finite floats."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def jsonable(x: Any) -> Any:
    """A copy of `x` that json.dumps writes as strict JSON: numpy values become Python ones, tuples
    lists, keys strings, and NaN / +-inf become null (JSON has no spelling for them)."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating | float):
        return float(x) if math.isfinite(float(x)) else None
    return x

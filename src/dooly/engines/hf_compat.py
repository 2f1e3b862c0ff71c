"""What differs between transformers releases, for the HF eager engine and its serving executor alike."""

from __future__ import annotations

import inspect
from typing import Any


def cache_kwarg(model: Any) -> str:
    """The name of the forward's KV-cache argument: transformers 5.x renamed ``past_key_values`` to ``cache``;
    use whichever this model's forward takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"

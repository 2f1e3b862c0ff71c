"""Stable digests of what dooly keys caches on: a model config (what the model is, not where it came from)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


def config_hash(config: Mapping[str, Any]) -> str:
    """Stable digest of a config dict (what the model is, not where it came from)."""
    body = {k: v for k, v in config.items() if not k.startswith("_")}
    # canonical_json's spelling, but a config may hold an infinite float (an SSM's time-step limit)
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]

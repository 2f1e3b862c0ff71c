"""One serving-engine iteration: the requests being prefilled (possibly in chunks) and those decoding."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Batch:
    """What one forward pass of the engine computes.

    ``prefill``: one ``(new_tokens, cached_tokens)`` pair per request being prefilled; ``cached_tokens``
    is the prefix already in the KV cache (non-zero for the later chunks of a chunked prefill).
    ``decode``: the KV length (tokens already cached) of each request producing one new token.
    """

    prefill: tuple[tuple[int, int], ...] = ()  # (new tokens, already-cached tokens) per request being prefilled
    decode: tuple[int, ...] = ()  # KV length per request in decode

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple((int(n), int(c)) for n, c in self.prefill))
        object.__setattr__(self, "decode", tuple(int(k) for k in self.decode))
        for n, c in self.prefill:
            if n < 1 or c < 0:
                raise ValueError(f"prefill chunk needs new tokens >= 1 and cached >= 0, got ({n}, {c})")
        for k in self.decode:
            if k < 0:
                raise ValueError(f"decode KV length must be >= 0, got {k}")

    @property
    def num_requests(self) -> int:
        return len(self.prefill) + len(self.decode)

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this iteration (every prefill chunk's new tokens plus one per decode)."""
        return sum(n for n, _ in self.prefill) + len(self.decode)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

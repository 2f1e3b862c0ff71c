"""The request and batch entities every layer shares: a request's serving state (:class:`Request`), one iteration
the scheduler chose (:class:`ScheduledBatch`) and what one forward pass of the engine computes (:class:`Batch`).

A request's tokens are its prompt followed by what it has generated so far. ``computed`` counts the tokens
whose keys/values are in the KV cache (see :mod:`dooly.simulator.entities` for the life of a request).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass(eq=False)
class Request:
    """One request; the first four fields describe it, the rest is mutable serving state."""

    id: int
    arrival: float  # seconds
    prompt_tokens: int
    output_tokens: int
    computed: int = 0  # tokens whose KV is cached
    generated: int = 0
    prefill_done: bool = False
    kv_blocks: int = 0  # blocks held in the replica's pool
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    preemptions: int = 0
    replica: int = -1  # where the router sent it (-1 until routed)
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"request {self.id}: prompt and output tokens must be >= 1")

    @property
    def context_len(self) -> int:
        """Tokens known so far (prompt + generated)."""
        return self.prompt_tokens + self.generated

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to compute before the next token can be sampled (0 when decoding)."""
        return 0 if self.prefill_done else self.context_len - self.computed

    @property
    def is_finished(self) -> bool:
        return self.generated >= self.output_tokens

    def preempt(self) -> None:
        """Recompute preemption: the cache is gone, everything known must be prefilled again."""
        self.computed = 0
        self.prefill_done = False
        self.kv_blocks = 0
        self.preemptions += 1


@dataclass
class ScheduledBatch:
    """One iteration chosen by the scheduler: prefill chunks (request, new tokens) and decoding requests."""

    prefill: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # requests evicted while building it

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefill) + len(self.decode)

    @property
    def num_seqs(self) -> int:
        return len(self.prefill) + len(self.decode)

    def to_batch(self) -> Batch:
        """The predictor's view: (new, cached) per prefill chunk, KV length per decode (before this token)."""
        return Batch(
            prefill=tuple((n, r.computed) for r, n in self.prefill),
            decode=tuple(r.computed for r in self.decode),
        )

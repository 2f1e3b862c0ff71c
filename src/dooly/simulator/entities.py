"""Simulator entities: a request's life through the replica, the KV-cache block pool, one scheduled iteration.

A request's tokens are its prompt followed by what it has generated so far. ``computed`` counts the tokens
whose keys/values are in the KV cache. A request is in *prefill* until every known token is computed (the
iteration that finishes the prefill samples a token), then in *decode* (one token in, one token out per
iteration). Preemption by recompute (vLLM's default) drops the cache: ``computed`` returns to 0 and the
prompt plus everything generated so far is prefilled again before the next token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dooly.batch import Batch


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


class KVCache:
    """A pool of fixed-size KV blocks (vLLM's paged cache): a request holds ceil(cached tokens / block)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.used = 0

    @property
    def free(self) -> int:
        return self.num_blocks - self.used

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def extra_blocks(self, req: Request, new_tokens: int) -> int:
        """Blocks `req` must add to cache `new_tokens` more tokens."""
        return max(0, self.blocks_for(req.computed + new_tokens) - req.kv_blocks)

    def grow(self, req: Request, new_tokens: int) -> None:
        extra = self.extra_blocks(req, new_tokens)
        if extra > self.free:
            raise RuntimeError(f"KV cache overflow: request {req.id} needs {extra} blocks, {self.free} free")
        self.used += extra
        req.kv_blocks += extra

    def release(self, req: Request) -> None:
        self.used -= req.kv_blocks
        req.kv_blocks = 0


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


@dataclass
class IterationRecord:
    """What happened in one iteration of one replica (for batch-size and KV-usage-over-time metrics)."""

    replica: int
    start: float
    end: float
    prefill_tokens: int
    num_prefill: int
    num_decode: int
    kv_blocks_used: int
    kv_blocks_total: int
    preempted: int

    @classmethod
    def of(cls, batch: ScheduledBatch, kv: KVCache, replica: int, start: float, end: float) -> IterationRecord:
        """The record of `batch` having run from `start` to `end`, with the KV cache as it left it."""
        return cls(
            replica=replica,
            start=start,
            end=end,
            prefill_tokens=sum(n for _, n in batch.prefill),
            num_prefill=len(batch.prefill),
            num_decode=len(batch.decode),
            kv_blocks_used=kv.used,
            kv_blocks_total=kv.num_blocks,
            preempted=len(batch.preempted),
        )

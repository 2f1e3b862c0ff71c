"""Simulator entities: the KV-cache block pool and the record of one iteration; a request's life through the
replica and one scheduled iteration live in :mod:`dooly.core.batch` (the engines' executors run them too).

A request's tokens are its prompt followed by what it has generated so far. ``computed`` counts the tokens
whose keys/values are in the KV cache. A request is in *prefill* until every known token is computed (the
iteration that finishes the prefill samples a token), then in *decode* (one token in, one token out per
iteration). Preemption by recompute (vLLM's default) drops the cache: ``computed`` returns to 0 and the
prompt plus everything generated so far is prefilled again before the next token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dooly.core.batch import Request, ScheduledBatch


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


__all__ = ["IterationRecord", "KVCache", "Request", "ScheduledBatch"]

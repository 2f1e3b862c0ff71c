"""Continuous batching as vLLM does it, for one replica.

Two policies (:data:`SCHEDULING_POLICIES`), chosen by ``chunked_prefill``:

* ``whole``, off (vLLM v0's default): waiting requests are admitted FCFS, each with its whole prompt, while the
  sequence limit, the token budget and the free KV blocks allow; an iteration that admits any is a
  prefill-only iteration. Otherwise every running request decodes one token.
* ``chunked``, on (vLLM v1, and v0 with chunked prefill): each iteration serves the running requests in admission order
  (one token per decode, the next chunk of a partial prefill), then admits waiting requests, cutting prompts
  into chunks so that the batch never exceeds ``max_num_batched_tokens``.

When a decoding request needs a new KV block and none is free, the most recently admitted running request
is preempted (recompute) and goes back to the front of the waiting queue, as vLLM does.

:func:`vllm_v1_config` is the configuration that reproduces vLLM v1's scheduler (``vllm.v1.core.sched``):
chunked prefill always on, running requests before waiting ones, FCFS admission that stops at the first
request that does not fit (token budget, ``max_num_seqs`` or free KV blocks), a preempting iteration
admitting nothing new, the newest running request the preemption victim. vLLM v1 features not modelled:

* prefix caching (shared prompt prefixes reuse cached blocks; dooly validates with it off),
* speculative decoding, structured output, LoRA, multimodal encoders, pooling models,
* priority scheduling (``--scheduling-policy priority``) and ``long_prefill_token_threshold``,
* async scheduling (vLLM overlaps scheduling the next step with running this one on GPUs; the CPU backend
  turns it off) and the CPU/HTTP overhead of the API server, streaming and detokenisation,
* hybrid KV allocation (sliding-window and SSM layers get their own block pools; counted here as full
  attention), KV offloading, and data parallelism inside one replica.

Pipeline parallelism (a replica of M stages, :mod:`dooly.simulator.pipeline`) keeps up to M batches in flight, as
vLLM v1's batch queue does (``EngineCore.step_with_batch_queue``, ``max_concurrent_batches`` = the pipeline size).
vLLM advances a request's computed tokens when it schedules it, so a request whose next token is still being
sampled in flight has nothing to schedule (``num_new_tokens == 0``), while a long prompt's next chunk may go into
the next batch before the previous chunk has left the pipeline. Here ``inflight`` counts each request's tokens
scheduled and not yet completed, and scheduling reads ``computed + inflight`` as vLLM reads its computed tokens.
One deviation: a request with tokens in flight is never chosen as a preemption victim (vLLM may preempt it and
drop its in-flight output); the scheduler stops where only such a victim would free blocks. With one stage nothing
is ever in flight while scheduling, so every path below is the single-stage one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dooly.core.errors import DoolyError
from dooly.simulator.entities import KVCache, Request, ScheduledBatch


@dataclass(frozen=True)
class SchedulerConfig:
    """Engine limits of one replica (names follow vLLM's engine arguments)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = False
    block_size: int = 16
    num_kv_blocks: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks"):
            if getattr(self, name) < 1:
                raise DoolyError(f"scheduler config: {name} must be >= 1, got {getattr(self, name)}")

    @property
    def policy(self) -> str:
        """The name of the scheduling policy (:data:`SCHEDULING_POLICIES`) this config runs."""
        return "chunked" if self.chunked_prefill else "whole"

    def label(self) -> str:
        return f"seqs={self.max_num_seqs} tokens={self.max_num_batched_tokens} {self.policy}"


def vllm_v1_config(
    max_num_seqs: int, max_num_batched_tokens: int, block_size: int, num_kv_blocks: int
) -> SchedulerConfig:
    """vLLM v1's scheduler with its engine limits (it always chunks prefills; see the module docstring)."""
    return SchedulerConfig(max_num_seqs, max_num_batched_tokens, True, block_size, num_kv_blocks)


class ReplicaScheduler:
    """Waiting and running queues plus the KV block pool of one replica."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCache(config.num_kv_blocks, config.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        # request id -> tokens scheduled in batches still in the pipeline (empty on one stage: see the docstring)
        self.inflight: dict[int, int] = {}

    def add(self, req: Request) -> None:
        self.check_fits(req)
        self.waiting.append(req)

    def check_fits(self, req: Request) -> None:
        """Refuse up front a request this replica could never serve (it would stall the queue forever)."""
        cfg = self.config
        longest = req.prompt_tokens + req.output_tokens  # a late recompute prefills nearly all of it
        if not cfg.chunked_prefill and longest > cfg.max_num_batched_tokens:
            raise DoolyError(
                f"request {req.id} needs up to {longest} tokens in one prefill, above max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens}; enable chunked prefill or raise the limit"
            )
        if self.kv.blocks_for(longest) > cfg.num_kv_blocks:
            raise DoolyError(
                f"request {req.id} needs {self.kv.blocks_for(longest)} KV blocks, the replica has {cfg.num_kv_blocks}"
            )

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def outstanding(self) -> int:
        """Requests this replica holds and has not finished (queued or running)."""
        return len(self.waiting) + len(self.running)

    # -- one iteration ------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Choose the next iteration (possibly empty when nothing can run)."""
        return scheduling_policy(self.config.policy)(self)

    def _preempt_last(self, batch: ScheduledBatch) -> Request | None:
        """Preempt the newest running request with nothing in flight (None when every candidate has)."""
        if self.inflight:
            idle = [i for i, r in enumerate(self.running) if r.id not in self.inflight]
            if not idle:
                return None
            victim = self.running.pop(idle[-1])
            self.kv.release(victim)
            victim.preempt()
            batch.preempted.append(victim)
            return victim
        victim = self.running.pop()
        self.kv.release(victim)
        victim.preempt()
        batch.preempted.append(victim)
        return victim

    def _requeue_preempted(self, batch: ScheduledBatch) -> None:
        # Evicted requests go back to the head of the queue, oldest first, so they are re-admitted first.
        for req in sorted(batch.preempted, key=lambda r: (r.arrival, r.id), reverse=True):
            self.waiting.appendleft(req)

    def _schedule_running(self, batch: ScheduledBatch, budget: int, reqs: list[Request]) -> int:
        """Schedule running requests in order (decodes take one token, partial prefills a chunk), preempting
        the newest running request while the KV pool cannot hold a request's new tokens."""
        kv = self.kv
        bs = kv.block_size
        evicted: set[int] = set()
        inflight = self.inflight
        for req in reqs:
            if budget < 1:
                break
            if req.id in evicted:
                continue
            ahead = inflight.get(req.id, 0)  # tokens of it still in the pipeline (pipeline parallelism only)
            if ahead and (req.prefill_done or req.remaining_prefill <= ahead):
                continue  # its next token is being sampled in flight: nothing to schedule (vLLM's 0 new tokens)
            tokens = 1 if req.prefill_done else min(req.remaining_prefill - ahead, budget)
            need = -(-(req.computed + ahead + tokens) // bs) - req.kv_blocks  # ceil: blocks to add
            if need > 0:
                evicted_self = stuck = False
                while need > kv.num_blocks - kv.used:
                    victim = self._preempt_last(batch)
                    if victim is None:
                        stuck = True
                        break
                    evicted.add(victim.id)
                    if victim is req:
                        evicted_self = True
                        break
                if evicted_self or stuck:
                    break  # everything newer is gone too (or only requests in flight could make room)
                kv.used += need
                req.kv_blocks += need
            if req.prefill_done:
                batch.decode.append(req)
            else:
                batch.prefill.append((req, tokens))
            budget -= tokens
        return budget

    def _admit(self, batch: ScheduledBatch, budget: int, chunked: bool) -> int:
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
            req = self.waiting[0]
            need = req.remaining_prefill
            chunk = min(need, budget) if chunked else need
            if chunk > budget or self.kv.extra_blocks(req, chunk) > self.kv.free:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.kv.grow(req, chunk)
            self.running.append(req)
            batch.prefill.append((req, chunk))
            budget -= chunk
        return budget

    def _schedule_whole(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._admit(batch, self.config.max_num_batched_tokens, chunked=False)
        if batch.prefill:
            return batch
        self._schedule_running(batch, self.config.max_num_batched_tokens, list(self.running))
        self._requeue_preempted(batch)
        return batch

    def _schedule_chunked(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        # running requests in admission order (decodes and partial prefills), then new ones (vLLM v1), so a
        # victim (the newest) has never been scheduled in this iteration yet
        budget = self._schedule_running(batch, budget, list(self.running))
        self._requeue_preempted(batch)
        if not batch.preempted:  # an iteration that had to evict admits nothing new
            self._admit(batch, budget, chunked=True)
        return batch

    def dispatch(self, batch: ScheduledBatch) -> None:
        """Mark ``batch``'s tokens in flight until :meth:`complete` (a pipeline's batches overlap)."""
        for req, chunk in batch.prefill:
            self.inflight[req.id] = self.inflight.get(req.id, 0) + chunk
        for req in batch.decode:
            self.inflight[req.id] = self.inflight.get(req.id, 0) + 1

    def settle(self, batch: ScheduledBatch) -> None:
        """Take ``batch``'s tokens out of flight (before :meth:`complete` applies them)."""
        for req, n in [*batch.prefill, *((r, 1) for r in batch.decode)]:
            left = self.inflight.get(req.id, 0) - n
            if left > 0:
                self.inflight[req.id] = left
            else:
                self.inflight.pop(req.id, None)

    def complete(self, batch: ScheduledBatch, now: float) -> list[Request]:
        """Apply an iteration that ended at `now`; returns the requests it finished."""
        done: list[Request] = []
        for req, chunk in batch.prefill:
            req.computed += chunk
            if req.computed == req.context_len:  # prefill complete: a token is sampled
                req.prefill_done = True
                req.generated += 1
                req.token_times.append(now)
                if req.first_token is None:
                    req.first_token = now
        for req in batch.decode:
            req.computed += 1
            req.generated += 1
            req.token_times.append(now)
        for req in [r for r, _ in batch.prefill] + batch.decode:
            if req.prefill_done and req.is_finished and req.finished is None:
                req.finished = now
                self.kv.release(req)
                done.append(req)
        if done:
            gone = {r.id for r in done}
            self.running = [r for r in self.running if r.id not in gone]
        return done


#: Each scheduling policy by name: how a replica chooses its next iteration. A new policy is a
#: :class:`ReplicaScheduler` method and one line here.
SCHEDULING_POLICIES: Mapping[str, Callable[[ReplicaScheduler], ScheduledBatch]] = MappingProxyType(
    {"whole": ReplicaScheduler._schedule_whole, "chunked": ReplicaScheduler._schedule_chunked}
)


def scheduling_policy(name: str) -> Callable[[ReplicaScheduler], ScheduledBatch]:
    """The policy ``name``, else one error naming the known policies."""
    policy = SCHEDULING_POLICIES.get(name)
    if policy is None:
        raise DoolyError(f"unknown scheduling policy {name!r} (known: {', '.join(SCHEDULING_POLICIES)})")
    return policy

"""Serve a workload with the real engine (Hugging Face transformers, eager, on the CPU) and measure it.

The loop is the simulator's, with the clock made real: the same :class:`ReplicaScheduler` decides every
iteration (admission, chunks, KV blocks, preemption), then the iteration is *executed* on the model and
timed; requests join at their arrival time on that clock (wall time, or the serving thread's CPU time
on a shared machine: see :func:`serve`). So measured and simulated
runs differ only in where an iteration's latency comes from, which is what validation must isolate.

How one iteration runs on HF eager (what the predictor's ``Batch`` must describe):

* each prefill chunk is one forward of batch 1 over its new tokens, attending to its cached prefix;
* all decoding requests run together in one forward of batch B, each with one new token; their KV caches
  are padded to the longest one and the padding is masked out (as HF ``generate`` does for a batch).

KV lives in per-layer slot tensors ``[max_num_seqs, kv_heads, max_len, head_dim]`` (a request owns a slot,
like a vLLM block table without paging). Slots are kept compact, so a decode batch over every running
request is a view of the first B slots and costs no gather. Output lengths are forced: a request stops
after exactly its ``output_tokens`` tokens, whatever the (random-weight) model would emit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dooly.errors import DoolyError
from dooly.simulator.entities import IterationRecord, Request, ScheduledBatch
from dooly.simulator.metrics import RequestMetrics, Summary, summarize
from dooly.simulator.scheduler import ReplicaScheduler, SchedulerConfig
from dooly.simulator.workload import Workload


def build_model(config, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A causal LM with random weights from a transformers config object (tests; the CLI goes through the
    engine's own ``build_model`` so the served model is the one that was traced and profiled)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class HFExecutor:
    """Runs scheduled iterations on a transformers model, keeping each request's KV in a slot."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_len: int, seed: int = 0) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.model = model
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.cfg = cfg
        probe = DynamicCache(config=cfg)
        if any(type(layer) is not DynamicLayer for layer in probe.layers):
            raise DoolyError(
                f"{cfg.model_type}: serving validation supports full-attention models only "
                "(this one has sliding-window or other cache layers)"
            )
        self.num_layers = len(probe.layers)
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        dtype = next(model.parameters()).dtype
        shape = (max_num_seqs, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(self.num_layers)]
        self.max_len = max_len
        self.slot: dict[int, int] = {}  # request id -> slot, compact 0..n-1
        self.owner: list[int] = []  # slot -> request id
        self.rng = np.random.default_rng(seed)
        self.vocab = cfg.vocab_size
        self.tokens: dict[int, list[int]] = {}  # request id -> known token ids (prompt + generated)

    # -- slots ------------------------------------------------------------------------------------
    def _ensure_slot(self, req: Request) -> int:
        if req.id not in self.slot:
            if len(self.owner) == self.k[0].shape[0]:
                raise RuntimeError("more running requests than slots (max_num_seqs)")
            self.slot[req.id] = len(self.owner)
            self.owner.append(req.id)
        return self.slot[req.id]

    def release(self, req: Request) -> None:
        """Free a request's slot, moving the last slot into the hole so slots stay compact."""
        s = self.slot.pop(req.id, None)
        if s is None:
            return
        last = len(self.owner) - 1
        if s != last:
            moved = self.owner[last]
            for t in self.k + self.v:
                t[s].copy_(t[last])
            self.owner[s] = moved
            self.slot[moved] = s
        self.owner.pop()

    def _cache(self, slots: slice | torch.Tensor, length: int):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.cfg)
        for layer, k, v in zip(cache.layers, self.k, self.v, strict=True):
            kk = k[slots, :, :length] if isinstance(slots, slice) else k.index_select(0, slots)[:, :, :length]
            vv = v[slots, :, :length] if isinstance(slots, slice) else v.index_select(0, slots)[:, :, :length]
            layer.lazy_initialization(kk, vv)
            layer.keys, layer.values = kk, vv
        return cache

    # -- one iteration ----------------------------------------------------------------------------
    @torch.no_grad()  # as the engine (and generate()) runs, so the kernels are the profiled ones
    def run(self, batch: ScheduledBatch) -> None:
        for req, n in batch.prefill:
            self._prefill(req, n)
        if batch.decode:
            self._decode(batch.decode)

    def _known_tokens(self, req: Request) -> list[int]:
        toks = self.tokens.get(req.id)
        if toks is None:
            toks = self.rng.integers(0, self.vocab, req.prompt_tokens).tolist()
            self.tokens[req.id] = toks
        return toks

    def _prefill(self, req: Request, n: int) -> None:
        s = self._ensure_slot(req)
        c = req.computed
        if c + n > self.max_len:
            raise DoolyError(f"request {req.id} needs {c + n} cached tokens, above the engine's max_len {self.max_len}")
        ids = torch.tensor([self._known_tokens(req)[c : c + n]])
        pos = torch.arange(c, c + n)
        cache = self._cache(slice(s, s + 1), c)
        out = self.model(
            input_ids=ids,
            attention_mask=torch.ones(1, c + n, dtype=torch.long),  # the engine always passes a mask
            cache=cache,
            position_ids=pos[None],
            cache_position=pos,
            use_cache=True,
            logits_to_keep=1,
        )
        for layer, k, v in zip(cache.layers, self.k, self.v, strict=True):
            k[s, :, c : c + n] = layer.keys[0, :, c : c + n]
            v[s, :, c : c + n] = layer.values[0, :, c : c + n]
        if c + n == req.context_len:  # the prefill completes: this iteration samples a token
            self.tokens[req.id].append(int(out.logits[0, -1].argmax()))

    def _decode(self, reqs: list[Request]) -> None:
        reqs = sorted(reqs, key=lambda r: self.slot[r.id])
        slots = [self.slot[r.id] for r in reqs]
        lens = torch.tensor([r.computed for r in reqs])
        longest = int(lens.max())
        if longest + 1 > self.max_len:
            raise DoolyError(f"a request needs {longest + 1} cached tokens, above the engine's max_len {self.max_len}")
        b = len(reqs)
        contiguous = slots == list(range(slots[0], slots[0] + b))
        idx = slice(slots[0], slots[0] + b) if contiguous else torch.tensor(slots)
        cache = self._cache(idx, longest)
        mask = torch.zeros(b, longest + 1, dtype=torch.long)
        mask[:, longest] = 1
        mask[:, :longest] = (torch.arange(longest)[None, :] < lens[:, None]).long()
        ids = torch.tensor([[self.tokens[r.id][-1]] for r in reqs])
        out = self.model(
            input_ids=ids,
            cache=cache,
            attention_mask=mask,
            position_ids=lens[:, None],
            cache_position=torch.tensor([longest]),
            use_cache=True,
            logits_to_keep=1,
        )
        slot_t = torch.tensor(slots)
        for layer, k, v in zip(cache.layers, self.k, self.v, strict=True):
            k[slot_t, :, lens] = layer.keys[:, :, longest]
            v[slot_t, :, lens] = layer.values[:, :, longest]
        nxt = out.logits[:, -1].argmax(-1).tolist()
        for r, t in zip(reqs, nxt, strict=True):
            self.tokens[r.id].append(int(t))


@dataclass
class ServingResult:
    requests: list[Request]
    iterations: list[IterationRecord]
    metrics: RequestMetrics
    summary: Summary
    config: SchedulerConfig
    batches: list[ScheduledBatch]


def serve(
    workload: Workload,
    model: torch.nn.Module,
    config: SchedulerConfig,
    threads: int | None = None,
    warmup: bool = True,
    on_iteration: Callable[[IterationRecord], None] | None = None,
    clock: str = "wall",
) -> ServingResult:
    """Serve `workload` on `model` with `config`'s scheduling; per-request metrics on the engine's clock.

    ``clock="wall"``: requests arrive in real time and latencies are ``perf_counter`` differences, so other
    processes on the machine show up in them. ``clock="thread"``: each iteration is timed with the serving
    thread's CPU time (exact for a one-thread engine, where every kernel runs on that thread) and the run
    follows a virtual clock advanced by those durations, jumping over idle gaps to the next arrival: the
    timeline the engine would have on a core of its own. It matches profiles taken with the thread clock.
    """
    if clock not in ("wall", "thread"):
        raise DoolyError(f"unknown clock {clock!r} (wall or thread)")
    if threads is not None:
        torch.set_num_threads(threads)
    max_len = int((workload.prompt + workload.output).max()) + 1
    if warmup:  # first calls allocate and pick kernels; keep them out of the measurement
        _warm(model, config, max_len)
    executor = HFExecutor(model, config.max_num_seqs, max_len)
    sched = ReplicaScheduler(config)
    requests = workload.requests()
    pending = list(reversed(requests))  # pop() yields the earliest arrival
    iterations: list[IterationRecord] = []
    batches: list[ScheduledBatch] = []
    t0 = time.perf_counter()
    virtual = 0.0
    while pending or sched.has_work:
        now = time.perf_counter() - t0 if clock == "wall" else virtual
        while pending and pending[-1].arrival <= now:
            sched.add(pending.pop())
        if not sched.has_work:
            if clock == "wall":
                time.sleep(max(0.0, pending[-1].arrival - now))
            else:
                virtual = pending[-1].arrival
            continue
        batch = sched.schedule()
        for req in batch.preempted:
            executor.release(req)
        for req, _ in batch.prefill:
            if req.first_scheduled is None:
                req.first_scheduled = now
        c0 = time.thread_time()
        executor.run(batch)
        if clock == "wall":
            end = time.perf_counter() - t0
        else:
            virtual = end = now + (time.thread_time() - c0)
        rec = IterationRecord.of(batch, sched.kv, 0, now, end)
        iterations.append(rec)
        batches.append(_snapshot(batch))
        if on_iteration is not None:
            on_iteration(rec)
        for req in sched.complete(batch, end):
            executor.release(req)
    metrics = RequestMetrics.from_requests(requests)
    return ServingResult(requests, iterations, metrics, summarize(metrics, iterations), config, batches)


def _snapshot(batch: ScheduledBatch) -> ScheduledBatch:
    """Freeze what the predictor would see for this iteration (requests keep mutating afterwards)."""

    def copy(r: Request) -> Request:
        return Request(r.id, r.arrival, r.prompt_tokens, r.output_tokens, computed=r.computed)

    return ScheduledBatch(prefill=[(copy(r), n) for r, n in batch.prefill], decode=[copy(r) for r in batch.decode])


def _warm(model: torch.nn.Module, config: SchedulerConfig, max_len: int) -> None:
    w = Workload(np.zeros(2), np.array([min(32, max_len - 4)] * 2), np.array([3, 3]), name="warmup")
    ex = HFExecutor(model, max(2, config.max_num_seqs), max_len)
    sched = ReplicaScheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4 * max_len))
    for r in w.requests():
        sched.add(r)
    while sched.has_work:
        b = sched.schedule()
        ex.run(b)
        for r in sched.complete(b, 0.0):
            ex.release(r)


def average_runs(runs: list[ServingResult]) -> ServingResult:
    """The first run, with each request's TTFT, TPOT and end-to-end latency the median over all runs.

    Runs of one workload schedule the same requests; what moves between them is the machine's speed, which
    a single run would leave in the measurement the simulator is scored against.
    """
    import dataclasses

    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    med = {k: np.median(np.stack([getattr(r.metrics, k) for r in runs]), axis=0) for k in ("ttft", "tpot", "e2e")}
    return dataclasses.replace(first, metrics=dataclasses.replace(first.metrics, **med))


def run_to_run(runs: list[ServingResult]) -> dict[str, float]:
    """Per-request spread (%) of TTFT and TPOT between real runs of the same workload: the noise floor.

    For each request, (max - min) / mean over the runs, averaged over requests; with two runs this is the
    symmetric percentage difference. NaN with one run.
    """
    out: dict[str, float] = {}
    for k in ("ttft", "tpot"):
        if len(runs) < 2:
            out[k] = float("nan")
            continue
        x = np.stack([getattr(r.metrics, k) for r in runs])
        ok = np.isfinite(x).all(axis=0) & (x.mean(axis=0) > 0)
        spread = (x.max(axis=0) - x.min(axis=0))[ok] / x.mean(axis=0)[ok]
        out[k] = float(spread.mean() * 100) if ok.any() else float("nan")
    return out


@dataclass
class Validation:
    """Simulated vs measured serving of one workload, plus the predictor's error on the measured iterations."""

    measured: ServingResult
    simulated: object  # SimulationResult
    rows: list[dict[str, float | str]]  # one per metric: measured/simulated p50 and mean, per-request MAPE
    iteration_mape: float  # predictor vs measured latency of the very iterations that ran

    def table(self) -> list[dict[str, float | str]]:
        return self.rows


def compare(measured: ServingResult, simulated, latency) -> Validation:
    """Line up measured and simulated per-request TTFT and TPOT (same request ids) and score them."""
    from dooly.simulator.metrics import mape

    rows: list[dict[str, float | str]] = []
    for name in ("ttft", "tpot"):
        m = getattr(measured.metrics, name)
        s = getattr(simulated.metrics, name)
        ok = np.isfinite(m) & np.isfinite(s)
        rows.append(
            {
                "metric": name.upper(),
                "measured_p50": float(np.median(m[ok])) if ok.any() else float("nan"),
                "simulated_p50": float(np.median(s[ok])) if ok.any() else float("nan"),
                "measured_mean": float(m[ok].mean()) if ok.any() else float("nan"),
                "simulated_mean": float(s[ok].mean()) if ok.any() else float("nan"),
                "mape_pct": mape(s, m),
            }
        )
    for row in rows:
        row["p50_err_pct"] = abs(row["simulated_p50"] - row["measured_p50"]) / row["measured_p50"] * 100
        row["mean_err_pct"] = abs(row["simulated_mean"] - row["measured_mean"]) / row["measured_mean"] * 100
    pred = np.array([latency.iteration_latency(b.to_batch()) for b in measured.batches])
    meas = np.array([it.end - it.start for it in measured.iterations])
    return Validation(measured, simulated, rows, mape(pred, meas))

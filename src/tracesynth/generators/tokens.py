"""What the token generators (masked diffusion, `tracesynth.generators.masked`; autoregressive,
`tracesynth.generators.ar`) share: the channel tokens, the network body, training, chained
sampling, decoding back to a Trace, and storage.

Every channel is a token: event type, cpu, per-window thread label, command, return-value bucket
(from `ChannelCodec`) and the gap to the previous event as a quarter-log2 bucket; a gap bucket
decodes to a gap drawn from the training trace's gaps of that bucket and event type. A model
fills windows of `context` events; long traces are chains of windows, each conditioned on the last
`overlap` events of the one before, so threads and open syscalls carry across window boundaries.
With `conditional`, one model learns several workloads (the traces' `workload` metadata): a learned
vector per workload is added at every position, and sample(..., workload=NAME) draws that one.
A subclass gives its network (`_network`), its training loss (`loss`) and how it fills the unknown
events of a window (`_fill`).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from atomicio import atomic_path
from tracesynth.bounds import SampleProgress, check_sample_size
from tracesynth.buckets import log2_bucket
from tracesynth.channels import CHANNELS_2, CHANNELS_6, OTHER_NEGATIVE, UNKNOWN_EVENT, ChannelCodec
from tracesynth.errors import TraceSynthError
from tracesynth.generators.distributed import (
    agree_elapsed,
    gather_ints,
    init_distributed,
    is_main_process,
    processes,
    wrap_ddp,
)
from tracesynth.generators.guide import GUIDES, KernelFacts, KernelGuide, mine_kernel_facts
from tracesynth.integrity import HASHES, check_shapes, file_hashes, verify_hashes
from tracesynth.optim import resolve_device, warmup_cosine, world
from tracesynth.trace import Trace

CHANNELS = CHANNELS_6  # event, dt, cpu, tid, comm, ret: all tokens here
CHANNELS_BLANK = tuple(c for c in CHANNELS_6 if c not in CHANNELS_2)  # null under channels=2
DT_PER_OCTAVE = 4  # gap buckets per factor of two
N_DT = DT_PER_OCTAVE * 40 + 1  # covers gaps up to 2**40 ns (~18 min); larger gaps share the last bucket
GAPS_PER_CELL = 16  # real gaps kept per (event, gap bucket) to decode from
SEAM_TRIM = 32  # events a chain may give up at its end so that the next chain's first event can follow it
FINAL_LOSSES = 50  # the last steps' losses whose mean is history["final_loss"]
TRAIN_STATE = "train_state.safetensors"  # optimizer and RNG states of a checkpoint (TokenModel.fit)
TENSOR_FILES = ("model.safetensors", "gaps.safetensors", TRAIN_STATE)


@dataclass
class TokenConfig:
    """What the token models' configs share. Each kind's config (`ARConfig`, `MaskedConfig`) sets its own network
    and optimiser defaults, the ones `tracesynth fit` and a pipeline config's {"kind": ...} both get."""

    context: int = 256
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.0
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 100
    steps: int = 1000
    time_limit: float | None = None  # seconds of training; stops before `steps` when reached
    overlap: int | None = None  # events of the previous window each new window is conditioned on (context // 4)
    chains: int = 8  # independent chains sampled in parallel
    temperature: float = 1.0
    max_tids: int = 32
    conditional: bool = False  # learn one vector per workload (trace metadata "workload"); sample(workload=)
    seed: int = 0
    device: str = "cpu"  # where fit trains (cpu, cuda, cuda:N); the fitted network returns to the CPU to sample
    # 6: event, dt, cpu, tid, comm, ret; 2: event and dt alone (the paper's ablation): the other four are learned
    # as their null token, so the network is the same and a sample has no cpu, thread, command or return value
    channels: int = 6

    what: ClassVar[str] = "token model"  # for error messages

    def _checks(self) -> dict[str, bool]:
        return {
            "context >= 16": self.context >= 16,
            "d_model > 0 and divisible by n_heads": self.n_heads > 0
            and self.d_model > 0
            and self.d_model % self.n_heads == 0,
            "n_layers > 0": self.n_layers > 0,
            "batch_size > 0": self.batch_size > 0,
            "steps >= 0": self.steps >= 0,
            "0 <= overlap < context": 0 <= self.overlap < self.context,
            "chains > 0": self.chains > 0,
            "temperature > 0": self.temperature > 0,
            "channels 2 or 6": self.channels in (2, 6),
        }

    def __post_init__(self) -> None:
        if self.overlap is None:
            self.overlap = self.context // 4
        bad = [k for k, ok in self._checks().items() if not ok]
        if bad:
            raise TraceSynthError(f"{self.what} config: need {', '.join(bad)}")


def _global_labels(win_tid: np.ndarray, tail_glob: np.ndarray | None, next_label: np.ndarray) -> np.ndarray:
    """Per-window labels [b, L] -> chain-global labels: those of the overlap (the window's first
    len(tail_glob) events) keep theirs, a new one gets the chain's next label (next_label grows)."""
    chains, L = win_tid.shape
    glob = np.zeros((chains, L), dtype=np.int64)
    for b in range(chains):
        mapping: dict[int, int] = {}
        if tail_glob is not None:
            for lab, g in zip(win_tid[b, : tail_glob.shape[1]], tail_glob[b], strict=True):
                mapping.setdefault(int(lab), int(g))
        for j in range(L):
            lab = int(win_tid[b, j])
            if lab <= 0:
                continue
            if lab not in mapping:
                mapping[lab] = int(next_label[b])
                next_label[b] += 1
            glob[b, j] = mapping[lab]
    return glob


def _seam_ends(events: np.ndarray, n_types: int) -> np.ndarray:
    """Per chain [b, n]: how many of its events to keep so that the next chain's first event follows its last
    one as some event follows another inside the chains (a chain is dropped from its end, which keeps it a valid
    run of the kernel; without this, each seam was a transition never seen in training, which repair paid for
    many times over); at most SEAM_TRIM events go, and a seam no cut mends is left as it is."""
    b, n = events.shape
    ends = np.full(b, n, dtype=np.int64)
    seen = np.zeros((n_types, n_types), dtype=bool)
    seen[events[:, :-1], events[:, 1:]] = True
    for k in range(b - 1):
        first = events[k + 1, 0]
        for end in range(n, max(1, n - SEAM_TRIM) - 1, -1):
            if seen[events[k, end - 1], first]:
                ends[k] = end
                break
    return ends


WARM_START_SAME = ("context", "d_model", "n_layers", "n_heads", "max_tids", "channels")  # fit(init=) keeps these
_UNKNOWN_TOKEN = {"event": UNKNOWN_EVENT, "cpu": UNKNOWN_EVENT, "comm": UNKNOWN_EVENT, "ret": OTHER_NEGATIVE}


def _row_sources(new: Sequence[str], old: Sequence[str], unknown: str | None) -> list[list[int]]:
    """For each token of `new`, the rows of `old` whose mean it starts from (`TokenModel._warm_start`)."""
    index = {name: i for i, name in enumerate(old)}
    out = []
    for name in new:
        if name in index:
            out.append([index[name]])
            continue
        parts, rows = name.split("_"), []
        for k in range(len(parts) - 1, 0, -1):
            prefix = "_".join(parts[:k]) + "_"
            rows = [i for i, o in enumerate(old) if o.startswith(prefix)]
            if rows:
                break
        if not rows and unknown is None:
            raise TraceSynthError(f"no token {name!r} in the model to start from")
        out.append(rows or [index[unknown]])
    return out


def _first_line(exc: BaseException) -> str:
    """An exception's message up to its first line break (torch appends C++ stack frames to some)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def dt_bucket(gaps_ns: np.ndarray) -> np.ndarray:
    """Quarter-octave bucket of each gap: 0 for a zero gap, then 1 + floor(4 * log2(gap))."""
    g = np.asarray(gaps_ns, dtype=np.float64)
    return np.where(g <= 0, 0, np.clip(1 + log2_bucket(g, DT_PER_OCTAVE), 1, N_DT - 1))


def _gaps(ts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.diff(ts)]).astype(np.int64) if len(ts) else np.zeros(0, np.int64)


def _restore(state: dict[str, Any], opt: torch.optim.Optimizer, rng: np.random.Generator, dev: torch.device) -> None:
    """Put a training state's optimizer and RNG states back (`TokenModel._snapshot` took them)."""
    meta, tensors = state["meta"], state["tensors"]
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for name, v in tensors.items():
        if name.startswith("opt."):
            _, i, key = name.split(".", 2)
            per_param.setdefault(int(i), {})[key] = v
    try:
        opt.load_state_dict({"state": per_param, "param_groups": meta["param_groups"]})
        rng.bit_generator.state = meta["numpy_rng"]
    except (ValueError, TypeError, KeyError) as exc:
        raise TraceSynthError(f"cannot resume: bad training state ({type(exc).__name__}: {exc})") from None
    torch.set_rng_state(tensors["rng.torch"])
    if dev.type == "cuda" and "rng.cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng.cuda"], dev)


class _Loss(nn.Module):
    """A token model's training loss as a module over its network: DDP must run the forward that uses the
    parameters (the block model's loss calls the network's methods, not its forward)."""

    def __init__(self, net: nn.Module, loss: Callable[[dict[str, torch.Tensor]], torch.Tensor]):
        super().__init__()
        self.net = net
        self.compute = loss

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.compute(batch)


class ChannelTransformer(nn.Module):
    """Summed channel embeddings (+ [MASK] per channel) + positions -> transformer -> hidden [b, L, d]."""

    def __init__(self, cfg: TokenConfig, vocab: dict[str, int], n_workloads: int = 0):
        super().__init__()
        self.vocab = dict(vocab)
        d = cfg.d_model
        self.workload = nn.Embedding(n_workloads, d) if n_workloads else None
        # ModuleDict keys are prefixed: "cpu" would clash with nn.Module.cpu
        self.embed = nn.ModuleDict({f"c_{c}": nn.Embedding(v + 1, d) for c, v in vocab.items()})  # id v = [MASK]
        self.pos = nn.Parameter(torch.randn(cfg.context, d) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d, cfg.n_heads, 4 * d, cfg.dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.body = nn.TransformerEncoder(layer, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.heads = nn.ModuleDict({f"c_{c}": nn.Linear(d, v) for c, v in vocab.items()})
        # small embeddings (as GPT-2): with nn.Embedding's N(0, 1) the six summed channel embeddings drown
        # the positions, and a model that cannot see positions cannot learn event order
        for e in self.embed.values():
            nn.init.normal_(e.weight, std=0.02)

    def embed_tokens(self, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(self.embed[f"c_{c}"](tokens[c]) for c in self.vocab)

    def condition(self, x: torch.Tensor, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [b, n, d] plus the vector of each window's workload (tokens["workload"], [b]) if conditional."""
        return x if self.workload is None else x + self.workload(tokens["workload"])[:, None]

    def encode(self, x: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """Hidden states of embedded inputs x [b, L, d] (each position sees only earlier ones if causal)."""
        x = x + self.pos[: x.shape[1]]
        if causal:
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
            return self.norm(self.body(x, mask=mask, is_causal=True))
        return self.norm(self.body(x))


class TokenModel:
    """Generator (fit / sample / save / load) over token windows; subclasses give the network and the fill."""

    name = "token"
    format = "tracesynth-token"
    config_cls: type[TokenConfig] = TokenConfig
    guides: ClassVar[bool] = False  # whether _fill takes a KernelGuide (sample(guide="kernel"))
    skips_parameters: ClassVar[bool] = False  # whether a step's loss may leave a parameter unused (DDP must look)
    contents: ClassVar[tuple[str, ...]] = ("config.json", "vocab.json", "*.safetensors")  # what save() writes

    def __init__(self, config: TokenConfig | None = None):
        self.config = config or self.config_cls()
        self.codec: ChannelCodec | None = None
        self.model: nn.Module | None = None
        self.gap_table: dict[str, np.ndarray] = {}
        self.seen: dict[str, torch.Tensor] = {}  # per channel: which tokens occur in training (only those are drawn)
        self.workloads: list[str] = []  # the workloads a conditional model learned, by index
        self.kernel = KernelFacts()  # what the training data decided about the kernel invariants (the guide's)
        self.history: dict[str, Any] = {}
        self._train_state: dict[str, Any] | None = None  # {"meta": JSON-able, "tensors": {...}}: TokenModel.fit

    # -- what a subclass gives ----------------------------------------------------------------
    def _network(self) -> nn.Module:
        raise NotImplementedError

    def loss(self, clean: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def _fill(
        self, tokens: dict[str, torch.Tensor], known: torch.Tensor, gen: torch.Generator, guide: KernelGuide | None
    ) -> None:
        """Fill every event not `known` ([b, L]; known events are a prefix of each window), in place,
        with `guide` masking each draw (only where the class `guides`)."""
        raise NotImplementedError

    # -- sizes --------------------------------------------------------------------------------
    @property
    def n_params(self) -> int | None:
        """Weights of the network (None before fit/load)."""
        return None if self.model is None else int(sum(p.numel() for p in self.model.parameters()))

    @property
    def fit_info(self) -> dict[str, Any]:
        """Optimisation steps done (a time-limited fit stops early), training windows and events seen."""
        h = self.history
        return {
            "train_steps": h.get("steps"),
            "train_windows": h.get("windows"),
            "train_seconds": h.get("train_seconds"),
            "train_events_per_s": h.get("train_events_per_s"),
        }

    # -- data ---------------------------------------------------------------------------------
    @property
    def vocab(self) -> dict[str, int]:
        assert self.codec is not None
        sizes = self.codec.vocab_sizes
        return {c: (N_DT if c == "dt" else sizes[c]) for c in CHANNELS}

    def _tokens(self, trace: Trace) -> dict[str, np.ndarray]:
        enc = self.codec.encode(trace)
        enc["dt"] = dt_bucket(_gaps(trace.ts))
        if self.config.channels == 2:  # only event and dt carry the trace; the rest is null (tid -1: no thread)
            enc.update({c: np.full(len(trace), -1 if c == "tid" else 0, dtype=np.int64) for c in CHANNELS_BLANK})
        return enc

    def _workload_of(self, trace: Trace) -> str:
        name = trace.metadata.get("workload")
        if not isinstance(name, str) or not name:
            raise TraceSynthError(
                f"{self.config.what}: conditional training needs each trace's workload name (metadata 'workload')"
            )
        return name

    def windows(self, traces: Sequence[Trace], stride: int | None = None) -> dict[str, np.ndarray]:
        """Token windows [n, context] of every trace (cut inside a trace, never across traces);
        a conditional model's also carry each window's workload index ("workload", [n])."""
        L = self.config.context
        stride = stride or L // 2
        parts: list[dict[str, np.ndarray]] = []
        for t in traces:
            n = len(t)
            if n < L:
                continue
            enc = self._tokens(t)
            starts = np.arange(0, n - L + 1, stride)
            idx = starts[:, None] + np.arange(L)[None, :]
            w = {c: enc[c][idx] for c in CHANNELS}
            w["tid"] = self.codec.relabel_tids(w["tid"])
            if self.config.conditional:
                w["workload"] = np.full(len(starts), self.workloads.index(self._workload_of(t)), dtype=np.int64)
            parts.append(w)
        if not parts:
            raise TraceSynthError(f"no trace has {L} events (the context); give longer traces or a smaller context")
        return {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}

    def _fit_gap_table(self, traces: Sequence[Trace], rng: np.random.Generator) -> None:
        """Up to GAPS_PER_CELL real gaps per (event token, gap bucket), as sorted CSR arrays."""
        ev = np.concatenate([self.codec.encode(t)["event"] for t in traces])
        gaps = np.concatenate([_gaps(t.ts) for t in traces])
        key = ev * N_DT + dt_bucket(gaps)
        order = np.lexsort((rng.random(len(key)), key))  # random order within each key
        key, gaps = key[order], gaps[order]
        uniq, first, counts = np.unique(key, return_index=True, return_counts=True)
        take = np.minimum(counts, GAPS_PER_CELL)
        rows = np.concatenate([np.arange(f, f + k) for f, k in zip(first, take, strict=True)])
        self.gap_table = {
            "keys": uniq.astype(np.int64),
            "offsets": np.concatenate([[0], np.cumsum(take)]).astype(np.int64),
            "gaps": gaps[rows].astype(np.int64),
        }

    def decode_gaps(self, events: np.ndarray, buckets: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A real gap of the same event type and bucket; a log-uniform draw in the bucket if none was seen."""
        keys, off, vals = self.gap_table["keys"], self.gap_table["offsets"], self.gap_table["gaps"]
        key = events.astype(np.int64) * N_DT + buckets
        i = np.clip(np.searchsorted(keys, key), 0, len(keys) - 1)
        seen = keys[i] == key
        lo, n = off[i], off[i + 1] - off[i]
        pick = vals[np.minimum(lo + (rng.random(len(key)) * n).astype(np.int64), len(vals) - 1)]
        lo_log = (buckets - 1 + rng.random(len(key))) / DT_PER_OCTAVE
        drawn = np.where(buckets == 0, 0, np.rint(np.exp2(np.minimum(lo_log, 62.0)))).astype(np.int64)
        return np.where(seen & (n > 0), pick, drawn)

    # -- training -----------------------------------------------------------------------------
    def fit(
        self,
        traces: Sequence[Trace],
        progress: Callable[[int, float], None] | None = None,
        init: TokenModel | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = 200,
        resume: bool = False,
    ) -> TokenModel:
        """Learn vocabularies, gap table and the network; stops at `steps` or `time_limit` seconds.

        With `init` (a fitted model of this class and network size, e.g. the shipped checkpoint), the network
        starts from its weights rather than random ones (`_warm_start`); the vocabularies, gap table and kernel
        facts are still this data's own.

        With `checkpoint_dir`, the model is saved there every `checkpoint_every` steps with its training state
        (`TRAIN_STATE`: optimizer, numpy and torch RNG states, step, seconds trained, the recent losses); such a
        checkpoint loads and samples like any saved model. `resume=True` (on a model loaded from a checkpoint)
        continues that training on the same traces: a killed and resumed fit ends where an unkilled one would,
        at the same step with the same weights, and `time_limit` counts the seconds of both runs. The model keeps
        its training state after fit and `save` writes it, so a finished fit can be resumed to more `steps`;
        a model saved without one (the shipped models/all) can only be a fit's `init`.

        Under torchrun (WORLD_SIZE > 1) each process draws its own batches and DDP averages the gradients (gloo on
        the CPU, nccl on a GPU); the processes stop at the same step, and only rank 0 writes checkpoints."""
        cfg = self.config
        if not traces or not sum(len(t) for t in traces):
            raise TraceSynthError(f"{self.config.what}: no events to learn from")
        start = self._resume_state(init) if resume else None
        if init is not None:
            self._check_init(init)
        if checkpoint_dir is not None and checkpoint_every <= 0:
            raise TraceSynthError(f"{cfg.what}: checkpoint_every must be > 0, got {checkpoint_every}")
        torch.manual_seed(cfg.seed)
        rng = np.random.default_rng(cfg.seed)
        saved = (self.codec.dumps(), list(self.workloads)) if start is not None else None
        self.codec = ChannelCodec.fit(traces, CHANNELS, max_tids=cfg.max_tids)
        self.workloads = sorted({self._workload_of(t) for t in traces}) if cfg.conditional else []
        if saved is not None and saved != (self.codec.dumps(), self.workloads):
            raise TraceSynthError(
                f"{cfg.what}: cannot resume: these traces' vocabulary differs from the "
                "checkpoint's (resume on the traces it was fitted on)"
            )
        self._fit_gap_table(traces, rng)
        if self.guides:
            self.kernel = mine_kernel_facts(traces)
        dev = resolve_device(cfg.device)
        data = {c: torch.from_numpy(v) for c, v in self.windows(traces).items()}
        self.seen = {c: torch.bincount(data[c].reshape(-1), minlength=v) > 0 for c, v in self.vocab.items()}
        data = {c: v.to(dev) for c, v in data.items()}
        if start is None:
            self.model = self._network()
            if init is not None:
                self._warm_start(init)
        self.model.to(dev)
        opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.98))
        if start is not None:
            _restore(start, opt, rng, dev)
        save = None if checkpoint_dir is None else (Path(checkpoint_dir), checkpoint_every)
        self._train(data, opt, rng, start, progress, save)
        return self

    def _resume_state(self, init: TokenModel | None) -> dict[str, Any]:
        """The training state fit(resume=True) continues from (a loaded checkpoint's)."""
        if init is not None:
            raise TraceSynthError(f"{self.config.what}: resume continues the checkpoint's network; it takes no init")
        if self._train_state is None or self.model is None:
            raise TraceSynthError(
                f"{self.config.what}: no training state to resume from (a model written by fit "
                "with checkpoints has one; start from another model's weights with init)"
            )
        state = self._train_state
        if state["meta"]["step"] >= self.config.steps:
            raise TraceSynthError(
                f"{self.config.what}: already trained for {state['meta']['step']} steps; ask for more steps"
            )
        return state

    def _train(
        self,
        data: dict[str, torch.Tensor],
        opt: torch.optim.Optimizer,
        rng: np.random.Generator,
        start: dict[str, Any] | None,
        progress: Callable[[int, float], None] | None,
        save: tuple[Path, int] | None,
    ) -> None:
        """The optimisation loop, from step 0 or from the training state `start`; `save`: (directory, every).

        Under torchrun (DDP) every rank runs it from the same state and stops at the same step; only rank 0 saves."""
        cfg = self.config
        dev = next(self.model.parameters()).device
        distributed = init_distributed(dev)
        n = len(data["event"])
        before = start["meta"] if start is not None else {"step": 0, "seconds": 0.0, "losses": []}
        step, losses = int(before["step"]), [float(x) for x in before["losses"]]
        t0 = time.perf_counter() - float(before["seconds"])  # a resumed fit's time limit counts both runs
        run_loss: Callable[[dict[str, torch.Tensor]], torch.Tensor] = self.loss
        if distributed:  # each rank draws its own windows: the global batch is processes x batch_size
            rng = self._rank_streams(step)
            run_loss = wrap_ddp(_Loss(self.model, self.loss), dev, find_unused=self.skips_parameters)
        self.model.train()
        while step < cfg.steps:
            elapsed = time.perf_counter() - t0
            if cfg.time_limit is not None:
                elapsed = agree_elapsed(elapsed, distributed, dev)  # every rank stops at the same step
                if elapsed >= cfg.time_limit:
                    break
            lr = warmup_cosine(cfg.lr, step, cfg.warmup, cfg.steps, cfg.time_limit, elapsed)
            for g in opt.param_groups:
                g["lr"] = lr
            idx = torch.from_numpy(rng.integers(0, n, cfg.batch_size)).to(dev)
            loss = run_loss({c: v[idx] for c, v in data.items()})
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            opt.step()
            step += 1
            losses = [*losses[-(FINAL_LOSSES - 1) :], loss.item()]  # final_loss is their mean
            if save is not None and step % save[1] == 0 and step < cfg.steps:
                self._snapshot(opt, rng, step, time.perf_counter() - t0, losses, n)
                if is_main_process():
                    self.save(save[0])
            if progress is not None:
                progress(step, losses[-1])
        self._snapshot(opt, rng, step, time.perf_counter() - t0, losses, n)
        if distributed:  # the saved history shows that every rank stopped at the same step
            self.history["rank_steps"] = gather_ints(step, dev)
        self.model.eval().cpu()  # sampling draws one event at a time: the CPU's work

    def _rank_streams(self, step: int) -> np.random.Generator:
        """Under DDP, this rank's batch (numpy) and mask (torch) streams, seeded by (seed, rank, step): the ranks
        draw different windows and masks, though every rank resumes from rank 0's checkpointed states."""
        seed, rank = self.config.seed, world()[0]
        torch.manual_seed(seed * 1000003 + rank * 7919 + step)
        return np.random.default_rng([abs(seed), rank, step])

    def _snapshot(
        self,
        opt: torch.optim.Optimizer,
        rng: np.random.Generator,
        step: int,
        seconds: float,
        losses: list[float],
        windows: int,
    ) -> None:
        """Set history and the training state to those after `step`."""
        cfg = self.config
        procs = processes()
        self.history = {
            "steps": step,
            "train_seconds": seconds,
            "windows": windows,
            # events through the network per second of training (each step: batch_size windows of context)
            "train_events_per_s": step * cfg.batch_size * cfg.context * procs / max(seconds, 1e-9),
            "final_loss": float(np.mean(losses)) if losses else None,
        }
        if procs > 1:  # under torchrun: the batches were processes x batch_size windows
            self.history["processes"] = procs
        sd = opt.state_dict()
        tensors = {
            f"opt.{i}.{k}": torch.as_tensor(v).detach().cpu().clone()
            for i, st in sd["state"].items()
            for k, v in st.items()
        }
        tensors["rng.torch"] = torch.get_rng_state()
        dev = next(self.model.parameters()).device
        if dev.type == "cuda":
            tensors["rng.cuda"] = torch.cuda.get_rng_state(dev)
        meta = {
            "step": step,
            "seconds": seconds,
            "losses": list(losses),
            "numpy_rng": rng.bit_generator.state,
            "param_groups": sd["param_groups"],
        }
        self._train_state = {"meta": meta, "tensors": tensors}

    def token_names(self, channel: str) -> list[str]:
        """What each token of a channel stands for (dt: its gap bucket)."""
        return [str(i) for i in range(N_DT)] if channel == "dt" else self.codec.token_names(channel)

    def _check_init(self, init: TokenModel) -> None:
        if type(init) is not type(self) or init.model is None:
            raise TraceSynthError(f"{self.config.what}: can only start from a fitted {self.name} model, "
                                  f"not a {getattr(init, 'name', type(init).__name__)} one")  # fmt: skip
        differ = [f"{k} {getattr(self.config, k)} vs {getattr(init.config, k)}" for k in WARM_START_SAME
                  if getattr(self.config, k) != getattr(init.config, k)]  # fmt: skip
        if differ:
            raise TraceSynthError(f"{self.config.what}: the network must be the size of the one it starts from "
                                  f"({', '.join(differ)})")  # fmt: skip

    def _warm_start(self, init: TokenModel) -> None:
        """Set the new network's weights from `init`'s: the transformer as it is, and each token's rows of the
        embedding and output tables from the same token of `init` (by what it stands for, `token_names`: the
        token ids of two vocabularies differ). A token `init` never learned starts as the mean of its family
        there (the tokens sharing its longest `_`-prefix: a new syscall_entry_X as the average syscall entry),
        else as `init`'s unknown token. A conditional `init`'s workload vectors go to the workloads of the same
        name, a new workload gets their mean; without conditioning that mean is added to the positions (it was
        added at every position), so the network starts computing what `init` computed."""
        old, new = init.model.state_dict(), self.model.state_dict()
        sources = {c: _row_sources(self.token_names(c), init.token_names(c), _UNKNOWN_TOKEN.get(c)) for c in CHANNELS}
        w_old = old.get("workload.weight")
        out = {}
        for key, t in new.items():
            table = re.fullmatch(r"(embed|given|heads)\.c_(\w+)\.(weight|bias)", key)
            if table:
                rows = sources[table[2]]
                if table[1] == "embed":  # its last row is the [MASK] token
                    rows = [*rows, [old[key].shape[0] - 1]]
                out[key] = torch.stack([old[key][r].mean(0) for r in rows])
            elif key == "workload.weight":
                mean = w_old.mean(0) if w_old is not None else torch.zeros(t.shape[1])
                mine = {w: i for i, w in enumerate(init.workloads)}
                out[key] = torch.stack([w_old[mine[w]] if w in mine else mean for w in self.workloads])
            elif key in old and old[key].shape == t.shape:
                out[key] = old[key].clone()
            else:
                raise TraceSynthError(f"{self.config.what}: the model to start from has no weight {key} of shape "
                                      f"{tuple(t.shape)}")  # fmt: skip
        if w_old is not None and "workload.weight" not in new:
            out["pos"] = out["pos"] + w_old.mean(0)
        self.model.load_state_dict(out)

    # -- sampling -----------------------------------------------------------------------------
    def sample(
        self,
        n_events: int,
        seed: int = 0,
        workload: str | None = None,
        guide: str | None = None,
        progress: bool = False,
    ) -> Trace:
        """A synthetic trace of n_events: `chains` chains of overlapping windows, each cut where the next one's first
        event can follow it (`_seam_ends`), concatenated. `progress` shows a bar (events done, time left) on stderr
        once the sample has run a few seconds; n_events that would not fit in memory is refused before any work.

        A conditional model draws `workload` (one it learned; None: chain b draws workload b mod their number).
        `guide` "kernel" masks each draw with the kernel invariants (`tracesynth.generators.guide`; a generator with
        `guides`), "none" samples the network alone; None: the config's `guide` ("none" if it has none).
        """
        if self.model is None:
            raise TraceSynthError(f"{self.config.what}: sample() before fit()")
        if workload is not None and workload not in self.workloads:
            known = f"it knows {', '.join(self.workloads)}" if self.workloads else "it is not conditional"
            raise TraceSynthError(f"{self.config.what}: no workload {workload!r} ({known})")
        guide = guide or getattr(self.config, "guide", "none")
        can_guide = self.guides and self.config.channels == 6  # the guide reads the cpu and thread channels
        if guide not in GUIDES or (guide != "none" and not can_guide):
            can = ", ".join(GUIDES) if can_guide else "none"
            raise TraceSynthError(f"{self.config.what}: no guide {guide!r} (it can take {can})")
        check_sample_size(n_events, self.name)
        chains = self.chains_for(n_events)
        gen = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        with SampleProgress(n_events, progress) as bar:
            seqs, kernel = self._draw_chains(n_events, chains, workload, guide, gen, bar)
        ends = _seam_ends(seqs["event"], self.vocab["event"])
        if kernel is not None:  # with the switches that hand a CPU from one chain's thread to the next one's
            flat = kernel.join_chains(seqs, ends)
        else:
            flat = {c: np.concatenate([v[b, : ends[b]] for b in range(chains)]) for c, v in seqs.items()}
        flat = {c: v[:n_events] for c, v in flat.items()}
        gaps = self.decode_gaps(flat["event"], flat["dt"], rng)
        windows = dict(flat)
        windows["dt"] = (np.log1p(gaps.astype(np.float64)) - self.codec.dt_mean) / self.codec.dt_std
        codec = replace(self.codec, dt_max_log=64.0)  # the gaps are real ones already: no clipping
        meta = {"generator": self.name, "seed": seed, "guide": guide, **({"workload": workload} if workload else {})}
        return codec.decode(windows, metadata=meta)

    def _draw_chains(
        self, n_events: int, chains: int, workload: str | None, guide: str, gen: torch.Generator, bar: SampleProgress
    ) -> tuple[dict[str, np.ndarray], KernelGuide | None]:
        """Each chain's tokens [chains, per chain] (tid: labels unique across chains), drawn window after window,
        each conditioned on the last `overlap` events of the one before; and the guide that masked the draws."""
        cfg = self.config
        L, K = cfg.context, cfg.overlap
        per_chain = math.ceil(n_events / chains) + (SEAM_TRIM if chains > 1 else 0)
        n_windows = 1 + max(0, math.ceil((per_chain - L) / (L - K)))
        out = {c: [] for c in CHANNELS}
        tokens = {c: torch.zeros(chains, L, dtype=torch.long) for c in CHANNELS}
        if self.workloads:
            which = [self.workloads.index(workload)] * chains if workload else np.arange(chains) % len(self.workloads)
            tokens["workload"] = torch.as_tensor(which, dtype=torch.long)
        known = torch.zeros(chains, L, dtype=torch.bool)
        labels = np.zeros((chains, 0), dtype=np.int64)  # chain-global thread label of each emitted event
        next_label = np.ones(chains, dtype=np.int64)
        kernel = KernelGuide(self.codec, self.kernel, chains, L) if guide == "kernel" else None
        for w in range(n_windows):
            if kernel is not None:
                kernel.start_window(tokens["tid"][:, :K].numpy() if w else None, labels[:, -K:] if w else None)
            self._fill(tokens, known, gen, kernel)
            new = slice(0 if w == 0 else K, L)
            if kernel is not None:  # the guide bound each label as it was drawn
                glob = kernel.glob.copy()
            else:
                glob = _global_labels(tokens["tid"].numpy(), labels[:, -K:] if w else None, next_label)
            for c in CHANNELS:
                out[c].append(tokens[c][:, new].numpy())
            labels = np.concatenate([labels, glob[:, new]], axis=1)
            if w + 1 < n_windows and K:
                # the next window starts with this one's last K events, relabelled in first-seen order
                tail = {c: tokens[c][:, L - K :].clone() for c in CHANNELS}
                tail["tid"] = torch.from_numpy(
                    self.codec.relabel_tids(np.where(glob[:, L - K :] > 0, glob[:, L - K :], -1))
                )
                for c in CHANNELS:
                    tokens[c] = torch.cat([tail[c], torch.zeros(chains, L - K, dtype=torch.long)], dim=1)
                known = torch.zeros(chains, L, dtype=torch.bool)
                known[:, :K] = True
            else:
                known = torch.zeros(chains, L, dtype=torch.bool)
            bar.update(chains * (L + w * (L - K)))
        seqs = {c: np.concatenate(out[c], axis=1)[:, :per_chain] for c in CHANNELS}
        labels = labels[:, :per_chain]
        # chain b's labels are offset so that threads of different chains never share a label
        if kernel is not None:
            next_label = kernel.next_glob
        offset = np.concatenate([[0], np.cumsum(next_label - 1)[:-1]])[:, None]
        seqs["tid"] = np.where(labels > 0, labels + offset, 0)
        return seqs, kernel

    def chains_for(self, n_events: int) -> int:
        """How many chains `sample(n_events)` draws in parallel: `config.chains`, fewer where there are not
        enough events to give each chain a whole window."""
        return max(1, min(self.config.chains, math.ceil(n_events / self.config.context)))

    def _draw(
        self,
        logits: torch.Tensor,
        c: str,
        gen: torch.Generator,
        allowed: torch.Tensor | None = None,
        instead: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A token of channel c from softmax(logits / temperature) over tokens seen in training (and
        `allowed`, a guide's mask: the allowed ones alone where none of them was seen), and its log-prob.
        With `instead` ([b] tokens, -1 for none): the model draws freely, and where the mask refuses its draw,
        a chain with an `instead` token takes that one (a chain without redraws within the mask)."""
        if instead is not None and allowed is not None:
            own, own_lp = self._draw(logits, c, gen)
            refused = ~allowed.gather(-1, own[..., None])[..., 0]
            if not bool(refused.any()):
                return own, own_lp
            masked, masked_lp = self._draw(logits, c, gen, allowed)
            alt = torch.as_tensor(instead, dtype=torch.long)
            take = refused & (alt >= 0)
            out = torch.where(refused, torch.where(take, alt.clamp(min=0), masked), own)
            return out, torch.where(refused, masked_lp, own_lp)  # the log-prob of a substituted token is not used
        ok = self.seen[c]
        if allowed is not None:
            both = allowed & ok
            ok = torch.where(both.any(-1, keepdim=True), both, allowed)
        lg = logits.float().masked_fill(~ok, float("-inf"))
        logp = torch.log_softmax(lg / self.config.temperature, dim=-1)
        u = torch.rand(logp.shape, generator=gen).clamp_(1e-12, 1.0)
        draw = torch.argmax(logp - torch.log(-torch.log(u)), dim=-1)  # Gumbel-max: a draw from softmax
        return draw, torch.gather(logp, -1, draw[..., None])[..., 0]

    # -- storage ------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write config.json, vocab.json, model.safetensors, gaps.safetensors and, after a fit, the training state
        (`TRAIN_STATE`) atomically; config.json holds the sha256 of each tensor file (checked by load)."""
        if self.model is None:
            raise TraceSynthError(f"{self.config.what}: save() before fit()")
        directory = Path(directory)
        meta = {
            "format": self.format,
            "config": asdict(self.config),
            "workloads": self.workloads,
            "kernel": asdict(self.kernel),
            "history": self.history,
        }
        tensors = {f"gap_{k}": torch.from_numpy(v) for k, v in self.gap_table.items()}
        tensors.update({f"seen_{c}": v for c, v in self.seen.items()})
        weights = {k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}
        with atomic_path(directory, directory=True, contents=self.contents) as tmp:
            (tmp / "vocab.json").write_text(self.codec.dumps())
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": self.format})
            save_file(tensors, str(tmp / "gaps.safetensors"))
            if self._train_state is not None:
                save_file(self._train_state["tensors"], str(tmp / TRAIN_STATE))
                meta["train_state"] = self._train_state["meta"]
            meta[HASHES] = file_hashes(tmp, TENSOR_FILES)
            (tmp / "config.json").write_text(json.dumps(meta, indent=1))  # last: it vouches for the others
            tmp.chmod(0o755)
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> TokenModel:
        """Read a model written by save(); a damaged or foreign file is one TraceSynthError naming it."""
        directory = Path(directory)
        what = cls.config_cls.what
        try:
            meta = json.loads((directory / "config.json").read_text())
            if not isinstance(meta, dict) or meta.get("format") != cls.format:
                raise TraceSynthError(f"config.json is not a {cls.format} model", directory)
            verify_hashes(directory, meta, optional=(TRAIN_STATE,))  # without it the model samples, cannot resume
            self = cls(cls.config_cls(**meta["config"]))
            self.history = dict(meta.get("history") or {})
            self.workloads = [str(w) for w in meta.get("workloads") or []]
            self.kernel = KernelFacts.from_json(meta.get("kernel"))
            self.codec = ChannelCodec.from_json(json.loads((directory / "vocab.json").read_text()))
            self._load_tables(directory / "gaps.safetensors")
            with torch.device("meta"):  # the shapes the config implies, without allocating them
                want = {k: tuple(v.shape) for k, v in self._network().state_dict().items()}
            weights = load_file(str(directory / "model.safetensors"))
            check_shapes(directory / "model.safetensors", weights, want)
            self.model = self._network()
            self.model.load_state_dict(weights)
            if (directory / TRAIN_STATE).is_file():
                self._load_train_state(directory / TRAIN_STATE, meta.get("train_state"))
        except TraceSynthError as exc:
            raise exc if exc.path else TraceSynthError(str(exc), directory) from None
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
            raise TraceSynthError(f"not a {what} model ({type(exc).__name__}: {_first_line(exc)})", directory) from None
        self.model.eval()
        return self

    def _load_tables(self, path: Path) -> None:
        """The gap table and the seen tokens, checked against the vocabulary."""
        tables = load_file(str(path))
        n_gaps = len(tables["gap_gaps"]) if "gap_gaps" in tables else 0
        n_keys = len(tables["gap_keys"]) if "gap_keys" in tables else 0
        want = {f"seen_{c}": (v,) for c, v in self.vocab.items()}
        want.update({"gap_keys": (n_keys,), "gap_offsets": (n_keys + 1,), "gap_gaps": (n_gaps,)})
        check_shapes(path, tables, want)
        for name, t in tables.items():
            dtype = torch.bool if name.startswith("seen_") else torch.int64
            if t.dtype != dtype:
                raise TraceSynthError(f"tensor {name} is {t.dtype}, the model wants {dtype}", path)
        keys, off = tables["gap_keys"], tables["gap_offsets"]
        in_range = not n_keys or 0 <= int(keys[0]) <= int(keys[-1]) < self.vocab["event"] * N_DT
        ordered = not bool((off.diff() < 0).any()) and not bool((keys.diff() <= 0).any())
        if int(off[0]) != 0 or int(off[-1]) != n_gaps or not ordered or not in_range:
            raise TraceSynthError("the gap table is not sorted or its offsets do not fit (a damaged file)", path)
        self.gap_table = {k[4:]: v.numpy() for k, v in tables.items() if k.startswith("gap_")}
        self.seen = {c: tables[f"seen_{c}"] for c in CHANNELS}

    def _load_train_state(self, path: Path, meta: Any) -> None:
        """A checkpoint's training state (`_snapshot`), its shapes checked against the network's parameters."""
        tensors = load_file(str(path))
        keys = ("step", "seconds", "losses", "numpy_rng", "param_groups")
        if not isinstance(meta, dict) or any(k not in meta for k in keys):
            raise TraceSynthError(f"config.json: train_state must hold {', '.join(keys)}", path.parent)
        if not isinstance(meta["step"], int) or meta["step"] < 0 or not isinstance(meta["losses"], list):
            raise TraceSynthError("config.json: train_state's step or losses is not valid", path.parent)
        want: dict[str, tuple[int, ...]] = {"rng.torch": tuple(torch.get_rng_state().shape)}
        if "rng.cuda" in tensors:
            want["rng.cuda"] = tuple(tensors["rng.cuda"].shape)
        if any(k.startswith("opt.") for k in tensors):
            for i, p in enumerate(self.model.parameters()):
                want.update(
                    {f"opt.{i}.exp_avg": tuple(p.shape), f"opt.{i}.exp_avg_sq": tuple(p.shape), f"opt.{i}.step": ()}
                )
        check_shapes(path, tensors, want)
        np.random.default_rng().bit_generator.state = meta["numpy_rng"]  # a bad state fails here, not on resume
        self._train_state = {"meta": meta, "tensors": tensors}

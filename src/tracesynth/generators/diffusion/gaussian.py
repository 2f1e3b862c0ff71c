"""GaussianDiffusion: the diffusion generator behind fit / sample / save / load (the Generator protocol)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from atomicio import atomic_path
from tracesynth.bounds import SampleProgress, check_sample_size
from tracesynth.channels import ChannelCodec
from tracesynth.divergence import jsd
from tracesynth.errors import TraceSynthError
from tracesynth.generators.diffusion.config import GaussianDiffusionConfig
from tracesynth.generators.diffusion.model import TraceDenoiser
from tracesynth.generators.diffusion.samplers import make_sampler
from tracesynth.generators.diffusion.schedule import NoiseSchedule
from tracesynth.generators.diffusion.train import optimizer_from_tensors, optimizer_to_tensors, train
from tracesynth.generators.distributed import is_main_process
from tracesynth.integrity import HASHES, check_shapes, file_hashes, verify_hashes
from tracesynth.jsonable import jsonable
from tracesynth.optim import resolve_device
from tracesynth.splits import split_by_time
from tracesynth.trace import Trace

FORMAT = "tracesynth-diffusion"
CALIBRATION_TEMPERATURES = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25)
FILES = ("config.json", "vocab.json", "model.safetensors", "optimizer.safetensors")


class GaussianDiffusion:
    """Multi-channel transformer diffusion model of kernel traces.

    >>> synth = GaussianDiffusion(GaussianDiffusionConfig(context=256, steps=500)).fit([trace])
    >>> synth.save("model/"); GaussianDiffusion.load("model/").sample(10_000, seed=1)
    """

    name = "diffusion"
    contents = FILES  # what save() writes

    def __init__(self, config: GaussianDiffusionConfig | None = None):
        self.config = config or GaussianDiffusionConfig()
        self.codec: ChannelCodec | None = None
        self.model: TraceDenoiser | None = None
        self.step = 0
        self.history: dict[str, Any] = {}
        self.source: dict[str, Any] = {}
        self._opt_state: dict[str, Any] | None = None

    # -- data ---------------------------------------------------------------------------------
    def windows(self, traces: Sequence[Trace]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Training and validation windows: each trace's last time block is validation, and windows
        are cut inside a block, never across two."""
        assert self.codec is not None
        cfg = self.config
        fr = (1 - cfg.val_fraction, cfg.val_fraction) if cfg.val_fraction > 0 else (1.0,)
        parts: tuple[list, list] = ([], [])
        for trace in traces:
            for i, block in enumerate(split_by_time(trace, fr)):
                parts[i].append(self.codec.windows(self.codec.encode(block), cfg.context, cfg.window_stride))
        train_w, val_w = (
            {c: np.concatenate([w[c] for w in p]) for c in self.codec.channels} if p else {} for p in parts
        )
        if not train_w or len(train_w["event"]) == 0:
            longest = max((len(t) for t in traces), default=0)
            raise TraceSynthError(
                f"no training window of {cfg.context} events fits (longest trace has {longest} events, "
                f"{1 - cfg.val_fraction:.0%} of it for training); use a smaller --context"
            )
        if not val_w:
            val_w = {c: v[:0] for c, v in train_w.items()}
        return train_w, val_w

    # -- Generator protocol -------------------------------------------------------------------
    def fit(
        self, traces: Sequence[Trace], checkpoint_dir: str | Path | None = None, progress: bool = False
    ) -> GaussianDiffusion:
        """Learn from real traces. A loaded model with training state continues from its step.

        With `checkpoint_dir`, rank 0 writes the model there every `checkpoint_every` steps and at the end.
        """
        cfg = self.config
        if isinstance(traces, Trace):
            traces = [traces]
        resuming = self.model is not None and self.codec is not None
        if not resuming:
            self.codec = ChannelCodec.fit(traces, cfg.channel_names, cfg.max_tids)
        train_w, val_w = self.windows(traces)
        if not resuming:
            torch.manual_seed(cfg.seed)  # identical initial weights on every rank
            self.model = TraceDenoiser(cfg, self.codec.vocab_sizes)
            with torch.no_grad():
                for c in self.model.discrete:
                    seen = (
                        np.union1d(np.unique(train_w[c]), np.unique(val_w[c]))
                        if len(val_w[c])
                        else np.unique(train_w[c])
                    )
                    mask = torch.zeros_like(getattr(self.model, f"allowed_{c}"))
                    mask[torch.as_tensor(seen)] = True
                    getattr(self.model, f"allowed_{c}").copy_(mask)
            self.step = 0
            self.source = _source_meta(traces)
        device = resolve_device(cfg.device)

        def checkpoint(step: int, opt: torch.optim.Optimizer, hist: dict[str, Any]) -> None:
            self.step, self.history = step, hist
            self._opt_state = None
            self._save(checkpoint_dir, opt)  # type: ignore[arg-type]

        hist = train(
            self.model,
            cfg,
            train_w,
            val_w,
            device,
            start_step=self.step,
            optimizer_state=self._opt_state,
            checkpoint=checkpoint if checkpoint_dir is not None else None,
            progress=progress,
            start_seconds=_seconds(self.history.get("train_seconds")) if resuming else 0.0,
        )
        self.model.to("cpu")
        self.step, self.history = int(hist["steps"]), hist
        self.history["train_windows"], self.history["val_windows"] = len(train_w["event"]), len(val_w["event"])
        if cfg.calibrate and cfg.clamp == "soft" and len(val_w["event"]):
            scores = self.calibrate(val_w)
            self.history["calibration"] = {str(k): v for k, v in scores.items()}
            if checkpoint_dir is not None and is_main_process():
                self._save(checkpoint_dir, None)  # the final model with its calibrated temperature
        return self

    @property
    def n_params(self) -> int | None:
        """Weights of the denoiser (None before fit/load)."""
        return None if self.model is None else int(sum(p.numel() for p in self.model.parameters()))

    @property
    def fit_info(self) -> dict[str, Any]:
        """Optimisation steps done (a time-limited fit stops early) and training windows seen."""
        info: dict[str, Any] = {"train_steps": self.step}
        if "train_windows" in self.history:
            info["train_windows"] = self.history["train_windows"]
        return info

    @torch.no_grad()
    def sample(
        self,
        n_events: int,
        seed: int = 0,
        sampler: str | None = None,
        sampling_steps: int | None = None,
        progress: bool = False,
        device: str | None = None,
    ) -> Trace:
        """Generate n_events events (whole windows, concatenated with time running on, then cut).

        The same seed gives the same trace. Sampling only: constraint repair is its own step
        (tracesynth.constraints.repair_trace). `progress` shows a bar (events done, time left) once the sample
        has run a few seconds; n_events that would not fit in memory is refused before any work.
        """
        if self.model is None or self.codec is None:
            raise TraceSynthError("the model is not fitted (call fit() or GaussianDiffusion.load())")
        if n_events < 0:
            raise TraceSynthError(f"n_events must be non-negative, got {n_events}")
        if n_events:
            check_sample_size(n_events, self.name)
        cfg = self.config
        dev = resolve_device(device or cfg.device)
        schedule = NoiseSchedule(cfg.timesteps, cfg.schedule)
        name = sampler or cfg.sampler
        try:
            smp = make_sampler(name, schedule, sampling_steps or cfg.sampling_steps)
        except ValueError as exc:
            raise TraceSynthError(str(exc)) from None
        windows = self._sample_windows(math.ceil(n_events / cfg.context), seed, smp, dev, progress)
        meta = {
            "source_format": "synthetic",
            "generator": self.name,
            "sampler": name,
            "sampling_steps": len(smp.timesteps),
            "seed": int(seed),
            **{k: v for k, v in self.source.items() if k in ("workload",)},
        }
        trace = self.codec.decode(windows, metadata=meta).slice(0, n_events)
        return Trace(trace.table, trace.metadata)

    @torch.no_grad()
    def _sample_windows(
        self,
        n_win: int,
        seed: int,
        smp: Any,
        dev: torch.device,
        progress: bool = False,
        temperature: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Token windows [n_win, L] per channel, denoised in batches of sample_batch."""
        assert self.model is not None and self.codec is not None
        cfg, model = self.config, self.model.to(dev).eval()
        schedule = smp.schedule
        tau = cfg.clamp_temperature if temperature is None else temperature
        x0_fn = {"soft": lambda z: model.soft_snap(z, tau), "hard": model.snap, "none": None}[cfg.clamp]
        L = cfg.context
        g = torch.Generator(device=dev).manual_seed(int(seed))
        outs: dict[str, list[np.ndarray]] = {c: [] for c in self.codec.channels}
        with SampleProgress(n_win * L, progress) as bar:  # events: L per window, a share of it per step
            for a in range(0, n_win, cfg.sample_batch):
                b = min(cfg.sample_batch, n_win - a)
                x = torch.randn((b, L, model.latent), generator=g, device=dev)
                for i, t in enumerate(smp.timesteps):
                    tt = torch.full((b,), t, device=dev, dtype=torch.long)
                    out = model(x, tt)
                    eps = schedule.predict_eps(x, out, tt) if cfg.prediction == "x0" else out
                    x = smp.step(eps, t, x, g, x0_fn)
                    bar.update((a + b * (i + 1) / len(smp.timesteps)) * L)
                tok = model.round(x)
                for c in self.codec.channels:
                    outs[c].append(tok[c].cpu().numpy())
        self.model.to("cpu")
        return {c: np.concatenate(v) if v else np.zeros((0, L), dtype=np.int64) for c, v in outs.items()}

    def calibrate(self, val_w: dict[str, np.ndarray], windows: int = 8, seed: int = 0) -> dict[float, float]:
        """Pick the soft-clamp temperature whose samples best match the validation windows' event
        and bigram frequencies (same noise for every candidate, so the comparison is paired)."""
        assert self.codec is not None
        cfg = self.config
        # A short strided sampler keeps this cheap (7 candidates); event statistics barely move between
        # 10 and 50 DDIM steps on scimark2 (bench/bench_diffusion.py).
        smp = make_sampler("ddim", NoiseSchedule(cfg.timesteps, cfg.schedule), min(20, cfg.sampling_steps))
        dev = resolve_device(cfg.device)
        V = len(self.codec.events)
        real = _token_stats(val_w["event"], V)
        scores = {}
        for tau in CALIBRATION_TEMPERATURES:
            w = self._sample_windows(windows, seed, smp, dev, temperature=tau)
            fake = _token_stats(w["event"], V)
            # nansum: windows of one event have no bigrams, and then only the event shares count
            scores[tau] = float(np.nansum([jsd(fake[0], real[0]), jsd(fake[1], real[1])]))
        self.config.clamp_temperature = min(scores, key=lambda k: scores[k])
        return scores

    # -- storage ------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write config.json, vocab.json, model.safetensors and optimizer.safetensors atomically; config.json
        holds the sha256 of each tensor file, which load() checks."""
        return self._save(directory, None)

    def _save(self, directory: str | Path, opt: torch.optim.Optimizer | None) -> Path:
        if self.model is None or self.codec is None:
            raise TraceSynthError("nothing to save: the model is not fitted")
        directory = Path(directory)
        state = {k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}
        if opt is not None:
            opt_tensors, opt_meta = optimizer_to_tensors(opt.state_dict())
        elif self._opt_state is not None:
            opt_tensors, opt_meta = optimizer_to_tensors(self._opt_state)
        else:
            opt_tensors, opt_meta = {}, {"param_groups": []}
        meta = {
            "format": FORMAT,
            "version": 1,
            "config": self.config.to_json(),
            "step": self.step,
            "vocab_sizes": self.codec.vocab_sizes,
            "history": jsonable(self.history),
            "source": self.source,
            "optimizer": opt_meta,
        }
        with atomic_path(directory, directory=True, contents=FILES) as tmp:
            (tmp / "vocab.json").write_text(self.codec.dumps())
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": FORMAT})
            save_file(opt_tensors, str(tmp / "optimizer.safetensors"), metadata={"format": FORMAT})
            meta[HASHES] = file_hashes(tmp, ("model.safetensors", "optimizer.safetensors"))
            (tmp / "config.json").write_text(json.dumps(meta, indent=1))  # last: it vouches for the others
            # mkdtemp/mkstemp make private files; a model is an ordinary shareable output.
            tmp.chmod(0o755)
            for f in tmp.iterdir():
                f.chmod(0o644)
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> GaussianDiffusion:
        """Read a model written by save(); any problem is one TraceSynthError naming the directory."""
        directory = Path(directory)
        if not directory.is_dir():
            raise TraceSynthError("no such model directory" if not directory.exists() else "not a directory", directory)
        missing = [f for f in FILES if not (directory / f).is_file()]
        if missing:
            raise TraceSynthError(f"not a tracesynth model: missing {', '.join(missing)}", directory)
        try:
            meta = json.loads((directory / "config.json").read_text())
            if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                raise TraceSynthError(f"config.json is not a {FORMAT} model", directory)
            verify_hashes(directory, meta)
            cfg = GaussianDiffusionConfig.from_json(meta["config"])
            step = meta.get("step", 0)
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise TraceSynthError(f"step must be a non-negative integer, got {step!r}")
            for key in ("history", "source"):
                if not isinstance(meta.get(key, {}), dict):
                    raise TraceSynthError(f"{key} must be a JSON object")
            codec = ChannelCodec.from_json(json.loads((directory / "vocab.json").read_text()))
            state = load_file(str(directory / "model.safetensors"))
            opt_tensors = load_file(str(directory / "optimizer.safetensors"))
            # compare shapes on the meta device first: a damaged size in config.json or vocab.json must
            # not allocate a huge model before it is found not to match the weights
            with torch.device("meta"):
                net = TraceDenoiser(cfg, codec.vocab_sizes)
                want = {k: tuple(v.shape) for k, v in net.state_dict().items()}
                params = [tuple(p.shape) for p in net.parameters()]
        except TraceSynthError as exc:
            if exc.path:
                raise
            raise TraceSynthError(f"bad config.json ({exc})", directory) from None
        except (ValueError, KeyError, TypeError, AttributeError, OSError, SafetensorError, RuntimeError) as exc:
            raise TraceSynthError(f"unreadable model ({type(exc).__name__}: {_first_line(exc)})", directory) from None
        check_shapes(directory / "model.safetensors", state, want)
        if opt_tensors:  # AdamW's moments are shaped as their parameters, its step count is a scalar
            check_shapes(directory / "optimizer.safetensors", opt_tensors, _optimizer_shapes(opt_tensors, params))
        self = cls(cfg)
        self.codec = codec
        self.model = TraceDenoiser(cfg, codec.vocab_sizes)
        try:
            self.model.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()
            raise TraceSynthError(
                f"weights do not match the config ({first[-1].strip() if first else exc})", directory
            ) from None
        self.model.eval()
        self.step = step
        self.history = meta.get("history", {})
        self.source = meta.get("source", {})
        if opt_tensors:
            try:
                self._opt_state = optimizer_from_tensors(opt_tensors, meta.get("optimizer", {"param_groups": []}))
            except (TypeError, KeyError, ValueError, IndexError, AttributeError) as exc:
                raise TraceSynthError(
                    f"bad optimizer state in config.json ({type(exc).__name__}: {exc})", directory
                ) from None
        return self


def _first_line(exc: BaseException) -> str:
    """An exception's message up to its first line break (torch appends C++ stack frames to some)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _seconds(value: Any) -> float:
    """A checkpoint's seconds trained (0 where config.json holds none or nonsense)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return float(value) if ok else 0.0


def _optimizer_shapes(tensors: dict[str, torch.Tensor], params: list[tuple[int, ...]]) -> dict[str, tuple]:
    """The shape each tensor of optimizer.safetensors ("state.<param index>.<key>") must have."""
    want: dict[str, tuple] = {}
    for i, shape in enumerate(params):
        if any(k.startswith(f"state.{i}.") for k in tensors):
            want.update({f"state.{i}.exp_avg": shape, f"state.{i}.exp_avg_sq": shape, f"state.{i}.step": ()})
    return want


def _source_meta(traces: Sequence[Trace]) -> dict[str, Any]:
    workloads = sorted({str(t.metadata["workload"]) for t in traces if t.metadata.get("workload")})
    return {"traces": len(traces), "events": int(sum(len(t) for t in traces)), "workload": ",".join(workloads) or None}


def _token_stats(tokens: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Unigram and within-window bigram counts of event tokens [n, L]."""
    uni = np.bincount(tokens.reshape(-1), minlength=vocab).astype(float)
    pairs = (tokens[:, :-1] * vocab + tokens[:, 1:]).reshape(-1)
    return uni, np.bincount(pairs, minlength=vocab * vocab).astype(float)

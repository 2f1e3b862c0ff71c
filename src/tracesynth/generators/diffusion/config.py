"""GaussianDiffusionConfig: every number that defines a model, its training and its default sampler."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from tracesynth.channels import channels_for
from tracesynth.errors import TraceSynthError

# field -> (type, lowest value or None); checked on every config, so a damaged config.json is one clear error
_RANGES: dict[str, tuple[type, float | None]] = {
    **dict.fromkeys(("context", "timesteps"), (int, 2)),
    **dict.fromkeys(
        ("stride", "channels", "max_tids", "patch", "d_model", "n_layers", "n_heads", "event_dim", "channel_dim"),
        (int, 1),
    ),
    **dict.fromkeys(("batch_size", "checkpoint_every", "sampling_steps", "sample_batch"), (int, 1)),
    **dict.fromkeys(("steps", "warmup", "seed"), (int, 0)),
    **dict.fromkeys(("val_fraction", "dropout", "aux_weight", "time_limit", "grad_clip"), (float, 0)),
    **dict.fromkeys(("lr", "clamp_temperature"), (float, 1e-12)),
    **dict.fromkeys(("schedule", "prediction", "device", "sampler", "clamp"), (str, None)),
    "calibrate": (bool, None),
}
_OPTIONAL = {"stride", "patch"}
_MAX_TIMESTEPS = 1_000_000
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


@dataclass
class GaussianDiffusionConfig:
    kind: ClassVar[str] = "diffusion"  # its generator kind (tracesynth.generators.registry)

    # windows and channels
    context: int = 1024  # events per window (L)
    stride: int | None = None  # window stride in events; None = context // 2 (50% overlap)
    channels: int = 6  # 6 (event, dt, cpu, tid, comm, ret) or 2 (event, dt)
    max_tids: int = 32  # distinct threads labelled per window; later ones share the last label
    val_fraction: float = 0.1  # last time block of each trace, held out for validation loss
    # network (a pre-LN transformer encoder over patches of `patch` events); the defaults are sized to
    # learn within minutes on two CPU cores, raise them where there is a GPU
    patch: int | None = None  # events per transformer token; None = max(1, context // 256)
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.0
    event_dim: int = 16  # latent width of the event channel
    channel_dim: int = 8  # latent width of each other channel
    # diffusion
    timesteps: int = 1000
    schedule: str = "linear"
    # What the network outputs: "x0" (the clean latent; the samplers still step on the noise it
    # implies) or "eps" (the noise itself, as in DDPM). x0 is the default because, at equal training
    # time on scimark2, it samples far closer to the real event and bigram distributions (see bench/).
    prediction: str = "x0"
    aux_weight: float = 1.0  # weight of the reconstruction (cross-entropy / dt regression) loss
    # training
    steps: int = 1000
    time_limit: float = 0.0  # seconds; > 0 stops training there, the LR schedule following whichever ends first
    batch_size: int = 8
    lr: float = 3e-3
    warmup: int = 50
    grad_clip: float = 1.0
    checkpoint_every: int = 200
    seed: int = 0
    device: str = "cpu"
    # sampling defaults
    sampler: str = "ddim"
    sampling_steps: int = 50
    # At every sampler step the predicted x0 is pulled onto the token embeddings: "soft" replaces it by
    # the expected embedding under each channel's token posterior, "hard" snaps it to the nearest one
    # (Diffusion-LM's clamping), "none" leaves it alone. Final rounding is always to the nearest token.
    clamp: str = "soft"
    # Temperature of the soft clamp's token posterior; with calibrate=True, fit() picks it from
    # CALIBRATION_TEMPERATURES by sampling a few windows and matching the validation block's event and
    # bigram frequencies (the best value differs from model to model).
    clamp_temperature: float = 1.0
    calibrate: bool = True
    sample_batch: int = 16  # windows denoised together

    def __post_init__(self) -> None:
        self._check_types()
        channels_for(self.channels)
        if self.context < 2:
            raise TraceSynthError(f"context must be at least 2 events, got {self.context}")
        if self.context % self.patch_size:
            raise TraceSynthError(f"context {self.context} is not a multiple of patch {self.patch_size}")
        if self.d_model % self.n_heads:
            raise TraceSynthError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if self.prediction not in ("eps", "x0"):
            raise TraceSynthError(f"unknown prediction {self.prediction!r} (eps or x0)")
        if self.clamp not in ("soft", "hard", "none"):
            raise TraceSynthError(f"unknown clamp {self.clamp!r} (soft, hard or none)")
        if self.sampler not in ("ddim", "ancestral"):
            raise TraceSynthError(f"unknown sampler {self.sampler!r} (ddim or ancestral)")

    def _check_types(self) -> None:
        """Every field has its type and a usable range (a config.json may have been edited or damaged)."""
        for name, (kind, low) in _RANGES.items():
            v = getattr(self, name)
            if v is None and name in _OPTIONAL:
                continue
            if kind is int:
                good = isinstance(v, int) and not isinstance(v, bool)
            elif kind is float:
                good = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            else:
                good = isinstance(v, kind)
            if not good:
                raise TraceSynthError(f"{name} must be {_KIND_NAMES[kind]}, got {v!r}")
            if low is not None and v < low:
                raise TraceSynthError(f"{name} must be at least {low}, got {v!r}")
        if self.timesteps > _MAX_TIMESTEPS:  # the schedule holds a few tensors of this length
            raise TraceSynthError(f"timesteps must be at most {_MAX_TIMESTEPS:,}, got {self.timesteps!r}")
        for name in ("val_fraction", "dropout"):
            if getattr(self, name) >= 1:
                raise TraceSynthError(f"{name} must be below 1, got {getattr(self, name)!r}")
        if self.schedule not in ("linear", "cosine"):
            raise TraceSynthError(f"unknown schedule {self.schedule!r} (linear or cosine)")

    @property
    def channel_names(self) -> tuple[str, ...]:
        return channels_for(self.channels)

    @property
    def patch_size(self) -> int:
        return self.patch if self.patch else max(1, self.context // 256)

    @property
    def window_stride(self) -> int:
        return self.stride if self.stride else max(1, self.context // 2)

    def latent_dim(self, channel: str) -> int:
        return self.event_dim if channel == "event" else self.channel_dim

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GaussianDiffusionConfig:
        if not isinstance(data, dict):
            raise TraceSynthError(f"the model config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

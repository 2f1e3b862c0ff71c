"""The interface every generator (the diffusion model and each baseline) implements, and the one
registry that maps a kind ("diffusion", "masked", "ar", "markov", "sdv_par") to its class.

Configs, the CLI and the evaluation harness build and load generators only through `make_generator`
and `load_generator`, and read them only through the Generator protocol, so the harness scores every
generator the same way and a new one is one entry in `KINDS`.

    gen = make_generator({"kind": "markov", "order": 4}).fit([trace])
    synthetic = gen.sample(10_000, seed=0)        # sampling only; repair is tracesynth.constraints.repair_trace
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tracesynth.errors import TraceSynthError
from tracesynth.trace import Trace


@runtime_checkable
class Generator(Protocol):
    name: str

    def fit(self, traces: Sequence[Trace]) -> Generator:
        """Learn from real traces; returns self."""
        ...

    def sample(self, n_events: int, seed: int = 0) -> Trace:
        """Generate a synthetic trace of n_events events; the same seed gives the same trace."""
        ...

    def save(self, directory: str | Path) -> Path:
        """Write the fitted generator to a directory (JSON + safetensors, no pickle)."""
        ...

    @classmethod
    def load(cls, directory: str | Path) -> Generator:
        """Read a generator written by save()."""
        ...

    @property
    def n_params(self) -> int | None:
        """Learned numbers (network weights, table entries): the harness's model-size figure; None if unknown."""
        ...

    @property
    def fit_info(self) -> dict[str, Any]:
        """What the last fit did, for the harness's cost table (e.g. train_steps, train_windows)."""
        ...


@dataclass(frozen=True)
class Kind:
    """One registered generator kind.

    `build` makes an unfitted generator from a config spec; `cls` imports and returns its class
    (None where a kind cannot be saved, so has nothing to load); a saved directory is recognised
    by `config.json[marker[0]] == marker[1]`; `sample_options` are the keyword options its
    sample() takes beyond (n_events, seed).
    """

    name: str
    build: Callable[[Mapping[str, Any]], Generator]
    cls: Callable[[], type] | None
    marker: tuple[str, str] | None
    sample_options: tuple[str, ...] = ()

    def load(self, directory: str | Path) -> Generator:
        if self.cls is None:
            raise TraceSynthError(f"a {self.name} generator cannot be saved or loaded", Path(directory))
        return self.cls().load(directory)


# Imports inside the builders keep `import tracesynth.generator` light (torch only for diffusion).
def _markov_cls() -> type:
    from tracesynth.baselines.markov import MarkovChain

    return MarkovChain


def _diffusion_cls() -> type:
    from tracesynth.diffusion.synth import TraceSynth

    return TraceSynth


def _masked_cls() -> type:
    from tracesynth.masked import MaskedDiffusion

    return MaskedDiffusion


def _ar_cls() -> type:
    from tracesynth.autoregressive import Autoregressive

    return Autoregressive


def _token_builder(cls: Callable[[], type]) -> Callable[[Mapping[str, Any]], Generator]:
    """The builder of a token generator (tracesynth.tokenmodel) from {"config": {...its config's fields}}."""

    def build(spec: Mapping[str, Any]) -> Generator:
        gen_cls = cls()
        try:
            cfg = gen_cls.config_cls(**dict(spec.get("config", {})))
        except TypeError as exc:
            raise TraceSynthError(f"{gen_cls.config_cls.what} config: {exc}") from None
        return gen_cls(cfg)

    return build


def _markov(spec: Mapping[str, Any]) -> Generator:
    return _markov_cls()(int(spec.get("order", 4)))


def _diffusion(spec: Mapping[str, Any]) -> Generator:
    from tracesynth.diffusion.config import TraceSynthConfig

    return _diffusion_cls()(TraceSynthConfig.from_json(dict(spec.get("config", {}))))


def _sdv_par(spec: Mapping[str, Any]) -> Generator:
    from tracesynth.baselines.sdv_par import PARBaseline  # raises "pip install sdv" where SDV is absent

    return PARBaseline(**{k: int(spec[k]) for k in ("seq_len", "max_sequences", "epochs") if k in spec})


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "diffusion",
            _diffusion,
            _diffusion_cls,
            ("format", "tracesynth-diffusion"),
            ("sampler", "sampling_steps", "device", "progress"),
        ),
        Kind("masked", _token_builder(_masked_cls), _masked_cls, ("format", "tracesynth-masked-1"),
             ("workload", "progress")),
        Kind("ar", _token_builder(_ar_cls), _ar_cls, ("format", "tracesynth-ar-2"), ("workload", "guide", "progress")),
        Kind("markov", _markov, _markov_cls, ("kind", "markov"), ("guide",)),
        Kind("sdv_par", _sdv_par, None, None),
    )
}


def get_kind(name: Any) -> Kind:
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise TraceSynthError(f"unknown generator kind {name!r} (known: {', '.join(KINDS)})")
    return kind


def make_generator(spec: Mapping[str, Any]) -> Generator:
    """A fresh (unfitted) generator from a config spec {"kind": ..., kind's options}."""
    return get_kind(spec.get("kind")).build(spec)


def saved_kind(directory: str | Path) -> Kind:
    """The kind of the generator saved in `directory`, from its config.json."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TraceSynthError("no such model directory" if not directory.exists() else "not a directory", directory)
    path = directory / "config.json"
    if not path.is_file():
        raise TraceSynthError("not a tracesynth model: missing config.json", directory)
    try:
        meta = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise TraceSynthError(f"bad config.json ({exc})", directory) from None
    for kind in KINDS.values():
        if kind.marker and isinstance(meta, dict) and meta.get(kind.marker[0]) == kind.marker[1]:
            return kind
    raise TraceSynthError(f"config.json is not that of a saved generator ({', '.join(KINDS)})", directory)


def load_generator(directory: str | Path) -> Generator:
    """Read any generator written by its save(), whatever its kind."""
    return saved_kind(directory).load(directory)

"""The interface every generator (the diffusion model and each baseline) implements, and the one
registry that maps a kind ("diffusion", "masked", "ar", "block", "markov", "sdv_par") to its config dataclass (the
one place of the kind's defaults) and its class.

Configs, the CLI and the evaluation harness build and load generators only through `make_generator`
and `load_generator`, and read them only through the Generator protocol, so the harness scores every
generator the same way and a new one is one entry in `KINDS`.

    gen = make_generator({"kind": "markov", "order": 4}).fit([trace])
    gen = make_generator(get_kind("masked").config({"steps": 500}))  # = {"kind": "masked", "config": {"steps": 500}}
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

    `config_cls` imports and returns its config dataclass, the one place of its defaults (None for sdv_par,
    whose options are PARBaseline's arguments); `parse` reads a config spec's options into that config;
    `build` makes an unfitted generator from it; `cls` imports and returns the generator's class (None where
    a kind cannot be saved, so has nothing to load); a saved directory is recognised by
    `config.json[marker[0]] == marker[1]`; `sample_options` are the keyword options its sample() takes
    beyond (n_events, seed).
    """

    name: str
    config_cls: Callable[[], type] | None
    parse: Callable[[Mapping[str, Any]], Any]
    build: Callable[[Any], Generator]
    cls: Callable[[], type] | None
    marker: tuple[str, str] | None
    sample_options: tuple[str, ...] = ()

    def config(self, options: Mapping[str, Any]) -> Any:
        """The kind's config from `options` (some of its fields, by name; the others take its defaults)."""
        if self.config_cls is None:
            raise TraceSynthError(f"a {self.name} generator has no config class")
        cls = self.config_cls()
        try:
            return cls(**dict(options))
        except TypeError as exc:
            raise TraceSynthError(f"{getattr(cls, 'what', self.name)} config: {exc}") from None

    def load(self, directory: str | Path) -> Generator:
        if self.cls is None:
            raise TraceSynthError(f"a {self.name} generator cannot be saved or loaded", Path(directory))
        return self.cls().load(directory)


# Imports inside the functions keep `import tracesynth.generators` light (torch only where a kind is used).
def _markov_cls() -> type:
    from tracesynth.generators.markov import MarkovChain

    return MarkovChain


def _markov_config() -> type:
    from tracesynth.generators.markov import MarkovConfig

    return MarkovConfig


def _diffusion_cls() -> type:
    from tracesynth.generators.diffusion.gaussian import GaussianDiffusion

    return GaussianDiffusion


def _diffusion_config() -> type:
    from tracesynth.generators.diffusion.config import GaussianDiffusionConfig

    return GaussianDiffusionConfig


def _masked_cls() -> type:
    from tracesynth.generators.masked import MaskedDiffusion

    return MaskedDiffusion


def _ar_cls() -> type:
    from tracesynth.generators.ar import Autoregressive

    return Autoregressive


def _block_cls() -> type:
    from tracesynth.generators.block import BlockDiffusion

    return BlockDiffusion


def _config_of(cls: Callable[[], type]) -> Callable[[], type]:
    """The config class of the token generator class `cls` imports (its `config_cls`)."""
    return lambda: cls().config_cls


def _nested(name: str) -> Callable[[Mapping[str, Any]], Any]:
    """A spec's parser for a kind whose options sit under "config": {"kind": ..., "config": {...fields}}."""
    return lambda spec: get_kind(name).config(spec.get("config", {}))


def _diffusion_parse(spec: Mapping[str, Any]) -> Any:
    # from_json: a saved model's config.json is read the same way (a field it does not know is left out)
    return _diffusion_config().from_json(dict(spec.get("config", {})))


def _markov_parse(spec: Mapping[str, Any]) -> Any:
    return _markov_config()(**{k: int(spec[k]) for k in ("order",) if k in spec})


def _sdv_par_parse(spec: Mapping[str, Any]) -> dict[str, int]:
    return {k: int(spec[k]) for k in ("seq_len", "max_sequences", "epochs") if k in spec}


def _sdv_par(options: Mapping[str, int]) -> Generator:
    from tracesynth.generators.sdv_par import PARBaseline  # raises "pip install sdv" where SDV is absent

    return PARBaseline(**options)


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "diffusion",
            _diffusion_config,
            _diffusion_parse,
            lambda cfg: _diffusion_cls()(cfg),
            _diffusion_cls,
            ("format", "tracesynth-diffusion"),
            ("sampler", "sampling_steps", "device", "progress"),
        ),
        Kind(
            "masked",
            _config_of(_masked_cls),
            _nested("masked"),
            lambda cfg: _masked_cls()(cfg),
            _masked_cls,
            ("format", "tracesynth-masked-1"),
            ("workload", "progress"),
        ),
        Kind(
            "ar",
            _config_of(_ar_cls),
            _nested("ar"),
            lambda cfg: _ar_cls()(cfg),
            _ar_cls,
            ("format", "tracesynth-ar-2"),
            ("workload", "guide", "progress"),
        ),
        Kind(
            "block",
            _config_of(_block_cls),
            _nested("block"),
            lambda cfg: _block_cls()(cfg),
            _block_cls,
            ("format", "tracesynth-block-1"),
            ("workload", "guide", "progress"),
        ),
        Kind(
            "markov",
            _markov_config,
            _markov_parse,
            lambda cfg: _markov_cls()(cfg.order),
            _markov_cls,
            ("kind", "markov"),
            ("guide",),
        ),
        Kind("sdv_par", None, _sdv_par_parse, _sdv_par, None, None),
    )
}


def get_kind(name: Any) -> Kind:
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise TraceSynthError(f"unknown generator kind {name!r} (known: {', '.join(KINDS)})")
    return kind


def make_generator(spec: Mapping[str, Any] | Any) -> Generator:
    """A fresh (unfitted) generator, from a config spec {"kind": ..., kind's options} (a pipeline config's
    generator) or from a kind's config (`get_kind(name).config(options)`, as `tracesynth fit` builds it): the
    options a spec leaves out take the config class's defaults, so both build the same model."""
    if isinstance(spec, Mapping):
        kind = get_kind(spec.get("kind"))
        return kind.build(kind.parse(spec))
    kind = KINDS.get(getattr(type(spec), "kind", None))  # a config class names its kind
    if kind is None or kind.config_cls is None or not isinstance(spec, kind.config_cls()):
        raise TraceSynthError(f"not a generator config or spec: {type(spec).__name__}")
    return kind.build(spec)


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

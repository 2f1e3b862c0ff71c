"""The model zoo: published architecture numbers of real models, one JSON file each (weights are random).

A zoo file is ``{"name", "family", "hf_repo", "params_billion", "notes", "config": {...config.json fields...}}``.
:func:`load_config` also accepts a path to any Hugging Face ``config.json`` or to a local model directory that
holds one, so a model outside the zoo is traced the same way (nothing downloads).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from dooly.core.errors import DoolyError, one_line


@dataclass(frozen=True)
class ModelConfig:
    """A model to trace: its name, its config.json dict (``model_type`` included) and where it came from."""

    name: str
    config: dict[str, Any] = field(hash=False)
    source: str = ""
    family: str = ""
    hf_repo: str = ""
    params_billion: float | None = None


def _zoo_dir() -> Path:
    return Path(str(resources.files("dooly.core.zoo")))


#: A config file is read only up to this size and this JSON nesting depth (a config.json is a few KiB, nested
#: two or three levels): past them json.loads would take the memory, or the recursion limit, of a crafted file.
MAX_CONFIG_BYTES = 16 * 2**20
MAX_JSON_DEPTH = 64

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """Deepest nesting of arrays and objects in JSON ``text`` (brackets inside strings not counted)."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _read_json(path: Path) -> Any:
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)  # a FIFO or /dev/zero is cut off here too
    except OSError as exc:
        raise DoolyError(f"{path}: cannot read ({exc.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise DoolyError(f"{path}: larger than {MAX_CONFIG_BYTES // 2**20} MiB, not a model config")
    text = raw.decode("utf-8", "replace")
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise DoolyError(f"{path}: JSON nested {depth} deep, more than the {MAX_JSON_DEPTH} a model config may be")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise DoolyError(f"{path}: not valid JSON ({one_line(exc)})") from None


#: The largest value dooly accepts per config field, far above any published decoder (405B-class models: 126
#: layers, hidden 16384, FFN 53248; vocabularies up to 256k; MoE up to 256 routed experts). Tracing runs the
#: model layer by layer on fake tensors, so its time and memory grow with the layer count (about a second and
#: some megabytes per layer); 100,000 layers would run for hours and print nothing.
_LIMITS = (
    (1024, ("num_hidden_layers", "n_layer", "num_layers")),
    (1 << 17, ("hidden_size", "n_embd", "d_model")),
    (1 << 20, ("intermediate_size", "ffn_dim", "n_inner", "moe_intermediate_size")),
    (1 << 22, ("vocab_size",)),
    (4096, ("num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts", "n_routed_experts")),
    (1 << 24, ("max_position_embeddings",)),
)
SIZE_LIMITS: dict[str, int] = {key: limit for limit, keys in _LIMITS for key in keys}


def check_sizes(config: Mapping[str, Any], source: str) -> None:
    """Refuse, in one line naming ``source`` and the field, a config whose sizes no real model has (see
    :data:`SIZE_LIMITS`): it would trace for hours, or ask for exabytes of weights, instead of failing."""
    text = config.get("text_config")
    scopes = [("", config)] + ([("text_config.", text)] if isinstance(text, Mapping) else [])
    for prefix, fields in scopes:
        for key, limit in SIZE_LIMITS.items():
            v = fields.get(key)
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            if not 0 <= v <= limit:
                raise DoolyError(
                    f"{source}: {prefix}{key}={v} is outside 0..{limit}, the range dooly accepts "
                    "(no published model comes near it)"
                )


def _from_zoo_file(path: Path) -> ModelConfig:
    doc = _read_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
        raise DoolyError(f"{path}: a zoo file needs a 'config' object")
    cfg = doc["config"]
    if not cfg.get("model_type"):
        raise DoolyError(f"{path}: config has no 'model_type'")
    check_sizes(cfg, str(path))
    return ModelConfig(
        name=str(doc.get("name") or path.stem),
        config=cfg,
        source=str(path),
        family=str(doc.get("family", cfg["model_type"])),
        hf_repo=str(doc.get("hf_repo", "")),
        params_billion=doc.get("params_billion"),
    )


def list_models() -> list[ModelConfig]:
    """Every zoo model, sorted by name."""
    return [_from_zoo_file(p) for p in sorted(_zoo_dir().glob("*.json"))]


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A zoo model by name, or a ``config.json`` / zoo-style JSON file, or a local model directory."""
    text = str(name_or_path)
    zoo_file = _zoo_dir() / f"{text}.json"
    if "/" not in text and zoo_file.exists():
        return _from_zoo_file(zoo_file)
    path = Path(text)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise DoolyError(f"{path}: model directory has no config.json")
        path = path / "config.json"
    if not path.exists():
        names = ", ".join(m.name for m in list_models())
        raise DoolyError(f"{text}: not a zoo model or a config file (zoo: {names})")
    doc = _read_json(path)
    if isinstance(doc, dict) and isinstance(doc.get("config"), dict):
        return _from_zoo_file(path)
    if not isinstance(doc, dict) or not doc.get("model_type"):
        raise DoolyError(f"{path}: not a Hugging Face config.json (no 'model_type')")
    check_sizes(doc, str(path))
    name = path.parent.name if path.name == "config.json" else path.stem
    return ModelConfig(name=name or path.stem, config=doc, source=str(path), family=str(doc["model_type"]))


@dataclass(frozen=True)
class ModelSpec:
    """A model resolved once (:func:`resolve_model` of it returns its name and config without a lookup), with
    the argument it was resolved from (``source``: None for a config dict, which has no command-line spelling).
    Prints as that argument, so messages about it read as before it was resolved."""

    name: str
    config: Mapping[str, Any]
    source: str | None = None

    def __str__(self) -> str:
        return self.source if self.source is not None else self.name


def resolve_model(model: str | Path | Mapping[str, Any] | ModelSpec) -> tuple[str, dict[str, Any]]:
    """``(name, config dict)`` for a zoo name, a config.json path, a model directory, or a config dict.

    The one lookup every command goes through, so a model means the same config everywhere.
    """
    if isinstance(model, ModelSpec):  # resolved (and size-checked) already
        return model.name, dict(model.config)
    if isinstance(model, Mapping):
        cfg = dict(model)
        name = str(cfg.get("_name_or_path") or cfg.get("model_type"))
        check_sizes(cfg, name)
        return name, cfg
    mc = load_config(model)
    return mc.name, dict(mc.config)


def _text_fields(config: Mapping[str, Any]) -> Mapping[str, Any]:
    # multimodal configs nest the language model's fields under text_config
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def num_layers(config: Mapping[str, Any]) -> int | None:
    """Decoder layers of a config dict, under any of the names transformers configs use."""
    t = _text_fields(config)
    for k in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(t.get(k), int):
            return int(t[k])
    return None


def min_parameters(config: Mapping[str, Any]) -> int | None:
    """A lower bound on the parameters of a decoder from its config, without building it: the token embedding,
    and per layer the query and output projections (2 hidden^2) and an MLP of two matrices per expert (None
    when the config names no layer count or hidden size). Cheap where building even on the meta device is not."""
    t = _text_fields(config)

    def first(*keys: str) -> int:
        return next((int(t[k]) for k in keys if isinstance(t.get(k), int) and not isinstance(t.get(k), bool)), 0)

    layers, hidden = num_layers(config), first("hidden_size", "n_embd", "d_model")
    if not layers or not hidden:
        return None
    inter = first("moe_intermediate_size", "intermediate_size", "ffn_dim", "n_inner")
    experts = max(1, first("num_local_experts", "num_experts", "n_routed_experts"))
    return first("vocab_size") * hidden + layers * (2 * hidden * hidden + 2 * hidden * inter * experts)


def at_depth(config: Mapping[str, Any], layers: int) -> dict[str, Any] | None:
    """The config with its first ``layers`` decoder layers (per-layer lists such as ``layer_types`` cut to
    match); None when the config states no layer count."""
    total = num_layers(config)
    if total is None:
        return None
    out = copy.deepcopy(dict(config))
    text = out["text_config"] if isinstance(out.get("text_config"), dict) else out
    for k, v in list(text.items()):
        if k in ("num_hidden_layers", "n_layer", "num_layers") and v == total:
            text[k] = layers
        elif k.endswith("layer_types") and isinstance(v, list) and len(v) == total:
            text[k] = v[:layers]
    return out


def max_positions(config: Mapping[str, Any]) -> int | None:
    """Most positions one sequence may hold (None: unbounded).

    The position table's size (past it the embedding lookup fails), or the attention window when the config
    lists every layer as sliding (past it the cache stops growing, so longer contexts profile nothing new).
    A window on only some layers, or one the config does not place, is no limit.
    """
    t = _text_fields(config)
    keys = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")  # mpt: max_seq_len
    limits = [int(t[k]) for k in keys if isinstance(t.get(k), int)]
    window, types = t.get("sliding_window"), t.get("layer_types")
    if isinstance(window, int) and window > 0 and types and all("sliding" in str(x) for x in types):
        limits.append(window)
    return min(limits) if limits else None


#: Models a user profiles together in practice: the sizes of one family (one serving team evaluates all of
#: them on its hardware), or a dense model with its mixture-of-experts sibling (Mistral 7B / Mixtral 8x7B
#: share attention). Fine-tunes are not listed: a fine-tune keeps its base model's config.json, so every
#: signature is reused exactly and it adds nothing to profile (listing them would only inflate the saving).
#: Models without a sibling in the zoo (gemma-2-2b, phi-3-mini-4k, qwen1.5-moe-a2.7b) are profiled alone.
REALISTIC_GROUPS: dict[str, list[str]] = {
    "smollm2": ["smollm2-135m", "smollm2-360m", "smollm2-1.7b"],
    "qwen2.5": ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"],
    "llama-3": ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"],
    "opt": ["opt-125m", "opt-1.3b"],
    "mistral": ["mistral-7b-v0.1", "mixtral-8x7b"],
}


def realistic_list() -> list[str]:
    """The models of :data:`REALISTIC_GROUPS`, group by group, smallest first within a group."""
    return [m for group in REALISTIC_GROUPS.values() for m in group]


__all__ = [
    "REALISTIC_GROUPS",
    "SIZE_LIMITS",
    "ModelConfig",
    "ModelSpec",
    "at_depth",
    "check_sizes",
    "list_models",
    "load_config",
    "max_positions",
    "min_parameters",
    "num_layers",
    "realistic_list",
    "resolve_model",
]

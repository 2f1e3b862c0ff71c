"""The model zoo: published architecture numbers of real models, one JSON file each (weights are random).

A zoo file is ``{"name", "family", "hf_repo", "params_billion", "notes", "config": {...config.json fields...}}``.
:func:`load_config` also accepts a path to any Hugging Face ``config.json`` or to a local model directory that
holds one, so a model outside the zoo is traced the same way (nothing downloads).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from dooly.errors import DoolyError


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
    return Path(str(resources.files("dooly.zoo")))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise DoolyError(f"{path}: cannot read ({exc.strerror})") from None
    except ValueError as exc:
        raise DoolyError(f"{path}: not valid JSON ({exc})") from None


def _from_zoo_file(path: Path) -> ModelConfig:
    doc = _read_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
        raise DoolyError(f"{path}: a zoo file needs a 'config' object")
    cfg = doc["config"]
    if not cfg.get("model_type"):
        raise DoolyError(f"{path}: config has no 'model_type'")
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
    name = path.parent.name if path.name == "config.json" else path.stem
    return ModelConfig(name=name or path.stem, config=doc, source=str(path), family=str(doc["model_type"]))


def resolve_model(model: str | Path | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(name, config dict)`` for a zoo name, a config.json path, a model directory, or a config dict.

    The one lookup every command goes through, so a model means the same config everywhere.
    """
    if isinstance(model, Mapping):
        cfg = dict(model)
        return str(cfg.get("_name_or_path") or cfg.get("model_type")), cfg
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


__all__ = ["REALISTIC_GROUPS", "ModelConfig", "at_depth", "list_models", "load_config", "max_positions",
           "num_layers", "realistic_list", "resolve_model"]  # fmt: skip

"""The model zoo: published numbers, enough families, loadable from names, files and directories."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dooly.core.errors import DoolyError
from dooly.core.zoo import list_models, load_config
from dooly.trace.tracer import trace_model

ZOO = list_models()


def test_zoo_covers_the_required_architectures() -> None:
    assert len(ZOO) >= 12
    assert len({m.family for m in ZOO}) >= 6
    cfgs = {m.name: m.config for m in ZOO}
    # grouped-query attention, a sliding window, mixture of experts, small and 7-8B sizes
    assert any(c.get("num_key_value_heads", 0) < c["num_attention_heads"] for c in cfgs.values())
    assert cfgs["mistral-7b-v0.1"]["sliding_window"] == 4096
    assert any("num_local_experts" in c or "num_experts" in c for c in cfgs.values())
    sizes = [m.params_billion for m in ZOO]
    assert min(sizes) < 0.2 and any(7 <= s <= 8.1 for s in sizes)
    # spot-check published numbers
    assert cfgs["llama-3.1-8b"]["intermediate_size"] == 14336
    assert cfgs["qwen2.5-7b"]["num_key_value_heads"] == 4
    assert cfgs["gemma-2-2b"]["head_dim"] == 256


@pytest.mark.parametrize("model", ZOO, ids=[m.name for m in ZOO])
def test_every_zoo_config_builds_a_transformers_config(model) -> None:  # noqa: ANN001
    from dooly.engines.hf import HFEagerEngine

    cfg = HFEagerEngine().hf_config(model.config)
    assert cfg.model_type == model.config["model_type"]
    assert cfg.num_hidden_layers == model.config["num_hidden_layers"]


# Full-depth traces of the whole zoo are in bench/bench_trace.py; here one decoder layer (every per-layer shape
# exact) of three dissimilar architectures, or of the whole zoo with DOOLY_FULL_ZOO=1.
_QUICK = {"opt-125m", "gemma-2-2b", "mixtral-8x7b"}
_TRACED = [m for m in ZOO if os.environ.get("DOOLY_FULL_ZOO") == "1" or m.name in _QUICK]


@pytest.mark.parametrize("model", _TRACED, ids=[m.name for m in _TRACED])
def test_zoo_model_traces_with_no_model_specific_code(model) -> None:  # noqa: ANN001
    tr = trace_model(dict(model.config, num_hidden_layers=1), "prefill", name=model.name)
    mms = [r for r in tr.records if "mm" in r.signature.op]
    assert mms
    hidden = model.config["hidden_size"]
    assert any(hidden in t.shape for r in mms for t in r.signature.inputs)
    assert any("requests*tokens" in t.shape for r in mms for t in r.signature.inputs)


def test_load_config_from_file_and_directory(tmp_path: Path) -> None:
    cfg = dict(load_config("smollm2-135m").config)
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    by_dir = load_config(d)
    by_file = load_config(d / "config.json")
    assert by_dir.name == by_file.name == "my-model"
    assert by_dir.config == cfg
    zoo_file = Path(load_config("opt-125m").source)
    assert load_config(zoo_file).name == "opt-125m"


def test_load_config_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(DoolyError, match="not a zoo model"):
        load_config("no-such-model")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(DoolyError, match="config.json: not valid JSON"):
        load_config(bad)
    bad.write_text('{"hidden_size": 8}')
    with pytest.raises(DoolyError, match="model_type"):
        load_config(bad)
    with pytest.raises(DoolyError, match="no config.json"):
        load_config(_empty_dir(tmp_path))


def _empty_dir(root: Path) -> Path:
    d = root / "empty"
    d.mkdir()
    return d


def test_configs_past_the_bounds_are_refused_before_parsing_or_tracing(tmp_path: Path) -> None:
    from dooly.core.zoo import MAX_CONFIG_BYTES, MAX_JSON_DEPTH, SIZE_LIMITS, json_depth, resolve_model

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)  # json.loads: RecursionError
    with pytest.raises(DoolyError, match=r"deep\.json: JSON nested 100000 deep, more than the 64"):
        load_config(deep)
    assert json_depth('{"a": "[[[[\\"[[", "b": [[1]]}') == 3  # brackets in strings do not count
    ok = {"model_type": "llama", "x": json.loads("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))}
    (tmp_path / "ok.json").write_text(json.dumps(ok))
    assert load_config(tmp_path / "ok.json").config == ok
    big = tmp_path / "big.json"
    big.write_text('{"model_type": "llama", "pad": "' + "x" * MAX_CONFIG_BYTES + '"}')
    with pytest.raises(DoolyError, match=r"big\.json: larger than 16 MiB"):
        load_config(big)
    cfg = dict(load_config("smollm2-135m").config)
    for field, value in (("num_hidden_layers", 100_000), ("hidden_size", 10**9), ("vocab_size", -1)):
        f = tmp_path / f"{field}.json"
        f.write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(DoolyError, match=rf"{field}\.json: {field}={value} is outside 0\.\.{SIZE_LIMITS[field]}"):
            load_config(f)
    nested = {"model_type": "llava", "text_config": {**cfg, "num_hidden_layers": 5000}}
    with pytest.raises(DoolyError, match=r"text_config\.num_hidden_layers=5000"):
        resolve_model(nested)
    with pytest.raises(DoolyError, match=r"num_hidden_layers=2000"):  # a dict handed to the tracer directly
        trace_model({**cfg, "num_hidden_layers": 2000}, "prefill", name="deep-model")


def test_a_model_far_beyond_the_memory_is_refused_without_counting_it(monkeypatch) -> None:
    from dooly.core.zoo import min_parameters
    from dooly.engines import base
    from dooly.engines.hf import HFEagerEngine

    cfg = {**load_config("smollm2-135m").config, "num_hidden_layers": 1000, "hidden_size": 65536}
    assert min_parameters(cfg) > 1000 * 2 * 65536**2
    eng = HFEagerEngine()
    monkeypatch.setattr(eng, "num_parameters", lambda c: pytest.fail("built on the meta device"))
    monkeypatch.setattr(base, "free_memory_bytes", lambda device: 2**30)
    with pytest.raises(DoolyError, match=r"its weights take at least .* in bfloat16 and cpu has 1\.00 GiB free"):
        eng.check_weights_fit(cfg, name="giant")

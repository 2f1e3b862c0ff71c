"""The engine registry: engines are found by name, so commands never name an implementation."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dooly.cli import app
from dooly.core.errors import DoolyError
from dooly.engines import DEFAULT_ENGINE, Engine, engine_names, get_engine, register_engine
from dooly.engines.hf import HFEagerEngine


def test_default_engine_and_unknown_names() -> None:
    engine = get_engine()
    assert isinstance(engine, HFEagerEngine) and DEFAULT_ENGINE in engine_names()
    assert (engine.device, engine.dtype) == ("cpu", "bfloat16")
    with pytest.raises(DoolyError, match="unknown engine 'nope'"):
        get_engine("nope")


def test_a_registered_engine_is_found_and_its_missing_parts_are_clear(monkeypatch) -> None:
    import dooly.engines as engines

    class Bare(Engine):
        name = "bare"

        def __init__(self, device: str, dtype: str) -> None:
            self.device, self.dtype = device, dtype

        build_model = prepare = forward = advance = lambda *a, **k: None  # noqa: E731

    monkeypatch.setattr(engines, "_REGISTRY", dict(engines._REGISTRY))
    register_engine("bare", Bare)
    bare = get_engine("bare", dtype="float32")
    assert isinstance(bare, Bare) and bare.engine_id == "bare/cpu" and "bare" in engine_names()
    with pytest.raises(DoolyError, match="engine bare cannot serve"):
        bare.executor(None, 1, 8)
    with pytest.raises(DoolyError, match="engine bare does not describe"):
        bare.architecture({})


def test_serving_commands_take_the_engine_by_name(tmp_path) -> None:
    db = tmp_path / "p.db"
    db.write_bytes(b"")
    for cmd in ("simulate", "validate-serving"):
        res = CliRunner().invoke(app, [cmd, "smollm2-135m", "--db", str(db), "--engine", "nope"])
        assert res.exit_code != 0 and isinstance(res.exception, DoolyError), res.output
        assert "unknown engine 'nope'" in str(res.exception)


def test_weights_the_free_memory_cannot_hold_are_refused_before_building(monkeypatch) -> None:
    import torch
    from test_profile_fixtures import tiny_config
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dooly.engines import base

    cfg = tiny_config("tiny-mem")
    eng = HFEagerEngine()
    need = eng.num_parameters(eng.architecture(cfg)) * torch.bfloat16.itemsize
    assert eng.build_model(cfg) is not None  # this machine holds it
    monkeypatch.setattr(base, "free_memory_bytes", lambda device: need)  # less than weights / 0.9
    with pytest.raises(DoolyError, match=r"tiny-mem: its weights take .* MiB in bfloat16 and cpu has .* MiB free"):
        eng.build_model(cfg)
    assert eng.build_model(cfg, num_layers=1) is not None  # a cut model (profiling one layer) is not checked
    with FakeTensorMode():
        assert eng.build_model(cfg) is not None  # nor is one on fake tensors (tracing allocates nothing)
    monkeypatch.setattr(base, "free_memory_bytes", lambda device: None)  # unreadable: build as before
    assert eng.build_model(cfg) is not None

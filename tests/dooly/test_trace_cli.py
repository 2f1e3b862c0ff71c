"""`dooly trace` and `dooly zoo` end to end (tiny configs)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from dooly.cli import app
from dooly.core.errors import DoolyError
from dooly.trace.signature import traces_from_json

runner = CliRunner()

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}


def test_trace_two_configs_reports_sharing_and_writes_json(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "config.json").write_text(json.dumps(TINY))
    (b / "config.json").write_text(json.dumps(dict(TINY, intermediate_size=160)))
    out = tmp_path / "traces.json"
    res = runner.invoke(app, ["trace", str(a), str(b), "--phase", "prefill", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "shared" in res.output
    traces = traces_from_json(out.read_text(), str(out))
    assert [t.model for t in traces] == ["a", "b"]
    ua, ub = set(traces[0].unique()), set(traces[1].unique())
    shared = len(ua & ub)
    assert 0 < shared < len(ua)
    assert f"{shared} ({100 * shared / len(ua):.0f}%)" in res.output


def test_zoo_lists_models() -> None:
    res = runner.invoke(app, ["zoo"])
    assert res.exit_code == 0
    assert "mixtral" in res.output and "gemma2" in res.output


def test_bad_model_is_a_dooly_error_before_any_tracing(tmp_path: Path) -> None:
    # main() turns a DoolyError into one line on stderr and exit status 1
    res = runner.invoke(app, ["trace", "smollm2-135m", "no-such-model", "--json", str(tmp_path / "t.json")])
    assert isinstance(res.exception, DoolyError)
    assert "no-such-model: not a zoo model" in str(res.exception)
    assert "tracing" not in res.output and not (tmp_path / "t.json").exists()
    res = runner.invoke(app, ["trace", "opt-125m", "--phase", "train"])
    assert isinstance(res.exception, DoolyError) and "--phase" in str(res.exception)


# A small SSM (mamba-style) config: its code fixes the request sizes to constants, so no phase can be labelled.
SSM = {
    "model_type": "mamba",
    "hidden_size": 32,
    "state_size": 4,
    "num_hidden_layers": 1,
    "vocab_size": 64,
    "intermediate_size": 64,
    "conv_kernel": 4,
    "time_step_rank": 4,
}


def test_ssm_model_is_refused_with_the_same_one_line_error_in_every_phase(tmp_path: Path) -> None:
    cfg = tmp_path / "ssm.json"
    cfg.write_text(json.dumps(SSM))
    messages = {}
    for phase in ("decode", "chunk"):  # chunk used to escape as a RuntimeError traceback from the fake forward
        res = runner.invoke(app, ["trace", str(cfg), "--phase", phase])
        assert isinstance(res.exception, DoolyError), (phase, res.exception)
        messages[phase] = str(res.exception)
    assert messages["chunk"] == messages["decode"]
    assert "specialised request size kv_len" in messages["chunk"] and "\n" not in messages["chunk"]

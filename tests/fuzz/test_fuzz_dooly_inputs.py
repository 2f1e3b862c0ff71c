"""Fuzz: seeded hostile model configs fed to the dooly commands that read one (`trace`, `plan`, `profile`).

A config.json is input from anywhere. Each case takes a small llama config and makes it hostile one way: JSON
nested far past what json.loads can recurse through, a file past the 16 MiB a config may be, or a size field
(layers, hidden, FFN, vocabulary, experts, heads; at the top or under ``text_config``) set huge, negative,
infinite or NaN. Asserted: exit 1 with one line that names the file (no traceback), no hang, and no profile
DB created. Every such config is refused before any tracing, so a case takes the seconds of starting dooly.
The first case runs as a subprocess (the honest check that stderr holds no traceback), the others through
the same entry point in this process.

``DOOLY_FUZZ_CASES`` (default 6) and ``DOOLY_FUZZ_SEED`` (default 0) set the run; kind and command are cycled.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import Result, dooly_in_process

CASES = int(os.environ.get("DOOLY_FUZZ_CASES", "6"))
SEED = int(os.environ.get("DOOLY_FUZZ_SEED", "0"))
TIMEOUT_S = 180  # a hang, not a slow case: a refusal comes before any tracing
SRC = Path(__file__).resolve().parents[2] / "src"

TINY = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 64,
    "max_position_embeddings": 512,
}
SIZE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_local_experts",
    "max_position_embeddings",
)
KINDS = ("deep", "oversize", "huge", "nested_huge", "odd_number", "deep_object")
COMMANDS = (
    ["trace", "{model}"],
    ["plan", "{model}", "--db", "{db}", "--grid", "tiny"],
    ["profile", "{model}", "--db", "{db}", "--grid", "tiny", "--no-calibrate"],
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({"DOOLY_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COLUMNS": "200"})
    return env


def _run(argv: list[str], cwd: Path, subprocess_: bool) -> Result:
    """`dooly ARGV` as a user runs it (a subprocess: the first case), or through the same entry point in this
    process (the others: torch's imports paid once)."""
    if not subprocess_:
        return dooly_in_process(argv, cwd, _env(), TIMEOUT_S)
    try:
        p = subprocess.run([sys.executable, "-m", "dooly", *argv], cwd=cwd, env=_env(), capture_output=True,
                           text=True, timeout=TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        return Result(-1, str(exc.stdout or ""), str(exc.stderr or ""), timed_out=True)
    return Result(p.returncode, p.stdout, p.stderr)


def _huge(rng: random.Random) -> int:
    return rng.choice([10**5, 2**31, 10**18, 10**40, -1, -(10**9)])


def _write(path: Path, kind: str, rng: random.Random) -> str:
    """Write the hostile config for ``kind``; returns what it is, in a few words."""
    cfg = dict(TINY)
    if kind in ("deep", "deep_object"):
        n = rng.choice([65, 1000, 100_000])
        open_, close = ("[", "]") if kind == "deep" else ('{"a":', "}")
        key = rng.choice(["rope_scaling", "num_hidden_layers", "extra"])
        text = json.dumps(cfg)[:-1] + f', "{key}": ' + open_ * n + "1" + close * n + "}"
        path.write_text(text)
        return f"{key} nested {n} deep"
    if kind == "oversize":
        cfg["pad"] = "x" * (16 * 2**20 + rng.randrange(1, 4096))
        path.write_text(json.dumps(cfg))
        return "a 16 MiB string"
    field = rng.choice(SIZE_FIELDS)
    if kind == "odd_number":
        value = rng.choice([math.inf, -math.inf, math.nan, 1e300, -0.5])
        cfg[field] = value
        path.write_text(json.dumps(cfg))  # Infinity / NaN: Python's json reads what it writes
        return f"{field}={value}"
    value = _huge(rng)
    if kind == "nested_huge":
        cfg = {"model_type": "llava", "text_config": {**cfg, field: value}}
        path.write_text(json.dumps(cfg))
        return f"text_config.{field}={value}"
    cfg[field] = value
    path.write_text(json.dumps(cfg))
    return f"{field}={value}"


@pytest.mark.parametrize("case", range(CASES))
def test_hostile_config_is_refused_in_one_line(tmp_path: Path, case: int) -> None:
    kind = KINDS[case % len(KINDS)]
    template = COMMANDS[(case + case // len(KINDS)) % len(COMMANDS)]
    rng = random.Random(f"{SEED}:{case}")
    model, db = tmp_path / "config.json", tmp_path / "p.db"
    what = _write(model, kind, rng)
    argv = [a.format(model=model, db=db) for a in template]
    res = _run(argv, tmp_path, subprocess_=case == 0)
    if res.timed_out:
        pytest.fail(f"case {case}, {kind} ({what}): `dooly {argv[0]}` hung (no exit within {TIMEOUT_S} s)")
    where = f"case {case} (seed {SEED}), {kind}: {what}; dooly {argv[0]} -> exit {res.code}"
    out = res.out + res.err
    assert res.code == 1, f"{where}\n{out[-3000:]}"
    assert "Traceback" not in out, f"{where}\n{out[-3000:]}"
    errors = [ln for ln in out.splitlines() if "error" in ln.lower()]
    assert errors and str(model) in errors[0], f"{where}: the error does not name the file\n{out[-3000:]}"
    assert not db.exists(), f"{where}: a refused run created {db.name}"

"""Fuzz: seeded mutations of a small real profile DB, fed to the dooly commands that read one.

A profile DB is input a user may receive from elsewhere. Each case copies a DB built here (a real trace of a
tiny llama config, a point per grid value of every signature, a few forwards), mutates it one way (truncation,
byte flips, a garbage page, a wrong schema, huge / NaN / ill-typed values in rows, hostile shape expressions,
JSON nested past Python's recursion limit)
and runs one command on it (the first case in a subprocess, ``python -m dooly ...``; the others through the same
entry point in this process, torch's imports paid once). Asserted: exit 0 or 1, no traceback, no
hang, the DB file byte-identical after a command that only reads, nothing written beside it, and no output
left behind by a command that failed.

``DOOLY_FUZZ_CASES`` (default 7: each mutation kind once) and ``DOOLY_FUZZ_SEED`` (default 0) set the run; kind
and command are cycled so that 42 cases pair every kind with every command.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import Result, dooly_in_process

CASES = int(os.environ.get("DOOLY_FUZZ_CASES", "7"))
SEED = int(os.environ.get("DOOLY_FUZZ_SEED", "0"))
TIMEOUT_S = 180  # a hang, not a slow case: the slowest command takes ~10 s of CPU on this tiny model
SRC = Path(__file__).resolve().parents[2] / "src"

TINY = {
    "model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 512,
    "_name_or_path": "fuzz-tiny",
}  # fmt: skip

KINDS = ("truncate", "flip", "garbage_page", "schema", "values", "expression", "deep")

# (name, argv after the model/db, whether it only reads the DB, outputs it writes under the case directory)
COMMANDS = (
    ("plan", ["plan", "{model}", "--db", "{db}", "--grid", "tiny"], True, []),
    ("report", ["report", "--db", "{db}", "-o", "{out}/r.html"], True, ["r.html"]),
    (
        "simulate",
        ["simulate", "{model}", "--db", "{db}", "--workload", "poisson:n=4,rate=2,prompt=8-16,output=2-4,seed=0"],
        True,
        [],
    ),  # fmt: skip
    ("export-vidur", ["export-vidur", "{model}", "--db", "{db}", "-o", "{out}/vidur"], True, ["vidur"]),
    (
        "validate",
        ["validate", "{model}", "--db", "{db}", "--repeats", "1", "--rounds", "1", "--method", "interp"],
        True,
        [],
    ),  # fmt: skip
    ("profile", ["profile", "{model}", "--db", "{db}", "--grid", "tiny", "--no-calibrate"], False, []),
)

HOSTILE = [
    "9**9**9", "tokens**99999999", "(2**62)*(2**62)*(2**62)", "__import__('os').system('touch PWNED')",
    "tokens//(kv_len-kv_len)", "1e9", "'a'*10**9", "max()", "-" * 500 + "1", "kv_len+", 2**80, -5, None,
    [1, 2], "requests*" * 60 + "tokens",
]  # fmt: skip
ODD_VALUES = [
    float("nan"), float("inf"), -1.0, 1e308, -1e308, 2**63 - 1, -(2**63), 0, "NaN", "fast", b"\x00\xff",
    '{"tokens": 1e999}', '{"tokens": -5}', "[]", "", "{", '{"tokens": "x"}',
]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({"DOOLY_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COLUMNS": "200"})
    return env


def _build(db: Path, cfg: Path) -> None:
    """A profile DB as `dooly profile --grid tiny` writes it, with synthetic timings (no minutes of timing)."""
    from dooly.core.zoo import resolve_model
    from dooly.db.store import Measurement, ProfileStore
    from dooly.engines import get_engine
    from dooly.profile import GridSpec, context_for, model_traces
    from dooly.trace.signature import canonical_json

    engine = get_engine("hf-eager", device="cpu", dtype="bfloat16")
    ctx = context_for(engine, 1)
    grid = GridSpec.tiny()
    name, config = resolve_model(str(cfg))
    with ProfileStore(db) as st:
        for phase, tr in model_traces(name, config, engine, st).items():
            for sig in tr.unique():
                pts = grid.signature_points(phase, sig.symbols())
                st.register_signature(ctx, sig.key, canonical_json(sig.to_dict()), len(pts))
                for p in pts:
                    t = 2e-6 * (1 + sum(p.values()) / 16)
                    st.put_point(ctx, sig.key, p, Measurement(t, 0.9 * t, 1.1 * t, 3, 5 * t))
                st.mark_complete(ctx, sig.key)
            for p in grid.phase_points(phase)[:6]:
                t = 1e-4 * (1 + sum(p.values()) / 16)
                st.put_forward(ctx, name, phase, p, Measurement(t, 0.9 * t, 1.1 * t, 3, 5 * t))
        st.put_trace("config", name, "config", canonical_json(config))  # as the calibration stores it


@pytest.fixture(scope="module")
def profile_db(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("fuzzdb")
    cfg = d / "fuzz-tiny.json"
    cfg.write_text(json.dumps(TINY))
    db = d / "p.db"
    _build(db, cfg)
    assert sorted(p.name for p in d.iterdir()) == ["fuzz-tiny.json", "p.db"]
    return db, cfg


# -- mutations (each takes the DB path and a seeded Random; returns a one-line description) ---------------


def _truncate(db: Path, rng: random.Random) -> str:
    data = db.read_bytes()
    n = rng.choice([0, rng.randrange(1, 100), rng.randrange(len(data))])
    db.write_bytes(data[:n])
    return f"truncated to {n} of {len(data)} bytes"


def _flip(db: Path, rng: random.Random) -> str:
    data = bytearray(db.read_bytes())
    where = sorted(rng.randrange(len(data)) for _ in range(rng.randint(1, 24)))
    for i in where:
        data[i] ^= 1 << rng.randrange(8)
    db.write_bytes(bytes(data))
    return f"bits flipped at {where}"


def _garbage_page(db: Path, rng: random.Random) -> str:
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big") or 65536
    k = rng.randrange(len(data) // page)
    data[k * page : (k + 1) * page] = rng.randbytes(page)
    db.write_bytes(bytes(data))
    return f"page {k} ({page} bytes) replaced by random bytes"


_SCHEMA_EDITS = [
    "DROP TABLE points",
    "DROP TABLE traces",
    "DROP TABLE meta",
    "ALTER TABLE points RENAME COLUMN median_s TO m",
    "ALTER TABLE forwards ADD COLUMN extra TEXT",
    "ALTER TABLE signatures DROP COLUMN complete",
    "UPDATE meta SET value = '2' WHERE key = 'schema_version'",
    "UPDATE meta SET value = 'one' WHERE key = 'schema_version'",
    "DELETE FROM meta",
    "CREATE TABLE unrelated (x)",
]


def _sql(db: Path, statements: list[tuple[str, tuple]]) -> None:
    con = sqlite3.connect(db)
    try:
        for stmt, params in statements:
            con.execute(stmt, params)
        con.commit()
    finally:
        con.close()


def _schema(db: Path, rng: random.Random) -> str:
    done = []
    for edit in rng.sample(_SCHEMA_EDITS, rng.randint(1, 2)):
        try:
            _sql(db, [(edit, ())])
        except sqlite3.OperationalError:  # an earlier edit dropped what this one changes
            continue
        done.append(edit)
    return "; ".join(done)


_VALUE_COLUMNS = {
    "points": ["median_s", "p10_s", "p90_s", "repeats", "cost_s", "point", "created", "sig_key", "hardware"],
    "forwards": ["median_s", "p10_s", "p90_s", "repeats", "cost_s", "point", "model", "phase"],
    "signatures": ["grid_size", "complete", "sig_json"],
    "traces": ["trace_json", "created", "model"],
}


def _values(db: Path, rng: random.Random) -> str:
    done = []
    for _ in range(rng.randint(1, 3)):
        table = rng.choice(sorted(_VALUE_COLUMNS))
        col = rng.choice(_VALUE_COLUMNS[table])
        value = rng.choice(ODD_VALUES)
        scope = rng.choice(["", " WHERE rowid = (SELECT MIN(rowid) FROM {t})"]).format(t=table)
        try:
            _sql(db, [(f"UPDATE {table} SET {col} = ?{scope}", (value,))])
        except sqlite3.IntegrityError:  # NaN binds as NULL; NOT NULL columns refuse it: store it as text
            _sql(db, [(f"UPDATE {table} SET {col} = ?{scope}", (str(value),))])
        done.append(f"{table}.{col}={value!r}{' (one row)' if scope else ''}")
    return "; ".join(done)


def _hostile_signature(sig: dict, rng: random.Random) -> None:
    specs = [t for t in sig.get("inputs", []) if t.get("shape")]
    if specs:
        spec = rng.choice(specs)
        spec["shape"][rng.randrange(len(spec["shape"]))] = rng.choice(HOSTILE)
    else:
        sig["args"] = json.dumps({"args": [{"sym": rng.choice([h for h in HOSTILE if isinstance(h, str)])}],
                                  "kwargs": {}})  # fmt: skip


def _expression(db: Path, rng: random.Random) -> str:
    con = sqlite3.connect(db)
    try:
        traces = con.execute("SELECT rowid, trace_json FROM traces").fetchall()
        sigs = con.execute("SELECT rowid, sig_json FROM signatures").fetchall()
    finally:
        con.close()
    traces = [(rowid, text) for rowid, text in traces if "signatures" in json.loads(text)]  # not the stored config
    edits: list[tuple[str, tuple]] = []
    for rowid, text in rng.sample(traces, rng.randint(1, len(traces))):
        doc = json.loads(text)
        for key in rng.sample(sorted(doc["signatures"]), rng.randint(1, 3)):
            _hostile_signature(doc["signatures"][key], rng)
        edits.append(("UPDATE traces SET trace_json = ? WHERE rowid = ?", (json.dumps(doc), rowid)))
    for rowid, text in rng.sample(sigs, min(len(sigs), 3)):
        doc = json.loads(text)
        _hostile_signature(doc, rng)
        edits.append(("UPDATE signatures SET sig_json = ? WHERE rowid = ?", (json.dumps(doc), rowid)))
    _sql(db, edits)
    return f"hostile shape expressions in {len(edits)} rows"


def _deep(db: Path, rng: random.Random) -> str:
    """JSON nested past what json.loads recurses through (SQLite's json_valid accepts up to 2000 levels)."""
    n = rng.choice([65, 999, 1500])
    table, col = rng.choice([("signatures", "sig_json"), ("traces", "trace_json")])
    con = sqlite3.connect(db)
    try:
        rows = con.execute(f"SELECT rowid, {col} FROM {table}").fetchall()
    finally:
        con.close()
    rowid, text = rng.choice(rows)
    doc = json.loads(text)
    key = rng.choice(sorted(doc))
    deep = "[" * n + "1" + "]" * n
    if key == "records" and isinstance(doc[key], list) and doc[key]:
        doc[key][0] = "__DEEP__"  # one record nested deep, "records" still an array
    else:
        doc[key] = "__DEEP__"
    _sql(db, [(f"UPDATE {table} SET {col} = ? WHERE rowid = ?", (json.dumps(doc).replace('"__DEEP__"', deep), rowid))])
    return f"{table}.{col} row {rowid}: {key} nested {n} deep"


MUTATE = {"truncate": _truncate, "flip": _flip, "garbage_page": _garbage_page, "schema": _schema,
          "values": _values, "expression": _expression, "deep": _deep}  # fmt: skip


def _run(cmd: list[str], cwd: Path, in_process: bool = False) -> Result:
    """`dooly CMD` as a user runs it (a subprocess), or through the same entry point in this process (torch's
    imports paid once: every mutated case but the first)."""
    if in_process:
        res = dooly_in_process(cmd, cwd, _env(), TIMEOUT_S)
    else:
        try:
            p = subprocess.run([sys.executable, "-m", "dooly", *cmd], cwd=cwd, env=_env(), capture_output=True,
                               text=True, timeout=TIMEOUT_S)  # fmt: skip
        except subprocess.TimeoutExpired:
            res = Result(-1, "", "", timed_out=True)
        else:
            res = Result(p.returncode, p.stdout, p.stderr)
    if res.timed_out:
        pytest.fail(f"`dooly {' '.join(cmd)}` hung (no exit within {TIMEOUT_S} s)")
    return res


def _argv(template: list[str], model: Path, db: Path, out: Path) -> list[str]:
    return [a.format(model=model, db=db, out=out) for a in template]


def test_unmutated_db_is_read_by_the_deepest_reader(profile_db: tuple[Path, Path], tmp_path: Path) -> None:
    """The fixture is a real profile: simulate reads its traces, points and forwards and succeeds."""
    db, cfg = profile_db
    before = db.read_bytes()
    res = _run(_argv(COMMANDS[2][1], cfg, db, tmp_path), tmp_path, in_process=True)
    assert res.code == 0, res.err[-2000:]
    assert "throughput" in res.out
    assert db.read_bytes() == before


@pytest.mark.parametrize("case", range(CASES))
def test_mutated_profile_db(profile_db: tuple[Path, Path], tmp_path: Path, case: int) -> None:
    src_db, cfg = profile_db
    kind = KINDS[case % len(KINDS)]
    name, template, readonly, outputs = COMMANDS[(case % len(KINDS) + case // len(KINDS)) % len(COMMANDS)]
    rng = random.Random(f"{SEED}:{case}")
    work = tmp_path / "case"
    work.mkdir()
    db = work / "p.db"
    shutil.copyfile(src_db, db)
    what = MUTATE[kind](db, rng)
    for leftover in work.glob("p.db-*"):  # the mutation's own sqlite session left nothing to replay
        leftover.unlink()
    before = db.read_bytes()
    res = _run(_argv(template, cfg, db, work), work, in_process=case > 0)
    where = f"case {case} (seed {SEED}), {kind}: {what}; dooly {name} -> exit {res.code}"
    assert res.code in (0, 1), f"{where}\n{res.err[-3000:]}"
    assert "Traceback" not in res.err and "Traceback" not in res.out, f"{where}\n{res.err[-3000:]}"
    if res.code == 1:
        assert res.err.strip(), where  # the failure says why
    assert not (work / "PWNED").exists(), where
    left = sorted(p.name for p in work.iterdir())
    if readonly:
        assert db.read_bytes() == before, f"{where}: a reading command altered the DB"
        expected = ["p.db"] + (outputs if res.code == 0 else [])
        assert left == sorted(expected), f"{where}: files left {left}"

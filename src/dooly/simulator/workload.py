"""Workloads: request arrival times with prompt and output lengths, from a trace file or a generator.

A trace file is CSV or JSONL with one request per row: an arrival time in seconds (``arrival_time``;
Vidur's ``arrived_at`` and ``timestamp`` are accepted too), ``prompt_tokens`` (or ``num_prefill_tokens``)
and ``output_tokens`` (or ``num_decode_tokens``).

A generator spec is a string such as ``poisson:n=64,rate=2,prompt=32-256,output=16,seed=0``:
arrivals are ``poisson`` (exponential gaps), ``gamma`` (``cv`` sets burstiness; cv=1 is Poisson) or
``static`` (all at t=0); a length is fixed (``128``), uniform on a range (``32-256``) or log-normal
(``ln:MEDIAN:SIGMA``, clipped to [1, 8 * MEDIAN]).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from atomicio import atomic_path
from dooly.core.errors import DoolyError
from dooly.simulator.entities import Request

ARRIVAL_KEYS = ("arrival_time", "arrived_at", "arrival", "timestamp")
PROMPT_KEYS = ("prompt_tokens", "num_prefill_tokens", "input_tokens", "prompt_len")
OUTPUT_KEYS = ("output_tokens", "num_decode_tokens", "output_len", "max_new_tokens")


@dataclass(frozen=True)
class Workload:
    """Requests as three aligned arrays, sorted by arrival."""

    arrival: np.ndarray  # float64 seconds
    prompt: np.ndarray  # int64
    output: np.ndarray  # int64
    name: str = "workload"

    def __post_init__(self) -> None:
        order = np.argsort(self.arrival, kind="stable")
        object.__setattr__(self, "arrival", np.asarray(self.arrival, dtype=np.float64)[order])
        object.__setattr__(self, "prompt", np.asarray(self.prompt, dtype=np.int64)[order])
        object.__setattr__(self, "output", np.asarray(self.output, dtype=np.int64)[order])
        if not (len(self.arrival) == len(self.prompt) == len(self.output)):
            raise DoolyError(f"{self.name}: arrival, prompt and output columns differ in length")
        if len(self.arrival) == 0:
            raise DoolyError(f"{self.name}: the workload has no requests")
        if np.any(self.prompt < 1) or np.any(self.output < 1):
            raise DoolyError(f"{self.name}: prompt and output token counts must be >= 1")
        if not np.all(np.isfinite(self.arrival)) or np.any(self.arrival < 0):
            raise DoolyError(f"{self.name}: arrival times must be finite and >= 0")

    def __len__(self) -> int:
        return len(self.arrival)

    def requests(self) -> list[Request]:
        """Fresh Request objects (serving state zeroed), ids in arrival order."""
        return [
            Request(i, float(a), int(p), int(o))
            for i, (a, p, o) in enumerate(zip(self.arrival, self.prompt, self.output, strict=True))
        ]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        with atomic_path(path) as tmp, tmp.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["arrival_time", "prompt_tokens", "output_tokens"])
            for a, p, o in zip(self.arrival, self.prompt, self.output, strict=True):
                w.writerow([f"{a:.6f}", int(p), int(o)])
        return path


def _pick(row: dict, keys: tuple[str, ...], path: Path, line: int) -> str:
    for k in keys:
        if k in row and row[k] not in (None, ""):
            return row[k]
    raise DoolyError(f"{path}: row {line} has none of the columns {', '.join(keys)}")


def load_workload(path: str | Path) -> Workload:
    """Read a CSV or JSONL request trace (see the module docstring for the columns)."""
    path = Path(path)
    if not path.is_file():
        raise DoolyError(f"{path}: no such workload file")
    rows: list[dict] = []
    try:
        if path.suffix.lower() in (".jsonl", ".json", ".ndjson"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    obj = json.loads(line)
                    if not isinstance(obj, dict):
                        raise DoolyError(f"{path}: line {i} is not a JSON object")
                    rows.append(obj)
        else:
            with path.open(newline="") as fh:
                rows = list(csv.DictReader(fh))
    except (json.JSONDecodeError, UnicodeDecodeError, csv.Error) as exc:
        raise DoolyError(f"{path}: not a readable CSV/JSONL request trace ({exc})") from None
    try:
        arrival = [float(_pick(r, ARRIVAL_KEYS, path, i)) for i, r in enumerate(rows, 1)]
        prompt = [int(float(_pick(r, PROMPT_KEYS, path, i))) for i, r in enumerate(rows, 1)]
        output = [int(float(_pick(r, OUTPUT_KEYS, path, i))) for i, r in enumerate(rows, 1)]
    except ValueError as exc:
        raise DoolyError(f"{path}: a value is not a number ({exc})") from None
    if arrival:
        arrival = list(np.asarray(arrival) - min(arrival))  # traces often carry wall-clock epochs
    return Workload(np.asarray(arrival), np.asarray(prompt), np.asarray(output), name=str(path))


def sample_lengths(spec: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Token counts from a length spec: ``128``, ``32-256`` or ``ln:MEDIAN:SIGMA``."""
    try:
        if spec.startswith("ln:"):
            _, median, sigma = spec.split(":")
            med = float(median)
            x = rng.lognormal(np.log(med), float(sigma), n)
            return np.clip(np.rint(x), 1, 8 * med).astype(np.int64)
        if "-" in spec:
            lo, hi = (int(v) for v in spec.split("-"))
            if lo < 1 or hi < lo:
                raise ValueError
            return rng.integers(lo, hi + 1, n, dtype=np.int64)
        value = int(spec)
        if value < 1:
            raise ValueError
        return np.full(n, value, dtype=np.int64)
    except ValueError:
        raise DoolyError(f"bad length spec {spec!r}: use 128, 32-256 or ln:MEDIAN:SIGMA") from None


def generate_workload(
    n: int,
    rate: float,
    arrival: str = "poisson",
    prompt: str = "128",
    output: str = "32",
    cv: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Synthetic requests: `n` arrivals at `rate` requests/s (Poisson, gamma with coefficient of variation
    `cv`, or all at once), prompt/output lengths from the given specs. Deterministic for a seed."""
    if n < 1:
        raise DoolyError("a generated workload needs n >= 1 requests")
    rng = np.random.default_rng(seed)
    if arrival == "static":
        times = np.zeros(n)
    else:
        if rate <= 0:
            raise DoolyError(f"arrival rate must be > 0, got {rate}")
        if arrival == "poisson":
            gaps = rng.exponential(1.0 / rate, n)
        elif arrival == "gamma":
            if cv <= 0:
                raise DoolyError(f"gamma arrivals need cv > 0, got {cv}")
            shape = 1.0 / cv**2
            gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
        else:
            raise DoolyError(f"unknown arrival process {arrival!r}: use poisson, gamma or static")
        gaps[0] = 0.0  # the first request opens the run
        times = np.cumsum(gaps)
    name = f"{arrival}:n={n},rate={rate:g},prompt={prompt},output={output}"
    return Workload(times, sample_lengths(prompt, n, rng), sample_lengths(output, n, rng), name=name)


def parse_workload(spec: str) -> Workload:
    """A trace file path, or a generator spec ``KIND:key=value,...`` (see the module docstring)."""
    path = Path(spec)
    if path.suffix.lower() in (".csv", ".jsonl", ".json", ".ndjson") or path.exists():
        return load_workload(path)
    kind, _, rest = spec.partition(":")
    if kind not in ("poisson", "gamma", "static"):
        raise DoolyError(f"{spec}: neither a workload file nor a generator spec (poisson:/gamma:/static:...)")
    kw: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            raise DoolyError(f"{spec}: expected key=value, got {part!r}")
        kw[key.strip()] = value.strip()
    unknown = set(kw) - {"n", "rate", "prompt", "output", "cv", "seed"}
    if unknown:
        raise DoolyError(f"{spec}: unknown generator keys {sorted(unknown)}")
    try:
        return generate_workload(
            n=int(kw.get("n", 64)),
            rate=float(kw.get("rate", 1.0)),
            arrival=kind,
            prompt=kw.get("prompt", "128"),
            output=kw.get("output", "32"),
            cv=float(kw.get("cv", 1.0)),
            seed=int(kw.get("seed", 0)),
        )
    except ValueError as exc:
        raise DoolyError(f"{spec}: bad number ({exc})") from None

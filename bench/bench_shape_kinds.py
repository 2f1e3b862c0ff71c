"""Leave-one-signature-out error of the shape model's attention kinds on a profile DB, per signature.

    .venv/bin/python bench/bench_shape_kinds.py /tmp/budget70/bench.db

Run it with another checkout's ``src`` first on PYTHONPATH to compare shape features on the same points.
"""

from __future__ import annotations

import sys

import numpy as np

from dooly.engines import get_engine
from dooly.profiler import context_for
from dooly.shape_model import ShapeModel, features, fit_kind, kind_of, signatures_of
from dooly.store import ProfileStore


def rows_of(sig, pts):  # type: ignore[no-untyped-def]
    return np.array([features(sig, {a: int(b) for a, b in p.items()}) for p, _ in pts]), np.array([t for _, t in pts])


def main(db: str) -> None:
    with ProfileStore(db, readonly=True) as st:
        ctx = context_for(get_engine(), 1)
        complete = st.complete_keys(ctx)
        pts = {k: [(p, m.median_s) for p, m in v] for k, v in st.all_points(ctx).items() if k in complete}
        sigs = signatures_of(st, ctx, pts)
    model = ShapeModel.fit(sigs, pts)
    for kind, km in sorted(model.kinds.items(), key=lambda kv: -kv[1].n_signatures):
        if "scaled_dot" not in kind:
            continue
        print(f"{km.n_signatures:3d} sigs {km.n_points:4d} pts loso {km.loso_mape:6.1f}% ({km.fit.form}) {kind[:140]}")
        keys = [k for k in pts if kind_of(sigs[k]) == kind]
        for k in keys:
            fit = fit_kind(kind, {j: rows_of(sigs[j], pts[j]) for j in keys if j != k})
            if fit is None:
                continue
            fb, t = rows_of(sigs[k], pts[k])
            e = fit.predict(fb) / t - 1
            shapes = [x.shape for x in sigs[k].inputs][:2]
            print(f"     {shapes} MAPE {100 * np.mean(np.abs(e)):.1f}% bias {100 * np.mean(e):+.1f}%")


if __name__ == "__main__":
    main(sys.argv[1])

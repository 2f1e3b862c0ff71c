"""Leave-one-signature-out error of the shape model's kinds of one operator on a profile DB, per signature.

    .venv/bin/python bench/bench_shape_kinds.py /tmp/budget70/bench.db                   # attention
    .venv/bin/python bench/bench_shape_kinds.py /tmp/budget70/bench.db --op aten.mm.default

A roofline kind also prints its fitted coefficients: the per-call constant and the seconds per byte moved (as a
bandwidth), which say how it extrapolates to matrices larger than those it was fitted on.

Run it with another checkout's ``src`` first on PYTHONPATH to compare shape features on the same points.
"""

from __future__ import annotations

import argparse

import numpy as np

from dooly.db.shape_model import ShapeModel, fit_kind, kind_of, signature_rows, signatures_of
from dooly.db.store import ProfileStore
from dooly.engines import get_engine
from dooly.profile import context_for


def main(db: str, op: str) -> None:
    with ProfileStore(db, readonly=True) as st:
        ctx = context_for(get_engine(), 1)
        complete = st.complete_keys(ctx)
        pts = {k: [(p, m.median_s) for p, m in v] for k, v in st.all_points(ctx).items() if k in complete}
        sigs = signatures_of(st, ctx, pts)
    model = ShapeModel.fit(sigs, pts)
    for kind, km in sorted(model.kinds.items(), key=lambda kv: -kv[1].n_signatures):
        if op not in kind:
            continue
        print(f"{km.n_signatures:3d} sigs {km.n_points:4d} pts loso {km.loso_mape:6.1f}% ({km.fit.form}) {kind[:140]}")
        if km.fit.form == "roofline":  # coefficients of [1, flops, bytes, tasks, gemv bytes]
            c = km.fit.coef
            gbs = f"{1e-9 / c[2]:.1f} GB/s" if c[2] > 0 else "no byte term"
            print(
                f"     constant {1e6 * c[0]:.1f} us, {1e12 * c[2]:.1f} ps per byte ({gbs}), one-row bytes "
                f"+{1e12 * c[4]:.1f} ps"
            )
        keys = [k for k in pts if kind_of(sigs[k]) == kind]
        for k in keys:
            fit = fit_kind(kind, {j: signature_rows(sigs[j], pts[j]) for j in keys if j != k})
            if fit is None:
                continue
            fb, t = signature_rows(sigs[k], pts[k])
            e = fit.predict(fb) / t - 1
            shapes = [x.shape for x in sigs[k].inputs][:2]
            print(f"     {shapes} MAPE {100 * np.mean(np.abs(e)):.1f}% bias {100 * np.mean(e):+.1f}%")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("db", help="a profile DB (`dooly profile ... --db`)")
    ap.add_argument("--op", default="scaled_dot", help="kinds whose key contains this (default: attention)")
    args = ap.parse_args()
    main(args.db, args.op)

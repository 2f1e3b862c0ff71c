"""Profile the zoo's small models with cross-model reuse, then validate the predictor on held-out shapes.

Prints: onboarding device-seconds (tracing + operator profiling + calibration forwards) with vs without reuse
(measured per signature and forward) and the saving, with calibration counted and without; the
predictor's held-out interpolation error (interp vs forest); iteration-latency MAPE per phase for every
profiled model and for a model that was never profiled (all its signatures come from the others).

    .venv/bin/python bench/bench_profile.py --db /tmp/dooly_bench.db          # resumable; rerun to continue
    .venv/bin/python bench/bench_profile.py --db /tmp/dooly_bench.db --zoo    # + point-count savings, whole zoo
    .venv/bin/python bench/bench_profile.py --db /tmp/dooly_bench.db --skip-validate --realistic  # groups + zoo
    .venv/bin/python bench/bench_profile.py --db /tmp/dooly_bench.db --skip-validate --shapes     # shape model

``--realistic`` prices the models users profile together (dooly.core.zoo.REALISTIC_GROUPS) and the whole zoo:
signature and grid-point counts (from tracing alone, no timing: exact) and device-seconds, measured for the
signatures this DB holds and, for the rest, what profiling their points would cost at the shape model's
predicted latency (dooly.profile.savings.estimate_costs; the share estimated is printed), with exact reuse
and with the shape model predicting all but ``--budget`` signatures per model.
``--shapes`` validates, on the same held-out real forwards: each profiled model with its full profile, with its
own points but the overhead fitted on the other models (what ``--calibrate none`` gives), with zero new points
(held out of every fit), and with its budget replayed (only the ``--budget`` least certain of its own
signatures measured); and configs outside the zoo (OUTSIDE) that were never profiled, with zero new
points where the shape model covers every operator kind, else after profiling only the uncovered kinds.

Timing uses one torch thread and, on the CPU, the thread-CPU clock (see dooly.profile.default_clock): on a
shared machine wall time mostly measures the other tenants.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from dooly.api import check_verdict, profile_models
from dooly.core.zoo import resolve_model
from dooly.db.store import ProfileStore
from dooly.engines import Engine, get_engine
from dooly.predict.estimators import method_errors
from dooly.predict.predictor import Predictor
from dooly.predict.validate import phase_mape, round_spread, validate_model
from dooly.profile import calibrate, default_clock, make_plan, profiled_savings, run_plan, savings

SMALL = ["smollm2-135m", "smollm2-360m", "qwen2.5-0.5b", "opt-125m"]


def reused_only_config() -> dict:
    """A model never profiled: SmolLM2-135M's attention and vocabulary with 20 layers (every signature is
    already in the DB from smollm2-135m; its framework overhead comes from the other models' fit)."""
    _, cfg = resolve_model("smollm2-135m")
    cfg = dict(cfg)
    cfg["num_hidden_layers"] = 20
    cfg["_name_or_path"] = "smollm2-135m-20l (never profiled)"
    return cfg


#: Configs outside the zoo, as a user would write them (config.json fields, in bench/configs/): new hidden
#: sizes, head counts and vocabularies (llama-640, qwen2-768 with QKV biases), and another positional scheme
#: (neox-512: GPT-NeoX's partial rotary, fused QKV, parallel residual, GELU).
OUTSIDE: dict[str, dict] = {
    p.stem: json.loads(p.read_text()) for p in sorted((Path(__file__).parent / "configs").glob("*.json"))
}


def point_counts(plan) -> tuple[int, int, int, int]:  # type: ignore[no-untyped-def]
    """(signatures each alone, signatures with reuse, grid points each alone, grid points with reuse)."""
    per_model = [{k for needs in mp.needs.values() for k in needs} for mp in plan.models]
    union = set().union(*per_model)
    return (
        sum(map(len, per_model)),
        len(union),
        sum(plan.grid_size[k] for m in per_model for k in m),
        sum(plan.grid_size[k] for k in union),
    )


def policies(models: list[str], missed: list[str]) -> list[tuple[str, str, list[str]]]:
    """The calibration policies the savings are priced under besides the default (all): (label, policy, the
    models whose check misses): every check passing, ``missed``'s missing (a check run for real), every check
    missing (each then calibrated at its own depth), none."""
    out = [("--calibrate check, every check passing", "check", [])]
    if set(missed) & set(models):
        out.append((f"--calibrate check, {', '.join(m for m in models if m in missed)}'s missing", "check", missed))
    out += [("--calibrate check, every check missing", "check", models), ("--calibrate none", "none", [])]
    return out


def realistic(  # type: ignore[no-untyped-def]
    store, engine, threads: int, budgets: list[int], budget_s: list[float] = (), missed: list[str] = ()
) -> None:
    """Savings over the realistic groups (each group alone, and the list as one plan) and over the zoo, with
    exact reuse and with the shape model at each of ``budgets`` (signatures measured per model) and of
    ``budget_s`` (device-seconds caps for the whole list, as `dooly profile --budget-seconds`); ``missed``: models
    whose `--calibrate check` missed when run."""
    from dooly.core.zoo import REALISTIC_GROUPS, list_models, realistic_list
    from dooly.profile.budget import triage

    lists = {f"group {g}": ms for g, ms in REALISTIC_GROUPS.items()}
    lists["REALISTIC LIST"] = realistic_list()
    lists["WHOLE ZOO"] = [m.name for m in list_models()]
    for label, models in lists.items():
        plan = make_plan(models, store, engine, threads=threads)
        alone_n, with_n, alone_p, with_p = point_counts(plan)
        sv = savings(plan, store)
        tr = triage(plan, store)
        print(f"{label} ({', '.join(models)}):")
        print(
            f"  counts (tracing only, no timing): signatures {alone_n} each alone vs {with_n} with reuse "
            f"({100 * (1 - with_n / alone_n):.1f}% saved); grid points {alone_p} vs {with_p} "
            f"({100 * (1 - with_p / alone_p):.1f}% saved)"
        )
        print(f"  device-s, exact reuse: {sv.describe()}")
        for what, policy, miss in policies(models, missed):  # the calibration each new model takes (default: all)
            cal = savings(plan, store, calibration=policy, missed=miss)
            print(
                f"  device-s, exact reuse, {what}: {cal.saved_pct:.1f}% saved with calibration "
                f"counted ({cal.with_reuse_s:.1f} vs {cal.without_reuse_s:.1f}), {cal.saved_pct_uncalibrated:.1f}% "
                "without"
            )
        caps = [(f"--budget {b}/model", tr.least_certain(b * len(plan.models))) for b in budgets]
        caps += [(f"--budget-seconds {s:g}", tr.within_seconds(s)) for s in budget_s]
        for flag, chosen in caps:
            predicted = set(tr.covered) - set(chosen)
            shape_p = with_p - sum(plan.grid_size[k] for k in predicted)
            print(
                f"  + shape model, {flag}: {shape_p} points ({100 * (1 - shape_p / alone_p):.1f}% "
                f"saved); device-s {savings(plan, store, predicted).describe()}; {len(tr.uncovered)} signatures "
                f"of kinds never profiled here measured"
            )
            for what, policy, miss in policies(models, missed):
                cal = savings(plan, store, predicted, calibration=policy, missed=miss)
                print(
                    f"    {what}: {cal.saved_pct:.1f}% saved with calibration counted "
                    f"({cal.with_reuse_s:.1f} vs {cal.without_reuse_s:.1f}), {cal.saved_pct_uncalibrated:.1f}% without"
                )


def score(rows, preds) -> dict[str, float]:  # type: ignore[no-untyped-def]
    import dataclasses

    scored = [dataclasses.replace(r, predicted_s=x) for r, x in zip(rows, preds, strict=True)]
    return {ph: phase_mape(scored, ph) for ph in ("prefill", "decode")}


def shape_predictors(  # type: ignore[no-untyped-def]
    store_path: str, engine: Engine, threads: int, model, name: str, cfg: dict, budgets: list[int], budget_s
) -> dict[str, Predictor]:
    """`shapes`' predictors of one model by label: exact, zero new points, and each budget replayed; for a model
    with kinds never profiled here, those kinds are measured (--budget 0) and the rest predicted from shape."""
    from dooly.core.errors import DoolyError
    from dooly.predict.shapes import own_signatures
    from dooly.profile import context_for, model_traces
    from dooly.profile.budget import triage

    preds: dict[str, Predictor] = {}
    # exact: calibrated in full (--calibrate all); shared overhead: own points, the overhead fitted on the other
    # models (--calibrate none, or a check that passed); own depth: the overhead fitted on its first round at its
    # own depth (a check that missed); zero new points: nothing of its own
    labels = (
        ("exact", {}),
        ("shared overhead", {"shared_overhead": True}),
        ("own depth, one round", {"own_depth_overhead": True}),
        ("zero new points", {"holdout": True}),
    )
    for label, kw in labels:
        try:
            preds[label] = Predictor.for_model(model, store_path, engine, threads=threads, **kw)
        except DoolyError as exc:
            print(f"  {name}: no {label} figure: {exc}")
    if "shared overhead" in preds and "own depth, one round" in preds:  # --calibrate check, replayed
        passed, why = check_verdict(preds["shared overhead"], check_measured(store_path, engine, threads, name))
        print(f"  {name}: --calibrate check {'passed' if passed else 'missed'} ({why})")
        check = "check passed: shared overhead" if passed else "check missed: own depth"
        preds[check] = preds["shared overhead" if passed else "own depth, one round"]
    if "exact" in preds:  # replay --budget: only the least certain of its own signatures measured
        with ProfileStore(store_path, readonly=True) as store:
            ctx = context_for(engine, threads)
            own = own_signatures(store, ctx, name, model_traces(name, cfg, engine, store))
            plan = make_plan([model], store, engine, threads=threads)
            tr = triage(plan, store, hidden=own)
        caps = [(f"budget {b}", tr.least_certain(b)) for b in budgets]
        caps += [(f"budget {s:g} device-s", tr.within_seconds(s)) for s in budget_s]
        for label, chosen in caps:
            preds[label] = Predictor.for_model(
                model, store_path, engine, threads=threads, unmeasured=set(tr.covered) - set(chosen)
            )
    if not preds:  # kinds never profiled here: measure only those (--budget 0), predict the rest from shape
        with ProfileStore(store_path) as store:
            plan = make_plan([model], store, engine, threads=threads)
            tr = triage(plan, store)
            plan = plan.without(set(tr.covered))
            print(
                f"  {name}: measuring {len(tr.uncovered)} signatures of uncovered kinds "
                f"({plan.todo_points} points), {len(tr.covered)} from shape"
            )
            run_plan(plan, store, engine, threads=threads)
        label = "budget 0 (uncovered kinds measured)"
        preds[label] = Predictor.for_model(model, store_path, engine, threads=threads, shape=True)
    return preds


def check_measured(store_path: str, engine: Engine, threads: int, name: str) -> dict[tuple[str, str], float]:
    """The model's first-round forwards at the check's shapes: what its `--calibrate check` would have measured."""
    from dooly.db.store import canonical_point
    from dooly.profile import context_for
    from dooly.profile.calibrate import CHECK_SHAPES, phase_points

    shapes = phase_points(CHECK_SHAPES)
    with ProfileStore(store_path, readonly=True) as store:
        rows = store.forwards(context_for(engine, threads), name)
    got = {(ph, canonical_point(v)): m.median_s for _, ph, v, m in rows}
    return {k: s for k, s in got.items() if k in shapes}


def shapes(
    store_path: str,
    engine: Engine,
    threads: int,
    repeats: int,
    models: list[str],
    budgets: list[int],
    profile_outside: bool = False,
    outside: list[str] | None = None,
    budget_s: list[float] = (),
) -> None:
    """Exact vs zero-new-points vs budget-replay MAPE per phase on held-out real forwards, noise floor beside."""
    from dooly.db.shape_model import ShapeModel, signatures_of
    from dooly.profile import context_for

    with ProfileStore(store_path, readonly=True) as store:
        ctx = context_for(engine, threads)
        pts = {k: [(p, m.median_s) for p, m in v] for k, v in store.all_points(ctx).items()}
        sm = ShapeModel.fit(signatures_of(store, ctx, pts), pts)
    loso = [km.loso_mape for km in sm.kinds.values() if km.n_signatures > 1]
    print(
        f"SHAPE MODEL on {len(pts)} profiled signatures: {len(sm.kinds)} kinds; leave-one-signature-out error "
        f"per kind median {np.median(loso):.1f}% (max {np.max(loso):.1f}%)"
    )
    configs = [cfg for stem, cfg in OUTSIDE.items() if outside is None or stem in outside]
    targets = [(m, resolve_model(m)[1]) for m in models] + [(None, cfg) for cfg in configs]
    if profile_outside:  # profiled like any model, so their exact figure stands beside the zero-new-points one
        with ProfileStore(store_path) as store:
            plan = make_plan(configs, store, engine, threads=threads)
            print(f"profiling OUTSIDE: {plan.todo_points} points; {run_plan(plan, store, engine, threads=threads)}")
            for cfg in configs:
                calibrate(cfg["_name_or_path"], cfg, store, engine, plan.ctx, threads=threads)
    for m, cfg in targets:
        name = m or cfg["_name_or_path"]
        preds = shape_predictors(store_path, engine, threads, m or cfg, name, cfg, budgets, budget_s)
        first = next(iter(preds.values()))
        with ProfileStore(store_path) as store:  # held-out measurements are kept: a rerun re-scores them
            rows = validate_model(first, cfg, engine, threads=threads, repeats=repeats, store=store)
        parts = []
        for label, p in preds.items():
            mape = score(rows, [p.forward_latency(r.phase, r.values) for r in rows])
            n_shape = sum(len(f) for f in p.shape_predicted.values())
            n_all = sum(len(tr.unique()) for tr in p.traces.values())
            share = np.mean([p.shape_share(r.phase, r.values)[0] for r in rows])
            parts.append(
                f"{label}: prefill {mape['prefill']:.1f}% decode {mape['decode']:.1f}% "
                f"({n_shape}/{n_all} signatures, {100 * share:.0f}% of op time from shape)"
            )
        print(
            f"SHAPES {name}: " + "; ".join(parts) + f"; noise floor prefill {round_spread(rows, 'prefill'):.1f}% "
            f"decode {round_spread(rows, 'decode'):.1f}%",
            flush=True,
        )


def profile(args: argparse.Namespace) -> None:
    """Profile and calibrate --models as `dooly profile --calibrate all` does, then print the onboarding cost
    with vs without reuse and the predictor methods' held-out grid-line error."""
    run = profile_models(args.models, Path(args.db), threads=args.threads)
    plan = run.plan
    print(
        f"traced/planned in {run.plan_s:.1f} s: {len(plan.grid_size)} unique signatures, "
        f"{len(plan.in_db)} already in the DB, {plan.todo_points} points to time"
    )
    print(f"profiled: {run.stats}")
    print(f"calibration forwards this run: {run.calib_s:.1f} s")
    sv = run.savings  # the run is over: each model's calibration as recorded
    for r in sv.models:
        parts = f"trace {r.trace_s:.1f}, profile {r.profile_alone_s:.1f}/{r.profile_s:.1f}, calibrate "
        parts += f"{r.calib_alone_s:.1f}/{r.calib_s:.1f}"
        print(
            f"  {r.name:16s} sigs {r.signatures:4d} new {r.new:4d} reused(list) {r.reused_models:4d} "
            f"alone {r.alone_s:7.1f} s  with reuse {r.marginal_s:7.1f} s ({parts})"
        )
    print(f"ONBOARDING COST ({', '.join(args.models)}): {sv.describe()}")
    print(f"SAVED: {sv.saved_pct:.1f}% with calibration counted, {sv.saved_pct_uncalibrated:.1f}% without")
    with ProfileStore(args.db, readonly=True) as store:
        for ctx, db_sv in profiled_savings(store).items():  # what `dooly report` headlines for this DB
            if ctx == plan.ctx:
                print(f"ONBOARDING COST (every model profiled into {args.db}): {db_sv.describe()}")
        raw = store.all_points(plan.ctx)
    pts = {k: [(p, m.median_s) for p, m in v] for k, v in raw.items()}
    errs = method_errors(pts, sample=60)
    print(
        f"HELD-OUT GRID-LINE MAPE: interp {100 * np.mean(errs['interp']):.1f}%  "
        f"forest {100 * np.mean(errs['forest']):.1f}%  (n={len(errs['interp'])})"
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default="/tmp/dooly_bench.db")
    ap.add_argument("--models", nargs="+", default=SMALL)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--zoo", action="store_true", help="also plan the whole zoo (point-count savings estimate)")
    ap.add_argument("--skip-validate", action="store_true")
    ap.add_argument("--repeats", type=int, default=7, help="timed forwards per held-out shape (median)")
    ap.add_argument("--validate", nargs="*", default=None, help="validate only these models (default: all)")
    ap.add_argument("--no-reused", action="store_true", help="skip the never-profiled model's validation")
    ap.add_argument("--realistic", action="store_true", help="savings over the realistic groups and the zoo")
    ap.add_argument(
        "--missed", nargs="*", default=[], help="with --realistic: models whose `--calibrate check` missed when run"
    )
    ap.add_argument("--shapes", action="store_true", help="exact vs zero-new-points vs budget MAPE, OUTSIDE configs")
    ap.add_argument(
        "--budget",
        type=int,
        nargs="+",
        default=[10],
        help="signatures measured per model beyond uncovered kinds (several: one figure each)",
    )
    ap.add_argument(
        "--budget-seconds",
        type=float,
        nargs="*",
        default=[],
        help="device-seconds caps (the whole list with --realistic, each model with --shapes)",
    )
    ap.add_argument("--no-profile", action="store_true", help="do not profile --models first (use the DB as it is)")
    ap.add_argument("--profile-outside", action="store_true", help="with --shapes: profile the OUTSIDE configs too")
    ap.add_argument(
        "--outside",
        nargs="*",
        default=None,
        choices=sorted(OUTSIDE),
        help="with --shapes: only these configs of bench/configs (none: only the zoo models)",
    )
    return ap.parse_args()


def validate(args: argparse.Namespace, engine: Engine) -> None:
    """Held-out MAPE per phase of every --validate model, and of a model never profiled (unless --no-reused)."""
    results = {}
    chosen = args.models if args.validate is None else args.validate
    targets = [(m, resolve_model(m)[1]) for m in chosen]
    if not args.no_reused:
        targets.append((None, reused_only_config()))
    for m, cfg in targets:
        name = m or cfg["_name_or_path"]
        pred = Predictor.for_model(m or cfg, args.db, engine, threads=args.threads)
        with ProfileStore(args.db) as store:  # held-out measurements are kept: a rerun re-scores them
            rows = validate_model(pred, cfg, engine, threads=args.threads, repeats=args.repeats, store=store)
        results[name] = {ph: phase_mape(rows, ph) for ph in ("prefill", "decode")}
        for r in rows:
            rounds = "/".join(f"{x * 1e3:.1f}" for x in r.rounds_s)
            print(
                f"  {name:16s} {r.phase:7s} {json.dumps(r.values):32s} measured {r.measured_s * 1e3:8.2f} ms "
                f"(rounds {rounds})  predicted {r.predicted_s * 1e3:8.2f} ms  err {r.error * 100:5.1f}%",
                flush=True,
            )
        print(
            f"VALIDATION {name}: MAPE prefill {results[name]['prefill']:.1f}%  "
            f"decode {results[name]['decode']:.1f}%  (method {pred.method}); run-to-run spread of the "
            f"measurements prefill {round_spread(rows, 'prefill'):.1f}%  "
            f"decode {round_spread(rows, 'decode'):.1f}%",
            flush=True,
        )


def run_shapes(args: argparse.Namespace, engine: Engine) -> None:
    shapes(
        args.db,
        engine,
        args.threads,
        args.repeats,
        args.models if args.validate is None else args.validate,
        args.budget,
        args.profile_outside,
        args.outside,
        args.budget_seconds,
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    engine = get_engine()
    print(f"clock: {default_clock('cpu', args.threads)}; threads {args.threads}; db {args.db}")

    if args.no_profile:
        with ProfileStore(args.db) as store:
            if args.realistic:
                realistic(store, engine, args.threads, args.budget, args.budget_seconds, args.missed)
        if args.shapes:
            run_shapes(args, engine)
        return

    profile(args)

    if not args.skip_validate:
        validate(args, engine)

    if args.realistic:
        with ProfileStore(args.db) as store:
            realistic(store, engine, args.threads, args.budget, args.budget_seconds, args.missed)
    if args.shapes:
        run_shapes(args, engine)

    if args.zoo:
        from dooly.core.zoo import list_models

        with ProfileStore(args.db) as store:
            names = [m.name for m in list_models()]
            zplan = make_plan(names, store, engine, threads=args.threads, progress=print)
            # cost by grid points (measured where profiled, mean per-point cost elsewhere)
            sv = savings(zplan, store)
            print(f"ZOO: {sv.describe()}")


if __name__ == "__main__":
    Path("/tmp").mkdir(exist_ok=True)
    main()

"""Generators side by side on real traces: masked discrete diffusion and an autoregressive transformer vs
order-4 Markov (vs the paper's model).

For each trace: the first 70% (by time) is the training block, the last 30% the held-out test
block. Every generator fits on the training block (the neural ones for the same wall time,
`--train-seconds`), then samples `--events` events. Printed per trace and generator:

- rule_viol: share of the raw sample's events breaking a rule mined from the training block;
- repair_edit: share of events repair changed (inserted + deleted + modified) / events;
- jsd3: 3-gram Jensen-Shannon divergence (bits) of event types, sample vs the real test block;
- jsd3 train: the same against the training block, the period the generator learned (a test block in another phase,
  fio's: its training block holds a file-writing phase that its test block does not, charges jsd3 to a generator
  for being faithful to what it was given; the `real` row: the test block's own);
- copied128: share of 128-event windows of the sample found verbatim in the training block (the `real`
  row: of the test block's first `--events` events, how often real data itself repeats a training window);
  the `real` row's copied128_inphase: of `--events` events from the middle of the training block, the share
  found elsewhere in that block (how often the workload repeats itself within the period a generator learns:
  the test block may be another phase, compress's 0.8% against 93% within its training block);
- nxt_f1: next-event Macro-F1 on real test windows of a classifier trained on the sample alone
  (the `real` row: trained on the training block itself);
- fit_s, steps, train ev/s: training wall time, optimisation steps reached (the machine may be shared:
  compare steps, not only seconds) and events seen per second of training (steps * batch * context;
  Markov: the training block's events / fit time);
- sample ev/s: sampling throughput (raw sample, before repair);
- and per generator the rules broken most often (share of the sample's events breaking each);
- with `--jsd-terms K`: the K event 3-grams carrying most of each sample's jsd3, with their share in the test block
  and in the sample (`tracesynth.evaluate.metrics.ngram_jsd_terms`): what a generator gets wrong.

- auc: same-phase discriminator AUC (`tracesynth.evaluate.tasks.same_phase_discriminator`): a classifier
  tells real windows of the training block from the sample's, scored on interleaved time blocks it did not
  train on; on the `real` row it is real-vs-real from the same block, the floor a sample can reach.

`--load models/all` scores a saved conditional model (`make models`, `scripts/train_models.py`) instead of
fitting neural ones: on each trace it was trained on, the training block is the part it learned (its
`history.training`, the first 70% of the events; the file's sha256 must match) and the test block the rest,
Markov-4 is fitted on that same block, and the model samples each workload (rows `ar[all]`, `ar[all]+guided`).

`ar` and `markov4` are sampled twice from one fit: unguided (rows `ar`, `markov4`) and kept within the kernel
invariants (`ar+guided`, `markov4+guided`).
`block` (block diffusion, `--block`, `--block-steps`) is fitted only when named: `--only block`, or
`--init models/all --init-kinds ar block` (rows block[=all] from random weights of the checkpoint's size, block[all]
started from it); it is sampled as ar, unguided and guided.
`--sample-steps 64 256 256:confidence` samples the masked model once per setting from the same fit
(rows `masked@256`, ...); `--only masked markov4` fits only those.

    .venv/bin/python bench/bench_generators.py --workloads scimark2 sqlite fio --train-seconds 300
    .venv/bin/python bench/bench_generators.py --quick          # 60 s per model, 2 workloads
    .venv/bin/python bench/bench_generators.py --load models/all  # the shipped checkpoint vs Markov-4
    .venv/bin/python bench/bench_generators.py --load models/all --workloads all --sample-seeds 0 1 2  # mean, range

`--sample-seeds S...` fits every generator once per trace, then samples and scores each once per seed and
prints every figure's mean [min-max] over the seeds (one seed's sample can sit far from another's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from tracesynth.collect import sha256_file  # noqa: E402
from tracesynth.constraints import check_trace, mine_rules, repair_trace  # noqa: E402
from tracesynth.evaluate.classifier import ClassifierConfig  # noqa: E402
from tracesynth.evaluate.experiments import prepare_workload  # noqa: E402
from tracesynth.evaluate.metrics import copied_within, memorisation, ngram_jsd, ngram_jsd_terms  # noqa: E402
from tracesynth.evaluate.tasks import next_event_scores, same_phase_discriminator  # noqa: E402
from tracesynth.evaluate.windows import Split, make_windows  # noqa: E402
from tracesynth.generators import load_generator  # noqa: E402
from tracesynth.generators.ar import ARConfig, Autoregressive  # noqa: E402
from tracesynth.generators.block import BlockConfig, BlockDiffusion  # noqa: E402
from tracesynth.generators.markov import MarkovChain  # noqa: E402
from tracesynth.generators.masked import UNMASK, MaskedConfig, MaskedDiffusion  # noqa: E402
from tracesynth.io import read_trace  # noqa: E402
from tracesynth.splits import split_by_time  # noqa: E402

LTTNG = REPO.parent / "shared" / "traces" / "lttng-wget-kernel"


def _generators(args) -> dict[str, object]:
    # batch 32 and lr 0.001 (ar's defaults) for both token models, as the figures in docs/ were measured
    common = dict(context=args.context, d_model=args.d_model, n_layers=args.layers, steps=10**9, batch_size=32,
                  lr=1e-3, time_limit=args.train_seconds, chains=args.chains, seed=args.seed)
    gens: dict[str, object] = {
        "markov4": MarkovChain(order=4),
        "masked": MaskedDiffusion(MaskedConfig(**common)),
        "ar": Autoregressive(ARConfig(**common)),
        "block": BlockDiffusion(BlockConfig(**common, block=args.block, block_steps=args.block_steps)),
    }
    if args.gaussian or (args.only and "gaussian" in args.only):
        from tracesynth.generators.diffusion.config import GaussianDiffusionConfig
        from tracesynth.generators.diffusion.gaussian import GaussianDiffusion

        cfg = GaussianDiffusionConfig(context=args.context, steps=10**9, time_limit=args.train_seconds)
        gens["gaussian"] = GaussianDiffusion(cfg)
    # in the order asked for; block only when asked for
    gens = {k: gens[k] for k in args.only} if args.only else {k: v for k, v in gens.items() if k != "block"}
    if args.init:  # each --init-kinds model twice: from scratch, and as (generator, fitted model it starts from)
        init = load_generator(args.init)
        if not isinstance(init, Autoregressive):
            sys.exit(f"{args.init}: --init takes an autoregressive model, not a {init.name} one")
        size = replace(init.config, conditional=False, steps=10**9, time_limit=args.train_seconds, chains=args.chains,
                       seed=args.seed)
        block = BlockConfig(**asdict(size), block=args.block, block_steps=args.block_steps)
        for kind, make in (("ar", lambda: Autoregressive(size)), ("block", lambda: BlockDiffusion(block))):
            if kind in args.init_kinds:
                gens[f"{kind}[={args.init.name}]"] = make()
                gens[f"{kind}[{args.init.name}]"] = (make(), init)
    return gens


def _samplings(gname: str, args) -> list[tuple[str, dict]]:
    """(row name, sampler settings) for each way a fitted generator is sampled: masked once per --sample-steps,
    ar and markov4 unguided and guided by the kernel invariants."""
    if gname.split("[")[0] in ("ar", "block"):  # one row per --temperatures value, unguided and guided
        return [(f"{gname}{'' if t == 1 else f'@t{t:g}'}{'+guided' if g == 'kernel' else ''}",
                 {"guide": g, "temperature": t}) for t in args.temperatures for g in ("none", "kernel")]
    if gname == "markov4":
        return [(gname, {"guide": "none"}), (f"{gname}+guided", {"guide": "kernel"})]
    if gname != "masked":
        return [(gname, {})]
    out = []
    for i, spec in enumerate(args.sample_steps):
        steps, _, unmask = spec.partition(":")
        setting = {"sample_steps": int(steps), "unmask": unmask or args.unmask}
        out.append((gname if i == 0 else f"{gname}@{spec}", setting))
    return out


def _top_rules(report, k: int = 4) -> str:
    top = sorted(((n, r) for r, n in report.counts.items() if n), reverse=True)[:k]
    return ", ".join(f"{r} {n / max(report.events, 1):.1%}" for n, r in top) or "none"


def bench_trace(name: str, train, test, gens: dict[str, object], args, loaded: str | None = None,
                seeds: list[int] | None = None) -> list[dict]:
    """Fit (all but the `loaded` one, already trained) every generator on one trace's training block, then per
    sampling seed (default: `args.seed`) sample and score each against the test block; rows carry their seed."""
    t_setup = time.perf_counter()
    rules = mine_rules([train])
    wd = prepare_workload(name, Split(train, train.slice(0, 0), test), context=64, max_test=4000)
    clf = ClassifierConfig()
    n_ev = len(wd.vocab)
    real_windows = make_windows(train, wd.vocab, wd.context)  # the discriminator's real side: the training block
    real_f1 = next_event_scores(wd.windows(train, stride=4), wd.test, n_ev, clf)["macro_f1"]
    copied = memorisation(test.slice(0, args.events), train, 128)["copied_window_share"]
    inphase = copied_within(train.codes("event")[0], max(0, (len(train) - args.events) // 2), args.events, 128)
    real = {"trace": name, "generator": "real", "nxt_f1": real_f1, "rule_viol": check_trace(test, rules).rate,
            "copied128": copied, "copied128_inphase": inphase,
            "jsd3_train": ngram_jsd(train, test.slice(0, args.events), 3)}
    print(f"{name}: {len(train):,} training / {len(test):,} test events; rules, real F1: "
          f"{time.perf_counter() - t_setup:.0f} s", flush=True)
    fitted = []  # (name, generator, fit seconds): every generator fitted once, sampled once per seed
    for gname, gen in gens.items():
        t0 = time.perf_counter()
        gen, init = gen if isinstance(gen, tuple) else (gen, None)
        if gname != loaded:
            gen.fit([train], **({"init": init} if init is not None else {}))
        fitted.append((gname, gen, time.perf_counter() - t0 if gname != loaded else gen.fit_info.get("train_seconds")))
    rows = []
    for seed in seeds or [args.seed]:
        seed_rows, samples = [{**real, "seed": seed}], {}
        for gname, gen, fit_s in fitted:
            info = gen.fit_info
            train_ev_s = info.get("train_events_per_s") or len(train) / max(fit_s, 1e-9)
            for rname, setting in _samplings(gname, args):
                config = getattr(gen, "config", None)  # token models keep sampler settings in their config
                for k, v in setting.items() if config is not None else ():
                    setattr(config, k, v)
                extra = {"workload": name} if gname == loaded and getattr(gen, "workloads", None) else {}
                t0 = time.perf_counter()
                raw = gen.sample(args.events, seed=seed, **(setting if config is None else {}), **extra)
                sample_s = time.perf_counter() - t0
                t_eval = time.perf_counter()
                _, rep = repair_trace(raw, rules, seed=0)
                mem = memorisation(raw, train, 128)
                f1 = next_event_scores(wd.windows(raw, stride=4), wd.test, n_ev, clf)["macro_f1"]
                check = check_trace(raw, rules)
                samples[rname] = make_windows(raw, wd.vocab, wd.context)
                seed_rows.append({
                    "trace": name, "generator": rname, "seed": seed, "fit_s": fit_s, "steps": info.get("train_steps"),
                    "train_ev_s": train_ev_s, "sample_ev_s": len(raw) / max(sample_s, 1e-9),
                    "rule_viol": check.rate, "repair_edit": rep.edit_rate,
                    "jsd3": ngram_jsd(test, raw, 3), "jsd3_train": ngram_jsd(train, raw, 3),
                    "copied128": mem["copied_window_share"], "nxt_f1": f1,
                    "rules": {r: n / max(check.events, 1) for r, n in check.counts.items() if n},
                })
                print(_fmt(seed_rows[-1]), flush=True)
                print(f"{'':24s}rules broken most: {_top_rules(check)}; scored in "
                      f"{time.perf_counter() - t_eval:.0f} s", flush=True)
                for t in ngram_jsd_terms(test, raw, 3, top=args.jsd_terms):
                    print(f"{'':24s}jsd3 {t['bits']:.4f} bits from {' > '.join(t['ngram'])}: real {t['real']:.2%}, "
                          f"sample {t['synth']:.2%}", flush=True)
        # one discriminator run per seed for every sample, so all share the real-vs-real reference and window budget
        auc = same_phase_discriminator(real_windows, samples, n_ev, clf, seed=0, gap=wd.context, max_windows=2000)
        seed_rows[0]["auc"] = auc["reference"]
        for r in seed_rows[1:]:
            r["auc"] = auc[r["generator"]]
        print(f"discriminator AUC (same phase; real vs real {auc['reference']:.3f}): "
              + ", ".join(f"{r['generator']} {r['auc']:.3f}" for r in seed_rows[1:]), flush=True)
        print(_fmt(seed_rows[0]), flush=True)
        rows += seed_rows
    return rows


def _loaded_traces(gen, model_dir: Path) -> list[tuple[str, object, object]]:
    """(workload, training block, test block) of each trace a `scripts/train_models.py` model learned."""
    training = (getattr(gen, "history", {}) or {}).get("training")
    if not training:
        sys.exit(f"{model_dir}: no training record (history.training): not written by scripts/train_models.py")
    out = []
    for d in training["data"]:
        path = REPO / "data" / d["file"]
        if not path.is_file() or sha256_file(path) != d["sha256"]:
            sys.exit(f"{path}: missing or not the file {model_dir} was trained on (sha256 differs)")
        trace = read_trace(path)
        k = int(d["train_events"])
        out.append((d["workload"], trace.slice(0, k), trace.slice(k)))
    return out


def _trace_path(name: str) -> Path:
    """A shipped workload's trace (data/NAME.parquet), the LTTng one (lttng-wget), or any trace file named."""
    if name == "lttng-wget":
        return LTTNG
    return Path(name) if Path(name).exists() else REPO / "data" / f"{name}.parquet"


def _fmt(r: dict) -> str:
    def f(k, spec):
        v = r.get(k)
        return "-" if v is None or (isinstance(v, float) and np.isnan(v)) else format(v, spec)

    return (f"{r['trace']:10s} {r['generator']:12s} viol {f('rule_viol', '.3%'):>7s} "
            f"edit {f('repair_edit', '.3%'):>7s} "
            f"jsd3 {f('jsd3', '.3f'):>5s} (train {f('jsd3_train', '.3f'):>5s}) auc {f('auc', '.3f'):>5s} "
            f"copied {f('copied128', '.1%'):>6s} nxtF1 {f('nxt_f1', '.3f'):>5s} "
            f"fit {f('fit_s', '.0f'):>4s}s steps {f('steps', 'd'):>6s} train {f('train_ev_s', ',.0f'):>9s} ev/s "
            f"sample {f('sample_ev_s', ',.0f'):>8s} ev/s"
            + (f" in-phase copied {f('copied128_inphase', '.1%')}" if "copied128_inphase" in r else ""))


SEEDED = ("rule_viol", "repair_edit", "jsd3", "jsd3_train", "auc", "copied128", "copied128_inphase", "nxt_f1")


def _print_over_seeds(rows: list[dict]) -> None:
    """Per trace and generator, each sampled figure's mean [min-max] over the sampling seeds (one seed's 20,000
    events can sit far from another's: a chain that drifts into an idle loop moves the 3-gram JSD by 2x)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["trace"], r["generator"]), []).append(r)
    print(f"\nover {len(next(iter(groups.values())))} sampling seeds, mean [min-max]:")
    for (trace, gen), rs in groups.items():
        cells = []
        for k in SEEDED:
            v = np.array([r[k] for r in rs if r.get(k) is not None], dtype=float)
            if len(v):
                cells.append(f"{k} {_fmt_metric(k, v.mean())} [{_fmt_metric(k, v.min())}-{_fmt_metric(k, v.max())}]")
        print(f"{trace:10s} {gen:24s} " + "  ".join(cells), flush=True)


def _fmt_metric(k: str, x: float) -> str:
    return f"{100 * x:.2f}%" if k.startswith(("rule_viol", "repair_edit", "copied128")) else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["scimark2", "sqlite", "fio"],
                    help="shipped workloads (data/NAME.parquet), lttng-wget, or trace files (any readable format)")
    ap.add_argument("--lttng", action="store_true",
                    help="also the LTTng trace in ../shared/traces (or name it: --workloads lttng-wget)")
    ap.add_argument("--train-seconds", type=float, default=300)
    ap.add_argument("--events", type=int, default=30000)
    ap.add_argument("--skip", type=int, default=10000)
    ap.add_argument("--max-events", type=int, default=100000)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sample-steps", nargs="+", default=["64"],
                    help="masked sampler steps, one row each; STEPS:UNMASK picks the unmasking order")
    ap.add_argument("--chains", type=int, default=16, help="chains sampled in parallel by the token models")
    ap.add_argument("--only", nargs="+", choices=["markov4", "masked", "ar", "block", "gaussian"], default=None,
                    help="fit only these generators (default: all but gaussian and block)")
    ap.add_argument("--block", type=int, default=16, help="block: events per block")
    ap.add_argument("--block-steps", type=int, default=None, help="block: sampler passes per block (block // 2)")
    ap.add_argument("--temperatures", nargs="+", type=float, default=[1.0],
                    help="sample ar at each of these softmax temperatures (rows ar@tT; 1 = the model's distribution)")
    ap.add_argument("--jsd-terms", type=int, default=0, metavar="K",
                    help="print, per sample, the K event 3-grams that carry most of its 3-gram JSD to the test block")
    ap.add_argument("--unmask", choices=list(UNMASK), default="random")
    ap.add_argument("--gaussian", action="store_true", help="also the paper's Gaussian diffusion model")
    ap.add_argument("--init", type=Path, default=None,
                    help="also fine-tune this fitted autoregressive model (e.g. models/all) on each training block "
                         "(row ar[all]) beside the same network trained from scratch (row ar[=all]), both for "
                         "--train-seconds")
    ap.add_argument("--init-kinds", nargs="+", choices=["ar", "block"], default=["ar"],
                    help="with --init: the kinds fitted from scratch and from --init (rows KIND[=all], KIND[all])")
    ap.add_argument("--seed", type=int, default=0, help="seed of the neural models' weights, batches and samples")
    ap.add_argument("--sample-seeds", type=int, nargs="+", default=None,
                    help="sample (and score) every fitted generator once per seed, then print each figure's mean "
                         "and range (--seed still seeds the fits)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--load", type=Path, default=None,
                    help="score this saved conditional model (scripts/train_models.py) against Markov-4 on the "
                         "blocks it was trained / not trained on, instead of fitting the neural generators; "
                         "--workloads all (or names) picks its traces")
    args = ap.parse_args()
    if args.quick:
        args.workloads, args.train_seconds, args.events = args.workloads[:2], 60, 10000
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}; {args.train_seconds:.0f} s training per neural model")
    rows = []
    if args.load:
        loaded = load_generator(args.load)
        print(f"{args.load}: {loaded.name}, {loaded.n_params:,} weights, {loaded.fit_info.get('train_steps')} steps",
              flush=True)
        for name, train, test in _loaded_traces(loaded, args.load):
            if name in args.workloads or args.workloads == ["all"]:
                gens = {"markov4": MarkovChain(order=4), f"{loaded.name}[{args.load.name}]": loaded}
                rows += bench_trace(name, train, test, gens, args, loaded=f"{loaded.name}[{args.load.name}]",
                                    seeds=args.sample_seeds)
    else:
        names = [*args.workloads, *(["lttng-wget"] if args.lttng and "lttng-wget" not in args.workloads else [])]
        if "lttng-wget" in names and not LTTNG.exists():
            sys.exit(f"{LTTNG}: the LTTng trace is not there (../shared beside the checkout)")
        traces = [(Path(w).stem, read_trace(_trace_path(w))) for w in names]
        for name, t in traces:
            t = t.slice(args.skip, args.skip + args.max_events)
            rows += bench_trace(name, *split_by_time(t, (0.7, 0.3)), _generators(args), args, seeds=args.sample_seeds)
    if len(args.sample_seeds or []) > 1:
        _print_over_seeds(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

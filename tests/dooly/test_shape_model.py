"""The shape model: per-kind latency laws recovered from synthetic points, its uncertainty, and --budget."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dooly.db.shape_model import MIN_SIGNATURES, ShapeModel, coarse_kind_of, family_kinds_of, features, kind_of, work
from dooly.trace.signature import Signature, TensorSpec

MM_ARGS = '{"args":[{"tensor":0},{"tensor":1}],"kwargs":{}}'
TOKENS = [1, 4, 16, 64, 256]


def mm(k: int, n: int, dtype: str = "bfloat16") -> Signature:
    return Signature("aten.mm.default", (TensorSpec(("tokens", k), dtype), TensorSpec((k, n), dtype)), MM_ARGS,
                     "hf-eager/cpu")  # fmt: skip


def unary(op: str, width: int, dtype: str = "bfloat16") -> Signature:
    return Signature(op, (TensorSpec(("tokens", width), dtype),), '{"args":[{"tensor":0}],"kwargs":{}}', "hf-eager/cpu")


def silu(width: int) -> Signature:
    return unary("aten.silu.default", width)


def roofline(sig: Signature, tokens: int) -> float:
    flops, nbytes, _ = work(sig, {"tokens": tokens})
    return 4e-6 + flops / 2e10 + nbytes / 5e9


def points(sigs, law, noise: float = 0.0, seed: int = 0):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    return {s.key: [({"tokens": t}, law(s, t) * math.exp(noise * rng.standard_normal())) for t in TOKENS]
            for s in sigs}  # fmt: skip


def test_work_of_a_matmul_and_an_elementwise_op() -> None:
    flops, nbytes, tasks = work(mm(64, 32), {"tokens": 8})
    assert flops == 2 * 8 * 64 * 32
    assert nbytes == 2 * (8 * 64 + 64 * 32 + 8 * 32) and tasks == 0
    assert work(silu(100), {"tokens": 3}) == (300.0, 2 * 300 * 2, 0.0)


def test_kind_pools_sizes_but_not_dtypes_or_flags() -> None:
    assert kind_of(mm(64, 32)) == kind_of(mm(512, 1536))
    assert kind_of(mm(64, 32)) != kind_of(mm(64, 32, "float32"))
    sdpa = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    q = TensorSpec(("requests", 4, "tokens", 16), "bfloat16")
    causal = Signature(sdpa, (q, q, q), '{"args":[{"tensor":0},{"tensor":1},{"tensor":2},0.0,true],"kwargs":{}}', "e")
    plain = Signature(sdpa, (q, q, q), '{"args":[{"tensor":0},{"tensor":1},{"tensor":2},0.0,false],"kwargs":{}}', "e")
    assert kind_of(causal) != kind_of(plain)


def test_an_elementwise_op_counts_its_broadcast_output() -> None:
    # ALiBi's per-head bias (B, H, 1, L) masked by a causal (B, 1, L, L) mask writes (B, H, L, L), more than either
    bias = TensorSpec(("requests", 32, 1, "tokens"), "bfloat16")
    mask = TensorSpec(("requests", 1, "tokens", "tokens"), "bool")
    fill = Signature("aten.masked_fill.Scalar", (bias, mask), '{"args":[{"tensor":0},{"tensor":1},0.0],"kwargs":{}}',
                     "hf-eager/cpu")  # fmt: skip
    elements, moved, _ = work(fill, {"requests": 2, "tokens": 100})
    assert elements == 2 * 32 * 100 * 100
    assert moved == 2 * 32 * 100 * 2 + 2 * 100 * 100 + elements * 2


def test_a_matmul_kind_tells_a_transposed_weight_from_one_stored_as_used() -> None:
    # nn.Linear reaches addmm/mm with its N x K weight transposed (strides (1, K)); GPT-2's Conv1D with a K x N weight
    # as stored: the CPU kernels differ, so one layout's law must not price the other
    def linear(k: int, n: int, x_stride: tuple[object, ...] | None = None) -> Signature:
        x = TensorSpec(("tokens", k), "bfloat16", x_stride)
        return Signature("aten.mm.default", (x, TensorSpec((k, n), "bfloat16", (1, k))), MM_ARGS, "hf-eager/cpu")

    train = [linear(k, n) for k, n in ((64, 64), (64, 256), (256, 64))]
    model = ShapeModel.fit({s.key: s for s in train}, points(train, roofline))
    assert kind_of(linear(64, 32)) != kind_of(mm(64, 32))
    assert coarse_kind_of(linear(64, 32)) != coarse_kind_of(mm(64, 32))
    assert model.covers(linear(128, 128)) and not model.covers(mm(128, 128))
    # the last token's rows sliced out of a prefill (row stride K x tokens) are still rows: same kind
    assert kind_of(linear(64, 32, ("64*tokens", 1))) == kind_of(linear(64, 32))


def test_a_roofline_law_is_recovered_for_a_signature_never_fitted() -> None:
    train = [mm(k, n) for k, n in ((64, 64), (64, 256), (256, 64), (128, 512), (512, 128), (256, 256))]
    sigs = {s.key: s for s in train}
    model = ShapeModel.fit(sigs, points(train, roofline))
    new = mm(192, 384)  # a hidden size no fitted signature has
    pred = model.predict(new, [{"tokens": t} for t in (2, 32, 200)])
    truth = np.array([roofline(new, t) for t in (2, 32, 200)])
    assert np.max(np.abs(pred.seconds / truth - 1)) < 0.02
    assert model.kinds[kind_of(new)].fit.form == "roofline"
    assert pred.rel_uncertainty < 0.02


def test_a_one_row_matmul_keeps_its_own_price_per_byte() -> None:
    """A matrix-vector product (one row) streams the weights slower than a few rows do, as on the CPUs measured:
    the gemv feature carries that to a larger signature never fitted, at one row and at several."""

    def law(s: Signature, t: int) -> float:
        flops, nbytes, _ = work(s, {"tokens": t})
        return 4e-6 + flops / 2e10 + nbytes / 5e9 + (nbytes / 1e10 if t == 1 else 0.0)

    train = [mm(k, n) for k, n in ((64, 64), (64, 256), (256, 64), (128, 512), (512, 128), (256, 256))]
    model = ShapeModel.fit({s.key: s for s in train}, points(train, law))
    new = mm(1024, 4096)
    ts = (1, 2, 32)
    pred = model.predict(new, [{"tokens": t} for t in ts]).seconds
    truth = np.array([law(new, t) for t in ts])
    assert np.max(np.abs(pred / truth - 1)) < 0.02
    assert pred[0] > pred[1]  # one row slower than two, as measured
    assert features(new, {"tokens": 1})[3] == work(new, {"tokens": 1})[1] and features(new, {"tokens": 2})[3] == 0


def test_a_power_law_is_recovered_by_the_loglog_form() -> None:
    train = [silu(w) for w in (64, 128, 256, 512, 1024)]

    def law(s: Signature, t: int) -> float:
        return 1e-7 * work(s, {"tokens": t})[0] ** 0.7

    model = ShapeModel.fit({s.key: s for s in train}, points(train, law))
    new = silu(384)
    pred = model.predict(new, [{"tokens": 50}])
    assert pred.seconds[0] == pytest.approx(law(new, 50), rel=0.02)
    assert model.kinds[kind_of(new)].fit.form == "loglog"


def test_uncertainty_ranks_noisy_kinds_and_extrapolation_higher() -> None:
    mms = [mm(k, n) for k, n in ((64, 64), (64, 256), (256, 64), (128, 512), (512, 128), (256, 256))]
    silus = [silu(w) for w in (64, 128, 256, 512, 1024)]
    pts = {**points(mms, roofline, noise=0.01), **points(silus, roofline, noise=0.3, seed=1)}
    model = ShapeModel.fit({s.key: s for s in mms + silus}, pts)
    grid = [{"tokens": t} for t in TOKENS]
    assert model.predict(silu(300), grid).sigma > 3 * model.predict(mm(128, 128), grid).sigma
    inside, far = model.predict(mm(128, 128), grid), model.predict(mm(8192, 8192), grid)
    assert far.sigma > inside.sigma


def test_a_kind_with_too_few_signatures_is_not_covered() -> None:
    few = [mm(64, n) for n in range(1, MIN_SIGNATURES)]
    model = ShapeModel.fit({s.key: s for s in few}, points(few, roofline))
    assert not model.covers(mm(64, 99))
    assert not model.covers(mm(64, 99, "float32"))
    pred = model.predict(mm(64, 99), [{"tokens": 1}])
    assert math.isinf(pred.rel_uncertainty)
    assert not model.covers(silu(10))


def test_a_sparse_kind_falls_back_to_its_coarse_kind() -> None:
    # one 3-d silu and one 2-d: neither rank alone has two signatures, the overload and dtype together do; each
    # rank is fitted on its own signature's points, with the coarse kind's spread as its uncertainty
    a = silu(64)
    b = Signature("aten.silu.default", (TensorSpec(("tokens", 7, 32), "bfloat16"),),
                  '{"args":[{"tensor":0}],"kwargs":{}}', "hf-eager/cpu")  # fmt: skip
    model = ShapeModel.fit({a.key: a, b.key: b}, points([a, b], roofline))
    fine, coarse = model.kinds[kind_of(a)], model.kinds[coarse_kind_of(a)]
    assert fine.n_signatures == 1 and coarse.n_signatures == 2
    assert fine.sigma == coarse.sigma  # one signature has no leave-one-out spread of its own: the coarse one
    assert model.covers(silu(500))
    assert model.predict(silu(500), [{"tokens": 9}]).seconds[0] == pytest.approx(roofline(silu(500), 9), rel=0.05)


def test_excluded_signatures_stay_out_of_the_fit() -> None:
    train = [mm(k, 64) for k in (32, 64, 128)]
    sigs = {s.key: s for s in train}
    assert ShapeModel.fit(sigs, points(train, roofline)).covers(mm(1, 1))
    left_one = {train[0].key, train[1].key}
    assert not ShapeModel.fit(sigs, points(train, roofline), exclude=left_one).covers(mm(1, 1))


def test_attention_reads_keys_and_values_once_per_query_head() -> None:
    sdpa = "aten._scaled_dot_product_flash_attention_for_cpu.default"

    def decode(heads: int, kv_heads: int) -> Signature:
        q = TensorSpec(("requests", heads, 1, 64), "bfloat16")
        kv = TensorSpec(("requests", kv_heads, "kv_len + 1", 64), "bfloat16")
        return Signature(sdpa, (q, kv, kv), '{"args":[{"tensor":0},{"tensor":1},{"tensor":2}],"kwargs":{}}', "e")

    at = {"requests": 3, "kv_len": 99}
    flops, moved, tasks = work(decode(10, 5), at)
    assert flops == 4 * 3 * 10 * 1 * 100 * 64 and tasks == 30
    assert moved == 2 * 3 * 10 * (2 * 1 + 2 * 100) * 64  # bf16: q, out, and K, V per query head
    assert work(decode(10, 10), at) == (flops, moved, tasks)  # fewer KV heads store less, read as much


def test_an_elementwise_op_never_profiled_falls_back_to_its_pointwise_family() -> None:
    # silu and neg profiled, tanh never: PyTorch tags all three pointwise, so tanh takes the family's law (bytes
    # streamed); a float32 tanh, with one float32 op profiled (too few for a family of its own), the law of every
    # dtype pooled, where that one op tells bytes from elements; a softmax (not pointwise) stays uncovered
    train = [silu(64), silu(256), unary("aten.neg.default", 128), unary("aten.neg.default", 512),
             unary("aten.neg.default", 300, "float32")]  # fmt: skip
    model = ShapeModel.fit({s.key: s for s in train}, points(train, roofline))
    tanh = unary("aten.tanh.default", 1000)
    assert not model.kinds.get(kind_of(tanh)) and not model.kinds.get(coarse_kind_of(tanh))
    assert model.covers(tanh)
    assert model.predict(tanh, [{"tokens": 9}]).seconds[0] == pytest.approx(roofline(tanh, 9), rel=0.05)
    assert not model.covers(unary("aten._softmax.default", 1000))
    tanh32 = unary("aten.tanh.default", 1000, "float32")
    assert family_kinds_of(tanh32)[0] not in model.kinds and model.covers(tanh32)
    assert model.predict(tanh32, [{"tokens": 9}]).seconds[0] == pytest.approx(roofline(tanh32, 9), rel=0.05)


def test_views_and_factories_never_profiled_take_their_familys_cost() -> None:
    # a view moves no data whatever its shape (a dispatch of about 2 us); a factory writes the elements its
    # arguments size: a permute and an arange.start never profiled take those laws, a softmax neither
    def args(*a: object) -> str:
        return json.dumps({"args": list(a), "kwargs": {}})

    def arange(op: str, *a: object) -> Signature:
        return Signature(op, (), args(*a), "hf-eager/cpu")

    views = [unary("aten.t.default", 64), unary("aten.t.default", 4096), unary("aten.unsqueeze.default", 512)]
    factories = [arange("aten.arange.default", {"sym": "tokens"}), arange("aten.arange.default", {"sym": "4*tokens"})]
    train = views + factories

    def law(sig: Signature, tokens: int) -> float:
        return 2e-6 if sig in views else 4e-6 + work(sig, {"tokens": tokens})[0] * 1e-9

    model = ShapeModel.fit({s.key: s for s in train}, points(train, law, noise=0.02))
    permute = unary("aten.permute.default", 2048)
    assert family_kinds_of(permute) == ("hf-eager/cpu|view",)
    assert model.predict(permute, [{"tokens": 100}]).seconds[0] == pytest.approx(2e-6, rel=0.1)
    start = arange("aten.arange.start", 1, {"sym": "2*tokens"})
    assert family_kinds_of(start) == ("hf-eager/cpu|factory",)
    assert model.predict(start, [{"tokens": 500}]).seconds[0] == pytest.approx(law(start, 500), rel=0.1)
    assert not model.covers(unary("aten._softmax.default", 1000))


def test_a_pointwise_family_is_fitted_in_the_roofline_form_only() -> None:
    # overloads pooled in a family move different bytes per element: the log-log form's free exponents extrapolate
    # without bound there, so a family keeps the roofline even where log-log fits one overload better
    def power(sig: Signature, tokens: int) -> float:
        return 1e-6 * work(sig, {"tokens": tokens})[0] ** 0.6

    train = [silu(64), silu(256), silu(1024), unary("aten.neg.default", 128), unary("aten.neg.default", 512),
             unary("aten.neg.default", 2048)]  # fmt: skip
    model = ShapeModel.fit({s.key: s for s in train}, points(train, power))
    assert model.kinds[coarse_kind_of(silu(64))].fit.form == "loglog"
    assert model.kinds[family_kinds_of(silu(64))[0]].fit.form == "roofline"


def test_the_log_log_form_never_prices_less_work_as_more_time() -> None:
    """Points where time falls as one work measure grows (noise, or a size that barely moves across a kind's
    signatures) must not give that measure a negative exponent: far below the fitted sizes it would explode."""
    from dooly.db.shape_model import _fit

    rng = np.random.default_rng(0)
    flops = rng.uniform(1e5, 1e7, 40)
    nbytes = rng.uniform(4e6, 4.2e6, 40)  # barely moves
    t = 1e-9 * flops * (4e6 / nbytes) ** 30  # and, in these points, against the time
    fit = _fit("loglog", np.column_stack([flops, nbytes, np.zeros(40), np.zeros(40)]), t)
    assert np.all(fit.coef[1:] >= 0)
    small = np.array([[1e6, 1e6, 0.0, 0.0]])  # a quarter of the bytes: no more time than at the fitted bytes
    assert fit.predict(small)[0] <= fit.predict(np.array([[1e6, 4e6, 0.0, 0.0]]))[0] * (1 + 1e-9)

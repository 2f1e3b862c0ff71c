from tracesynth.optim import warmup_cosine


def test_time_limited_run_anneals_by_time():
    # steps is effectively unbounded (a run stopped by its time limit): the decay follows the clock
    huge = 10**9
    assert warmup_cosine(1e-3, 0, 100, huge, 1800.0, 0.0) == 1e-3 / 100  # warm-up
    assert abs(warmup_cosine(1e-3, 500, 100, huge, 1800.0, 900.0) - 0.55e-3) < 1e-9  # halfway
    assert abs(warmup_cosine(1e-3, 2000, 100, huge, 1800.0, 1800.0) - 1e-4) < 1e-12  # ends at a tenth


def test_step_limited_run_anneals_by_steps():
    assert abs(warmup_cosine(1e-3, 1000, 0, 1000, None, 5.0) - 1e-4) < 1e-12
    assert warmup_cosine(1e-3, 10, 0, 1000, None, 1e6) > 0.99e-3  # no time limit: the clock is ignored

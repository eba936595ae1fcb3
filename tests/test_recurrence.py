import math

import numpy as np
import pytest

from drc_core.model.recurrence import RecurrenceConfig, RecurrenceSampler

N = 20000


def draws(cfg: RecurrenceConfig, n: int = N) -> np.ndarray:
    sampler = RecurrenceSampler(cfg)
    return np.array([sampler.sample(step) for step in range(n)])


@pytest.mark.parametrize(("mean", "sigma"), [(8.0, 0.5), (4.0, 0.3)])
def test_poisson_lognormal_moments(mean: float, sigma: float) -> None:
    cfg = RecurrenceConfig(mean=mean, sigma=sigma, seed=3)
    r = draws(cfg)
    rate_mean = mean - 1
    var = rate_mean + (math.exp(sigma**2) - 1) * rate_mean**2
    assert cfg.expected_loops() == mean and math.isclose(cfg.variance_loops(), var)
    assert r.min() >= 1
    # the mean is within 5 standard errors; the sample variance (heavier-tailed) within 8%
    assert abs(r.mean() - mean) < 5 * math.sqrt(var / N)
    assert abs(r.var() - var) / var < 0.08


def test_deterministic_per_seed_and_step() -> None:
    a = RecurrenceSampler(RecurrenceConfig(seed=1))
    b = RecurrenceSampler(RecurrenceConfig(seed=1))
    c = RecurrenceSampler(RecurrenceConfig(seed=2))
    steps = [0, 1, 7, 1000, 123456]
    first = [a.sample(s) for s in steps]
    assert first == [b.sample(s) for s in reversed(steps)][::-1]  # order of calls does not matter
    assert first == [a.sample(s) for s in steps]
    assert [a.sample(s) for s in range(200)] != [c.sample(s) for s in range(200)]
    assert all(isinstance(x, int) for x in first)


def test_fixed_and_uniform() -> None:
    assert set(draws(RecurrenceConfig(scheme="fixed", mean=6), 50)) == {6}
    cfg = RecurrenceConfig(scheme="uniform", low=2, high=5)
    r = draws(cfg, 4000)
    assert set(r) == {2, 3, 4, 5}
    assert abs(r.mean() - cfg.expected_loops()) < 0.1
    assert abs(r.var() - cfg.variance_loops()) < 0.1
    assert set(draws(RecurrenceConfig(scheme="uniform", low=3, high=3), 20)) == {3}


def test_max_loops_clipping() -> None:
    r = draws(RecurrenceConfig(mean=8.0, max_loops=10), 5000)
    assert r.max() == 10 and r.min() >= 1
    unclipped = draws(RecurrenceConfig(mean=8.0), 5000)
    np.testing.assert_array_equal(r, np.minimum(unclipped, 10))
    assert set(draws(RecurrenceConfig(scheme="fixed", mean=6, max_loops=4), 5)) == {4}


def test_n_grad_loops() -> None:
    sampler = RecurrenceSampler(RecurrenceConfig(backprop_loops=8))
    assert sampler.n_grad_loops(3) == 3 and sampler.n_grad_loops(20) == 8
    assert RecurrenceSampler(RecurrenceConfig(backprop_loops=None)).n_grad_loops(20) is None


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"scheme": "geometric"}, "scheme='geometric' is not supported"),
        ({"mean": 1.0}, "mean=1.0 is invalid for scheme 'poisson-lognormal'"),
        ({"sigma": -0.1}, "sigma=-0.1 is invalid"),
        ({"scheme": "fixed", "mean": 2.5}, "mean=2.5 is invalid for scheme 'fixed'"),
        ({"scheme": "uniform", "low": 5, "high": 2}, "low=5, high=2 are invalid"),
        ({"scheme": "uniform", "low": 0, "high": 2}, "low=0, high=2 are invalid"),
        ({"max_loops": 0}, "max_loops=0 is invalid"),
        ({"backprop_loops": 0}, "backprop_loops=0 is invalid"),
        ({"seed": -1}, "seed=-1 is invalid"),
    ],
)
def test_bad_configs(kw: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        RecurrenceConfig(**kw)


def test_bad_step() -> None:
    with pytest.raises(ValueError, match="step=-1 is invalid"):
        RecurrenceSampler(RecurrenceConfig()).sample(-1)

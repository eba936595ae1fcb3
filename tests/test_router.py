import numpy as np
import pytest
import torch

from drc_core.analysis.loops import iterate_stats
from drc_core.analysis.measure import convergence_depth, measure_windows
from drc_core.errors import DrcError
from drc_core.halting.reference import masked_forward, offline_exits
from drc_core.halting.router import (
    FeatureSpec,
    LinearRouter,
    MLPRouter,
    RouterData,
    RouterRule,
    harvest,
    harvest_specs,
    load_router,
    router_metrics,
    save_router,
    split_windows,
    train_router,
)
from drc_core.halting.router import _auc as auc
from drc_core.model.lm import DepthRecurrentLM, iterate
from drc_core.model.passes import EVAL_STATE_SEED

V, T, N, L = 64, 16, 32, 12
EPS = 1e-2  # with core weights x2 this spreads convergence depths over 2..12 and ~70% of rows are converged


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> DepthRecurrentLM:
    return tiny_model_factory(V, core_scale=2.0).eval()


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    return torch.randint(0, V, (N, T + 1), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def split(model, windows):
    train, test = split_windows(N, 0.5, seed=0)
    kw = {"batch_size": 8, "loop_feature": "onehot"}
    return harvest(model, windows[train], L, EPS, **kw), harvest(model, windows[test], L, EPS, **kw)


@pytest.fixture(scope="module")
def trained(split) -> LinearRouter:
    router = LinearRouter(split[0].n_features)
    train_router(router, split[0], epochs=40, lr=3e-3, seed=0)
    return router


def synthetic(n: int, d: int = 6, seed: int = 0) -> RouterData:
    """Linearly separable rows (with a margin): label = w . x > 0, rows closer than 0.2 to the plane removed."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d, generator=g)
    x = torch.randn(4 * n, d, generator=g) * torch.linspace(0.5, 3.0, d) + 1.0
    margin = (x - 1.0) @ w / w.norm()
    x, margin = x[margin.abs() > 0.2][:n], margin[margin.abs() > 0.2][:n]
    ids = torch.arange(len(x))
    return RouterData(features=x.float(), labels=margin > 0, loop=torch.ones_like(ids), window=ids // 10,
                      pos=ids % 10, depth=torch.ones_like(ids), eps=1e-3, max_loops=2,
                      spec=FeatureSpec(max_loops=2))


# ----------------------------------------------------------------------------------------------------------


def test_labels_agree_with_convergence_depth(model, windows):
    data = harvest(model, windows, L, EPS, batch_size=8)
    assert len(data) == N * T * (L - 1) and data.features.shape == (len(data), 32)
    assert data.features.dtype == torch.float32 and data.labels.dtype == torch.bool
    frame = measure_windows(model, windows, L, batch_size=8, kl_to_final=False)
    depth = convergence_depth(frame, EPS)
    ref = torch.from_numpy(depth["depth"].to_numpy().astype(np.int64)).view(N, T)
    grid = data.depth.view(N, T, L - 1)
    assert (grid == ref[..., None]).all()
    loops = data.loop.view(N, T, L - 1)
    assert (loops == torch.arange(1, L)).all()
    assert torch.equal(data.labels.view(N, T, L - 1), loops >= ref[..., None])
    # the first loop labelled True is the depth (labels are monotone in the loop); unconverged tokens have none
    first = torch.where(data.labels.view(N, T, L - 1).any(-1),
                        data.labels.view(N, T, L - 1).float().argmax(-1) + 1, L)
    assert torch.equal(first, ref)
    assert 0.2 < data.positive_rate < 0.9 and len(ref.unique()) >= 5  # a non-trivial task
    # the features are the states s_l of a uniform-depth pass with the same initial states
    with torch.no_grad():
        outs = list(iterate(model, windows[:8, :-1], L, generator=torch.Generator().manual_seed(EVAL_STATE_SEED),
                                  readout=None))
    states = torch.stack([o.state for o in outs[: L - 1]], dim=2)  # (8, T, L-1, d)
    torch.testing.assert_close(data.features.view(N, T, L - 1, 32)[:8], states)


def test_harvest_subsampling_and_features(model, windows):
    sub = harvest(model, windows, L, EPS, batch_size=8, positions=5, loops=[2, 4, 6], readout_stats=True,
                  loop_feature="scalar", subsample_seed=3)
    assert len(sub) == N * 5 * 3 and sub.n_features == 32 + 1 + 5
    assert sub.spec == FeatureSpec(state=True, loop="scalar", readout_stats=True, max_loops=L)
    assert torch.isfinite(sub.features).all()
    assert torch.equal(sub.features[:, 32], sub.loop.float())
    again = harvest(model, windows, L, EPS, batch_size=4, positions=5, loops=[6, 4, 2], readout_stats=True,
                    loop_feature="scalar", subsample_seed=3)
    assert torch.equal(sub.pos, again.pos) and torch.equal(sub.labels, again.labels)  # independent of batching
    full = harvest(model, windows, L, EPS, batch_size=8)
    rows = (sub.window * T + sub.pos) * (L - 1) + sub.loop - 1
    assert torch.equal(full.labels[rows], sub.labels)
    torch.testing.assert_close(full.features[rows], sub.features[:, :32])
    assert len(sub.take_windows([0, 3])) == 2 * 5 * 3


def test_several_feature_sets_from_one_pass_equal_one_harvest_each(model, windows, monkeypatch):
    from drc_core.halting import router_data

    specs = [FeatureSpec(max_loops=L), FeatureSpec(loop="onehot", readout_stats=True, max_loops=L)]
    alone = [harvest(model, windows, L, EPS, batch_size=8, positions=5, loop_feature=sp.loop,
                     readout_stats=sp.readout_stats) for sp in specs]
    passes = []
    real = router_data.iterate_stats
    monkeypatch.setattr(router_data, "iterate_stats", lambda *a, **k: passes.append(1) or real(*a, **k))
    together = harvest_specs(model, windows, specs, L, EPS, batch_size=8, positions=5)
    assert len(passes) == N // 8  # one pass per batch of 8 windows, for both feature sets
    for a, b in zip(alone, together, strict=True):
        assert a.spec == b.spec
        for name in ("features", "labels", "loop", "window", "pos", "depth"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(DrcError, match="specs must be one or more FeatureSpec with max_loops"):
        harvest_specs(model, windows, [FeatureSpec(max_loops=L + 1)], L, EPS)


def test_split_windows():
    train, test = split_windows(10, 0.7, seed=1)
    assert len(train) == 7 and len(test) == 3 and not set(train) & set(test)
    assert sorted([*train, *test]) == list(range(10))
    again = split_windows(10, 0.7, seed=1)
    assert np.array_equal(train, again[0]) and np.array_equal(test, again[1])
    assert len(split_windows(2, 0.99)[1]) == 1


def test_linear_router_separable_data():
    data = synthetic(3000)
    train, test = data.subset(torch.arange(2000)), data.subset(torch.arange(2000, len(data)))
    router = LinearRouter(6)
    log = train_router(router, train, epochs=60, lr=5e-2, batch_size=256, seed=0)
    assert log.epochs_run >= 1 and log.n_train + log.n_val == len(train) and log.n_val > 0
    m = router_metrics(router, test)
    assert m["accuracy"] > 0.95 and m["auc"] > 0.98
    # the features are standardised with the training part's statistics
    assert torch.allclose(router.mean, train.features.mean(0), atol=0.3)
    assert (router.std > 0.3).all()


def test_router_beats_chance_on_held_out_windows(split, trained):
    train, test = split
    assert not set(train.window.tolist()) ^ set(range(N // 2))  # local ids of the training windows
    m = router_metrics(trained, test)
    assert m["auc"] > 0.65 and m["balanced_accuracy"] > 0.58
    assert m["chance_auc"] == 0.5 and m["majority_accuracy"] == pytest.approx(max(m["positive_rate"],
                                                                                 1 - m["positive_rate"]))


def test_mlp_router_on_state(model, windows):
    """The MLP baseline on the default features (the state s_l only) also beats chance on held-out windows."""
    train_idx, test_idx = split_windows(N, 0.5, seed=0)
    train = harvest(model, windows[train_idx], L, EPS, batch_size=8)
    test = harvest(model, windows[test_idx], L, EPS, batch_size=8)
    router = MLPRouter(32, hidden=32)
    train_router(router, train, epochs=40, lr=3e-3, seed=0)
    assert router_metrics(router, test)["auc"] > 0.6


def test_auc_rank_formula():
    y = np.array([0, 0, 1, 1, 0, 1], dtype=bool)
    s = np.array([0.1, 0.4, 0.35, 0.8, 0.4, 0.4])
    pairs = [(p, q) for p in s[y] for q in s[~y]]
    brute = np.mean([1.0 if p > q else 0.5 if p == q else 0.0 for p, q in pairs])
    assert auc(s, y) == pytest.approx(brute)
    assert auc(np.arange(4.0), np.array([0, 0, 1, 1], dtype=bool)) == 1.0
    assert np.isnan(auc(np.arange(3.0), np.ones(3, dtype=bool)))


def test_router_rule_through_masked_forward(model, windows, trained):
    x = windows[N // 2 :, :-1]
    depths = {}
    for tau in (1e-6, 0.5, 1 - 1e-6):
        rule = RouterRule(router=trained, tau=tau, min_loops=2, max_loops=L)
        res = masked_forward(model, x, rule, generator=torch.Generator().manual_seed(EVAL_STATE_SEED))
        assert int(res.exit_loop.min()) >= 2 and int(res.exit_loop.max()) <= L
        depths[tau] = res.avg_depth
    assert depths[1e-6] == 2.0
    assert depths[1e-6] < depths[0.5] < depths[1 - 1e-6]
    assert depths[1 - 1e-6] >= L - 1
    assert str(RouterRule(router=trained, tau=0.5, max_loops=L)).startswith("router-linear>=0.5")


def test_router_rule_matches_harvested_features(model, windows, trained):
    """offline_exits of the rule = the first loop where the router fires on the harvested features."""
    x = windows[:4]
    data = harvest(model, x, L, EPS, batch_size=4, loop_feature="onehot", loops=range(1, L + 1))
    rule = RouterRule(router=trained, tau=0.5, max_loops=L)
    stats = iterate_stats(model, x[:, :-1], L, generator=torch.Generator().manual_seed(EVAL_STATE_SEED))
    exits = offline_exits(stats, [rule])[0]
    fire = (trained.predict_proba(data.features) >= 0.5).view(4, T, L)
    fire[..., -1] = True
    assert torch.equal(exits, fire.float().argmax(-1) + 1)


def test_training_is_deterministic(split):
    train = split[0]
    logs, states = [], []
    for _ in range(2):
        r = MLPRouter(train.n_features, hidden=16)
        logs.append(train_router(r, train, epochs=5, seed=7))
        states.append(r.state_dict())
    assert logs[0] == logs[1]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    other = MLPRouter(train.n_features, hidden=16)
    train_router(other, train, epochs=5, seed=8)
    assert not torch.equal(other.state_dict()["layers.0.weight"], states[0]["layers.0.weight"])
    fresh = MLPRouter(train.n_features, hidden=16)
    g = torch.get_rng_state()
    train_router(fresh, train, epochs=1, seed=7)
    assert torch.equal(g, torch.get_rng_state())  # the global RNG is untouched


def test_early_stopping_keeps_best_epoch(split):
    r = MLPRouter(split[0].n_features, hidden=64)
    log = train_router(r, split[0], epochs=200, lr=3e-2, seed=0, patience=3)
    assert log.stopped_early and log.epochs_run < 200
    assert log.best_val_loss == min(log.val_loss) == log.val_loss[log.best_epoch - 1]
    assert log.epochs_run == log.best_epoch + 3


def test_save_load_round_trip(tmp_path, split, trained):
    for router in (trained, MLPRouter(split[0].n_features, hidden=8)):
        if router is not trained:
            train_router(router, split[0], epochs=3, seed=1)
        path = save_router(router, tmp_path / router.kind)
        loaded = load_router(path)
        assert type(loaded) is type(router) and loaded.spec == router.spec and loaded.info == router.info
        assert torch.equal(loaded.predict_proba(split[1].features), router.predict_proba(split[1].features))


def test_bad_parameters(tmp_path, model, windows, split, trained):
    def one_line(exc_info) -> None:
        assert "\n" not in str(exc_info.value)

    for tau in (0, 1, 1.5, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match="tau") as e:
            RouterRule(router=trained, tau=tau)
        one_line(e)
    for hidden in (0, -1, 2.5):
        with pytest.raises(ValueError, match="hidden") as e:
            MLPRouter(8, hidden=hidden)
        one_line(e)
    with pytest.raises(ValueError, match="d_in"):
        LinearRouter(0)
    empty = split[0].subset(torch.zeros(len(split[0]), dtype=torch.bool))
    assert len(empty) == 0
    for call in (lambda: train_router(LinearRouter(empty.n_features), empty), lambda: router_metrics(trained, empty)):
        with pytest.raises(ValueError, match="empty") as e:
            call()
        one_line(e)
    with pytest.raises(ValueError, match="features but the router reads"):
        train_router(LinearRouter(3), split[0])
    one_class = split[0].subset(split[0].labels)
    with pytest.raises(ValueError, match="both classes"):
        train_router(LinearRouter(one_class.n_features), one_class)
    with pytest.raises(ValueError, match="not a Router"):
        RouterRule(router="linear", tau=0.5)
    with pytest.raises(ValueError, match="no feature spec"):
        RouterRule(router=LinearRouter(4), tau=0.5)
    with pytest.raises(ValueError, match="train_fraction"):
        split_windows(10, 1.0)
    with pytest.raises(ValueError, match="n_windows"):
        split_windows(1, 0.5)
    with pytest.raises(ValueError, match="max_loops"):
        harvest(model, windows, 1)
    with pytest.raises(ValueError, match="eps"):
        harvest(model, windows, L, 0.0)
    with pytest.raises(ValueError, match="loops"):
        harvest(model, windows, L, loops=[L + 1])
    with pytest.raises(ValueError, match="windows"):
        harvest(model, windows[:0], L)
    with pytest.raises(ValueError, match="loop="):
        harvest(model, windows, L, loop_feature="binary")
    with pytest.raises(ValueError, match="no features"):
        FeatureSpec(state=False)
    with pytest.raises(ValueError, match="save_router"):
        load_router(tmp_path / "missing")

import json
from dataclasses import replace

import pytest
import torch

from drc_core.model.config import ModelConfig
from drc_core.model.lm import DepthRecurrentLM, LoopOutput, iterate, load_state

V, D, T = 64, 32, 16


def tiny(**kw: object) -> ModelConfig:
    base = dict(vocab_size=V, d_model=D, n_heads=2, n_prelude=1, n_core=2, n_coda=1, max_seq_len=T)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def make(seed: int = 0, **kw: object) -> DepthRecurrentLM:
    torch.manual_seed(seed)
    return DepthRecurrentLM(tiny(**kw)).eval()


def gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def idx() -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=gen(123))


@pytest.mark.parametrize(
    "kw",
    [{}, {"norm": "sandwich"}, {"injection": "add"}, {"init_state": "zeros"}, {"tie_embeddings": False}],
)
def test_shapes_and_loss(idx: torch.Tensor, kw: dict) -> None:
    model = make(**kw)
    logits = model(idx, 2)
    assert logits.shape == (2, T, V)
    logits2, loss = model(idx, 2, targets=idx, generator=gen())
    assert logits2.shape == (2, T, V) and loss.ndim == 0 and torch.isfinite(loss)
    # near-uniform predictions at init
    assert abs(loss.item() - torch.log(torch.tensor(float(V))).item()) < 0.5


@pytest.mark.parametrize("n_loops", [1, 3, 32])
def test_any_number_of_loops(idx: torch.Tensor, n_loops: int) -> None:
    with torch.no_grad():
        out = make()(idx, n_loops, generator=gen())
    assert out.shape == (2, T, V) and torch.isfinite(out).all()


def test_weight_tying(idx: torch.Tensor) -> None:
    model = make()
    n = model.num_params()
    calls: list[int] = []
    hook = model.core[0].register_forward_hook(lambda m, i, o: calls.append(id(m)))
    with torch.no_grad():
        model(idx, 5)
    hook.remove()
    assert len(calls) == 5 and len(set(calls)) == 1  # the same module object at every loop
    assert model.num_params() == n  # no parameters created by looping
    assert model.lm_head.weight is model.tok_emb.weight
    names = [k for k, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # counted once
    assert sum(p.numel() for p in model.parameters()) == n
    untied = make(tie_embeddings=False)
    assert untied.num_params() == n + V * D
    assert untied.num_params(exclude_embedding=True) == model.num_params(exclude_embedding=True)


def test_iterate_matches_forward(idx: torch.Tensor) -> None:
    model = make()
    with torch.no_grad():
        outs = list(iterate(model, idx, 8, generator=gen(7)))
        assert [o.loop for o in outs] == list(range(1, 9))
        for o in outs:
            ref = model(idx, o.loop, generator=gen(7))
            torch.testing.assert_close(o.out, ref, rtol=1e-5, atol=1e-6)


def test_iterate_positions_and_log_probs(idx: torch.Tensor) -> None:
    model = make()
    with torch.no_grad():
        full = [o.out for o in iterate(model, idx, 3, generator=gen())]
        sl = [o.out for o in iterate(model, idx, 3, generator=gen(), positions=slice(5, 12))]
        pos = torch.tensor([0, 7, 15])
        picked = [o.out for o in iterate(model, idx, 3, generator=gen(), positions=pos)]
        logp = [o.out for o in iterate(model, idx, 3, generator=gen(), readout="log_probs")]
        none = [o.out for o in iterate(model, idx, 3, generator=gen(), readout=None)]
    for f, s, p, lp, n in zip(full, sl, picked, logp, none, strict=True):
        assert s.shape == (2, 7, V)
        torch.testing.assert_close(s, f[:, 5:12], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p, f[:, pos], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lp, torch.log_softmax(f, -1), rtol=1e-5, atol=1e-5)
        assert n is None


def test_iterate_respects_grad_mode(idx: torch.Tensor) -> None:
    model = make()
    out = next(iterate(model, idx, 1))
    assert out.out.requires_grad
    with torch.no_grad():
        assert not next(iterate(model, idx, 1)).out.requires_grad


def _prelude_grads(model: DepthRecurrentLM) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.prelude.parameters()]


def test_truncated_backprop(idx: torch.Tensor) -> None:
    model = make()
    n, k = 5, 2
    record: list[tuple[bool, bool]] = []  # (grad enabled, state input requires grad) per loop

    core_step = model.core_step

    def spy(s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        record.append((torch.is_grad_enabled(), s.requires_grad))
        return core_step(s, e)

    model.core_step = spy  # type: ignore[method-assign]
    _, loss = model(idx, n, n_grad_loops=k, generator=gen(), targets=idx)
    del model.core_step
    # early loops ran without autograd; the first gradient loop gets a detached state
    assert record == [(False, False)] * 3 + [(True, False), (True, True)]
    loss.backward()
    truncated = _prelude_grads(model)

    # manual reference: the same computation written out with the public pieces
    model.zero_grad()
    e = model.embed(idx)
    s = model.initial_state(e, gen())
    with torch.no_grad():
        for _ in range(n - k):
            s = model.core_step(s, e)
    for _ in range(k):
        s = model.core_step(s, e)
    torch.nn.functional.cross_entropy(model.readout(s).flatten(0, 1), idx.flatten()).backward()
    for a, b in zip(truncated, _prelude_grads(model), strict=True):
        torch.testing.assert_close(a, b)

    # k = n (and k > n) equals full backprop, and truncation really changes the gradient
    grads = {}
    for key in (None, n, n + 3):
        model.zero_grad()
        model(idx, n, n_grad_loops=key, generator=gen(), targets=idx)[1].backward()
        grads[key] = _prelude_grads(model)
    for key in (n, n + 3):
        for a, b in zip(grads[None], grads[key], strict=True):
            torch.testing.assert_close(a, b)
    assert any(not torch.allclose(a, b) for a, b in zip(grads[None], truncated, strict=True))


def test_halt_freezes_state(idx: torch.Tensor) -> None:
    model = make()

    def halt_all_at_3(o: LoopOutput) -> torch.Tensor | None:
        return torch.ones_like(o.halted) if o.loop == 3 else None

    with torch.no_grad():
        outs = list(iterate(model, idx, 5, generator=gen(), halt=halt_all_at_3))
        plain = list(iterate(model, idx, 3, generator=gen()))
    assert not outs[1].halted.any() and (outs[1].exit_loop == 0).all()
    for o in outs[2:]:
        assert o.halted.all() and (o.exit_loop == 3).all()
        torch.testing.assert_close(o.state, outs[2].state, rtol=0, atol=0)
        torch.testing.assert_close(o.out, outs[2].out, rtol=0, atol=0)
    torch.testing.assert_close(outs[2].out, plain[2].out)


def test_halt_partial_tokens(idx: torch.Tensor) -> None:
    model = make()
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[0, :4] = True

    def halt(o: LoopOutput) -> torch.Tensor | None:
        if o.loop == 2:
            return mask
        if o.loop == 4:
            return torch.ones_like(mask)  # already-halted tokens keep their exit loop
        return None

    with torch.no_grad():
        outs = list(iterate(model, idx, 5, generator=gen(), halt=halt))
    assert (outs[2].exit_loop[mask] == 2).all() and (outs[2].exit_loop[~mask] == 0).all()
    assert (outs[4].exit_loop[mask] == 2).all() and (outs[4].exit_loop[~mask] == 4).all()
    torch.testing.assert_close(outs[4].state[mask], outs[1].state[mask], rtol=0, atol=0)
    assert not torch.allclose(outs[2].state[~mask], outs[1].state[~mask])


def test_save_load_round_trip(tmp_path, idx: torch.Tensor) -> None:
    for kw in ({}, {"tie_embeddings": False, "norm": "sandwich"}):
        model = make(**kw)
        model.save(tmp_path / str(len(kw)))
        loaded = DepthRecurrentLM.load(tmp_path / str(len(kw))).eval()
        assert loaded.cfg == model.cfg
        if model.cfg.tie_embeddings:
            assert loaded.lm_head.weight is loaded.tok_emb.weight
        with torch.no_grad():
            torch.testing.assert_close(loaded(idx, 3, generator=gen()), model(idx, 3, generator=gen()))


def test_load_mismatch_errors(tmp_path) -> None:
    make(d_model=64).save(tmp_path / "big")
    with pytest.raises(
        ValueError, match=r"tensor tok_emb\.weight has shape \(64,64\) but the model expects \(64,32\)"
    ):
        load_state(make(), tmp_path / "big")
    with pytest.raises(ValueError, match="made with d_model=64 .*; load it with its own config.json"):
        load_state(make(), tmp_path / "big")
    make(n_prelude=0, mlp_hidden=48).save(tmp_path / "mlp")
    with pytest.raises(ValueError, match=r"core\.0\.mlp\.gate_up\.weight has shape \(96,32\).*mlp_hidden=48"):
        load_state(make(n_prelude=0), tmp_path / "mlp")
    with pytest.raises(ValueError, match="tok_emb.weight has shape"):  # a bare weights file: no config hint
        weights = tmp_path / "w.safetensors"
        (tmp_path / "big" / "model.safetensors").rename(weights)
        load_state(make(), weights)

    make(n_core=3).save(tmp_path / "deep")
    with pytest.raises(ValueError, match=r"unexpected tensor core\.2\..*n_core=3"):
        load_state(make(), tmp_path / "deep")
    make().save(tmp_path / "small")
    with pytest.raises(ValueError, match=r"missing tensor core\.2\..*n_core=2"):
        load_state(make(n_core=3), tmp_path / "small")

    make(rope_base=500.0).save(tmp_path / "rope")
    with pytest.raises(ValueError, match=r"config\.json has rope_base=500\.0"):
        load_state(make(), tmp_path / "rope")
    make(dropout=0.1).save(tmp_path / "drop")  # dropout changes no weights: loads fine
    load_state(make(), tmp_path / "drop")


def test_config_round_trip_and_unknown_keys(tmp_path) -> None:
    cfg = tiny(norm="sandwich", mlp_hidden=48)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown ModelConfig key 'n_layer'"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_layer": 4})
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig.from_dict({"d_model": 32})
    damaged = {k: v for k, v in cfg.to_dict().items() if k != "n_heads"}  # no default is filled in silently
    with pytest.raises(ValueError, match="lacks ModelConfig field n_heads"):
        ModelConfig.from_dict(damaged)


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        (
            {"n_heads": 6, "d_model": 128},
            r"n_heads=6 does not divide d_model=128; choose n_heads in \{1, 2, 4",
        ),
        ({"n_heads": 4, "d_model": 12}, "head_dim = d_model/n_heads = 3 is odd"),
        ({"d_model": 0}, "d_model=0 is invalid"),
        ({"n_core": 0}, "n_core=0 is invalid"),
        ({"n_prelude": -1}, "n_prelude=-1 is invalid"),
        ({"vocab_size": 3.5}, "vocab_size=3.5 is invalid"),
        ({"norm": "post"}, "norm='post' is not supported"),
        ({"injection": "gate"}, "injection='gate' is not supported"),
        ({"init_state": "ones"}, "init_state='ones' is not supported"),
        ({"dropout": 1.0}, "dropout=1.0 is invalid"),
        ({"init_state_scale": -1.0}, "init_state_scale=-1.0 is invalid"),
        ({"rope_base": 0}, "rope_base=0 is invalid"),
    ],
)
def test_bad_configs(kw: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        tiny(**kw)


def test_prelude_and_coda_may_be_empty(idx: torch.Tensor) -> None:
    model = make(n_prelude=0, n_coda=0)
    with torch.no_grad():
        assert model(idx, 2).shape == (2, T, V)


def test_bad_call_arguments(idx: torch.Tensor) -> None:
    model = make()
    with pytest.raises(ValueError, match="n_loops=0"):
        model(idx, 0)
    with pytest.raises(ValueError, match="n_grad_loops=0"):
        model(idx, 2, n_grad_loops=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, T + 1, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="readout='probs'"):
        next(iterate(model, idx, 1, readout="probs"))


def test_init_state(idx: torch.Tensor) -> None:
    model = make(init_state_scale=0.5)
    e = torch.zeros(4, T, D)
    s = model.initial_state(e, gen())
    assert abs(s.std().item() - 0.5) < 0.05
    torch.testing.assert_close(s, model.initial_state(e, gen()))
    assert not model.initial_state(e, gen(2)).equal(s)
    assert make(init_state="zeros").initial_state(e).abs().sum() == 0


def test_init_scales() -> None:
    model = make()
    L = 1 + 2 + 1
    assert abs(model.core[0].attn.proj.weight.std().item() - 0.02 / (2 * L) ** 0.5) < 0.002
    assert abs(model.core[0].attn.qkv.weight.std().item() - 0.02) < 0.002


def test_flops_per_token() -> None:
    cfg = tiny()
    model = DepthRecurrentLM(cfg)
    h = cfg.hidden_dim
    block = 2 * (4 * D * D + 3 * D * h) + 4 * T * D
    expected = lambda r: 2 * block + r * (2 * block + 4 * D * D) + 2 * D * V  # noqa: E731
    assert model.flops_per_token(1, T) == expected(1)
    assert model.flops_per_token(8, T) == expected(8)
    # the core block's matmul FLOPs are 2 x its parameters (norm weights excluded)
    core_matmul = sum(p.numel() for p in model.core[0].parameters() if p.ndim == 2)
    assert block - 4 * T * D == 2 * core_matmul
    assert replace(cfg, injection="add") != cfg
    add = DepthRecurrentLM(replace(cfg, injection="add"))
    assert model.flops_per_token(3, T) - add.flops_per_token(3, T) == 3 * 4 * D * D

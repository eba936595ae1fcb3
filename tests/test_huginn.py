"""Huginn-0125 checkpoints through ``drc_core.load``: the tiny upstream-written fixture reproduces the upstream logits
and states at every stored loop count, the library's paths (trace, generate with a rule, calibrate) run on it, and
bad checkpoints are one-line DrcErrors refused before anything is read or allocated.

The fixture (``huginn-tiny``: config.json, model.safetensors, expected.safetensors, README.md) lives outside the
repository; ``DRC_HUGINN_FIXTURE`` points to it (default ``/work/shared/fixtures/huginn-tiny``)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

import drc_core
from drc_core.errors import DrcError
from drc_core.halting.generate import generate as generate_ids
from drc_core.halting.reference import masked_forward
from drc_core.halting.rules import Uniform, make_rule
from drc_core.model import huginn_checkpoint
from drc_core.model.huginn import HuginnLM
from drc_core.model.lm import iterate, logits_at

FIXTURE = Path(os.environ.get("DRC_HUGINN_FIXTURE", "/work/shared/fixtures/huginn-tiny"))
pytestmark = pytest.mark.skipif(not (FIXTURE / "expected.safetensors").is_file(),
                                reason=f"the huginn-tiny fixture is not at {FIXTURE} (set DRC_HUGINN_FIXTURE)")
TOL = 1e-4


@pytest.fixture(scope="module")
def lm(one_thread) -> drc_core.Model:
    return drc_core.load(FIXTURE)


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "expected.safetensors"))


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a.float() - b.float()).abs().max())


def _zeros(ex: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.zeros_like(ex["prelude_out"])


# ----------------------------------------------------------------------------------------------------------
# Numbers against upstream


def test_load_gives_the_model_object_with_the_checkpoint_depth(lm):
    assert isinstance(lm, drc_core.Model) and isinstance(lm.model, HuginnLM)
    assert lm.tokenizer is None and lm.config is None and not lm.model.training
    assert lm.model.mean_recurrence == 4 and lm.model.vocab_size == 256 and lm.model.max_seq_len == 64
    assert isinstance(lm.model, drc_core.RecurrentModel)


@pytest.mark.parametrize("steps", json.loads((FIXTURE / "expected.json").read_text())["num_steps"]
                         if (FIXTURE / "expected.json").is_file() else [])
def test_logits_match_upstream_at_every_stored_loop_count(lm, expected, steps):
    ids, s0 = expected["input_ids"], _zeros(expected)
    with torch.no_grad():
        assert _diff(logits_at(lm.model, ids, steps, state=s0), expected[f"logits_steps_{steps}"]) <= TOL
        assert _diff(lm.model(ids, steps, state=s0), expected[f"logits_steps_{steps}"]) <= TOL


def test_intermediate_tensors_and_per_iteration_states_match_upstream(lm, expected):
    m, ids = lm.model, expected["input_ids"]
    with torch.no_grad():
        assert _diff(m.token_embedding(ids), expected["embeds_scaled"]) <= TOL
        assert _diff(m.embed(ids), expected["prelude_out"]) <= TOL
        states = torch.stack([o.state for o in iterate(m, ids, 8, state=_zeros(expected), readout=None)])
        assert _diff(states, expected["latents_per_step_steps_8"]) <= TOL
        assert _diff(m.norm(states[-1]), expected["latent_states_steps_8"]) <= TOL
        cos, sin = m.rope_cos[: ids.shape[1]], m.rope_sin[: ids.shape[1]]
        x = states[-1]
        for block in m.coda:
            x = block(x, cos, sin)
        assert _diff(x, expected["coda_out_steps_8"]) <= TOL


def test_initial_state_follows_the_checkpoint_rule_and_seeds(lm, expected):
    m, ids, e = lm.model, expected["input_ids"], expected["prelude_out"]
    torch.manual_seed(2)  # upstream drew random_state_init right after this seed, with its own initialize_state
    assert _diff(m.initial_state(e), expected["random_state_init"]) <= 1e-6
    torch.manual_seed(2)  # and its default forward draws the same state
    with torch.no_grad():
        assert _diff(m(ids, 4), expected["logits_random_state_steps_4"]) <= TOL
    bound = 3 * m.cfg.state_std * m.cfg.embed_scale + 1e-6
    s = m.initial_state(e, torch.Generator().manual_seed(7))
    assert s.abs().max() <= bound and s.std() > 0.5 * m.cfg.state_std * m.cfg.embed_scale
    assert torch.equal(s, m.initial_state(e, torch.Generator().manual_seed(7)))
    assert not torch.equal(s, m.initial_state(e, torch.Generator().manual_seed(8)))
    m.init_scale = 0.0
    try:
        assert not m.initial_state(e).any()
        with torch.no_grad():  # no depth given: the trained mean depth (4), as upstream's num_steps=None
            assert _diff(m(ids), expected["logits_steps_4"]) <= TOL
    finally:
        m.init_scale = 1.0


def test_bf16_load_keeps_bf16_weights_and_close_logits(one_thread, expected):
    m = drc_core.load(FIXTURE, dtype=torch.bfloat16).model
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    ids = expected["input_ids"]
    with torch.no_grad():
        logits = m(ids, 4, state=_zeros(expected).bfloat16())
    assert logits.dtype == torch.bfloat16 and _diff(logits, expected["logits_steps_4"]) < 0.5


def _mapped_from(model: torch.nn.Module, file: Path) -> list[str]:
    """The parameters whose memory lies in a mapping of ``file`` (Linux /proc/self/maps)."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        pytest.skip("needs /proc/self/maps")
    regions = []
    for line in maps.read_text().splitlines():
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        regions.append((lo, hi, parts[5] if len(parts) > 5 else ""))
    return [name for name, p in model.named_parameters()
            if any(lo <= p.data_ptr() < hi and path == str(file) for lo, hi, path in regions)]


def test_weights_are_memory_mapped_not_copied(lm):
    names = [name for name, _ in lm.model.named_parameters()]
    assert _mapped_from(lm.model, (FIXTURE / "model.safetensors").resolve()) == names


def test_the_default_dtype_is_the_stored_one(tmp_path, one_thread, expected):
    """A bf16 checkpoint loads in bf16 by default, mapped in place; dtype=float32 converts it (a copy)."""
    tensors = {k: v.bfloat16() for k, v in load_file(str(FIXTURE / "model.safetensors")).items()}
    path = tmp_path / "bf16.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    d = _copy(tmp_path, weights=path.read_bytes())
    m = drc_core.load(d).model
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert len(_mapped_from(m, (d / "model.safetensors").resolve())) == len(list(m.parameters()))
    m32 = drc_core.load(d, dtype=torch.float32).model
    assert {p.dtype for p in m32.parameters()} == {torch.float32}
    assert _mapped_from(m32, (d / "model.safetensors").resolve()) == []
    with torch.no_grad():
        assert _diff(m32(expected["input_ids"], 4, state=_zeros(expected)), expected["logits_steps_4"]) < 0.5


def test_loading_uses_no_pickle(monkeypatch, one_thread):
    def refuse(*args, **kwargs):
        raise AssertionError("pickle used")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(mod, name, refuse)
    assert isinstance(drc_core.load(FIXTURE).model, HuginnLM)


# ----------------------------------------------------------------------------------------------------------
# The library's paths on it


def _byte_tokenizer(keep: int = 256, extra: int = 0) -> Tokenizer:
    """A byte-level tokenizer of ``keep`` byte tokens (256: every byte) plus ``extra`` added tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:keep]
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([f"<extra{i}>" for i in range(extra)])
    return tok


def _copy(tmp_path: Path, config: dict | None = None, weights: bytes | None = None,
          tokenizer: Tokenizer | None = None) -> Path:
    """The fixture checkpoint in tmp_path, with an edited config, other weight bytes or a tokenizer."""
    d = tmp_path / "ckpt"
    d.mkdir()
    cfg = json.loads((FIXTURE / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg if config is None else {**cfg, **config}))
    if weights is None:
        (d / "model.safetensors").symlink_to(FIXTURE / "model.safetensors")
    else:
        (d / "model.safetensors").write_bytes(weights)
    if tokenizer is not None:
        tokenizer.save(str(d / "tokenizer.json"))
    return d


def test_trace_and_generate_with_a_kl_rule(tmp_path, one_thread):
    lm = drc_core.load(_copy(tmp_path, tokenizer=_byte_tokenizer()))
    tr = lm.trace("Huginn thinks in loops.")
    assert tr.max_loops == 4 and len(tr.tokens) == len("Huginn thinks in loops.")
    assert tr.to_frame()["kl"].notna().any() and tr.convergence_depth()["depth"].between(1, 4).all()
    rule = make_rule("kl", 1e-2, max_loops=8)
    gen = lm.generate("Huginn", max_new_tokens=6, rule=rule)
    assert len(gen.ids) == 6 and all(0 <= i < 256 for i in gen.ids) and gen.exit_loops.max() <= 8
    assert isinstance(gen.text, str) and 1 <= gen.avg_depth <= 8


@pytest.mark.parametrize("tau", [1e-1, 1e-3])
def test_kv_cached_generation_equals_the_masked_reference(lm, expected, tau):
    """generate (KV caches, skipped compute) = masked_forward on the generated sequence: same exits, same logits."""
    rule = make_rule("kl", tau, max_loops=10)
    out = generate_ids(lm.model, expected["input_ids"][:, :10], 8, rule, generator=torch.Generator().manual_seed(0))
    ref = masked_forward(lm.model, out.tokens[:, :-1], rule, state=out.initial_state[:, :-1])
    assert torch.equal(out.exit_loop, ref.exit_loop) and out.exit_loop.unique().numel() > 1
    assert _diff(out.logits, ref.logits) <= TOL


def test_kv_cached_generation_at_fixed_depth_equals_the_full_forward(lm, expected):
    s0 = torch.zeros(2, 18, 64)
    out = generate_ids(lm.model, expected["input_ids"][:, :10], 8, Uniform(4), state=s0)
    with torch.no_grad():
        full = logits_at(lm.model, out.tokens[:, :-1], 4, state=s0[:, :-1])
    assert _diff(out.logits, full) <= TOL and torch.equal(out.tokens[:, 10:], full[:, 9:].argmax(-1))


def test_calibrate_references_the_trained_mean_depth(lm, one_thread):
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (40,), generator=g).tolist() for _ in range(6)]
    cal = lm.calibrate(docs, "kl", alpha=0.3, delta=0.3, max_loops=5, seq_len=16)
    assert cal.certificate.reference_loops == lm.model.mean_recurrence


def test_without_a_tokenizer_ids_work_and_text_says_so(lm):
    assert lm.trace([1, 2, 3, 4]).max_loops == 4
    for call in (lambda: lm.trace("some text"), lambda: lm.generate("some text")):
        with pytest.raises(DrcError, match="has no tokenizer.json, so text cannot be encoded: pass token ids"):
            call()


# ----------------------------------------------------------------------------------------------------------
# Bad checkpoints: one line each, refused before the tensors are read


def _fails(path: Path, match: str, monkeypatch=None, **kwargs) -> str:
    if monkeypatch is not None:  # nothing may be opened with safetensors (or allocated from it)
        monkeypatch.setattr(huginn_checkpoint, "safe_open", lambda *a, **k: pytest.fail("tensors were read"))
    with pytest.raises(DrcError, match=match) as info:
        drc_core.load(path, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_another_architecture(tmp_path, monkeypatch):
    d = _copy(tmp_path, {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    _fails(d, r"describes a 'llama' model .* not Huginn \(huginn_raven\)", monkeypatch)


def test_missing_weights(tmp_path):
    d = _copy(tmp_path)
    (d / "model.safetensors").unlink()
    _fails(d, "has config.json but no model.safetensors .*download the weights")


def test_truncated_weights(tmp_path, monkeypatch):
    data = (FIXTURE / "model.safetensors").read_bytes()
    _fails(_copy(tmp_path, weights=data[:-1000]), "is truncated or declares too much.*download it again", monkeypatch)


@pytest.mark.parametrize("edit, match", [
    ({"intermediate_size": 128}, r"tensor transformer\.\w+\.0\.mlp\.fc\.weight has shape \(512, 64\) but config"),
    ({"n_layers_in_recurrent_block": 3}, r"tensor transformer\.core_block\.2\.\S+ is missing"),
    ({"n_layers_in_coda": 0}, r"n_layers_in_coda=0 is invalid"),
    ({"n_heads": 8, "head_dim": 8, "num_key_value_heads": 8}, r"qk_bias has shape \(2, 1, 4, 16\) but config"),
    ({"qk_bias": False}, r"qk_bias is not part of this architecture"),
    ({"rope_base": 10000}, r"freqs_cis differs from rope_base=10000"),
    ({"num_key_value_heads": 2}, r"num_key_value_heads=2, .* one even head size"),
    ({"injection_type": "add"}, r"injection_type='add' is not supported"),
    ({"n_embd": 65536, "n_heads": 1, "num_key_value_heads": 1, "head_dim": 65536, "block_size": 2**20},
     r"block_size=1048576 x head_dim=65536 is above the \d+ RoPE entries"),
])
def test_config_that_disagrees_with_the_weights(tmp_path, monkeypatch, edit, match):
    if "rope_base" not in edit:  # the RoPE table is the one tensor read before it is compared
        monkeypatch.setattr(huginn_checkpoint, "safe_open", lambda *a, **k: pytest.fail("tensors were read"))
    _fails(_copy(tmp_path, edit), match)


@pytest.mark.parametrize("tok", [_byte_tokenizer(extra=44), _byte_tokenizer(keep=100)], ids=["300 ids", "100 ids"])
def test_tokenizer_that_does_not_fit_the_embedding(tmp_path, tok):
    _fails(_copy(tmp_path, tokenizer=tok), r"has \d+ ids but the checkpoint's vocabulary is 256 .*own tokenizer")


@pytest.mark.parametrize("edit", [{"n_embd": 10**9}, {"block_size": 2**40}, {"padded_vocab_size": 10**12},
                                  {"mean_recurrence": 10**6}, {"n_layers_in_prelude": 10**7}])
def test_config_declaring_absurd_sizes(tmp_path, monkeypatch, edit):
    (key,) = edit
    _fails(_copy(tmp_path, edit), rf"{key}={edit[key]} is invalid; it must be an integer in \[", monkeypatch)


def _header_file(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize("weights, match", [
    (_header_file({"transformer.wte.weight": {"dtype": "F32", "shape": [2**40, 64], "data_offsets": [0, 2**48]}}),
     r"needs 281474976710656 bytes of tensor data but the file holds 0"),
    (_header_file({"transformer.wte.weight": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}},
                  b"\0" * 16), r"declares shape \(1099511627776, 1099511627776\) but 16 bytes"),
    ((2**62).to_bytes(8, "little") + b"{}", r"declares a 4611686018427387904-byte header but holds 10 bytes"),
    (_header_file({"transformer.wte.weight": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}, b"\0" * 16),
     r"has dtype I64; Huginn weights are F32, F16 or BF16"),
    (b"not a safetensors file at all", r"declares a \d+-byte header"),
])
def test_safetensors_header_declaring_absurd_or_bad_contents(tmp_path, monkeypatch, weights, match):
    _fails(_copy(tmp_path, weights=weights), match, monkeypatch)


def test_a_wrong_dtype_tensor_and_an_unknown_dtype_argument(tmp_path):
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    tensors["transformer.ln_f.weight"] = tensors["transformer.ln_f.weight"].long()
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    _fails(_copy(tmp_path, weights=path.read_bytes()), r"tensor transformer\.ln_f\.weight has dtype I64")
    _fails(FIXTURE, r"dtype='int8' is not supported", dtype="int8")


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path, lm, expected):
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(FIXTURE / "config.json", d / "config.json")
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, str(d / file))
    index = {"weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with torch.no_grad():
        got = drc_core.load(d).model(expected["input_ids"], 8, state=_zeros(expected))
    assert _diff(got, expected["logits_steps_8"]) <= TOL
    index["weight_map"]["freqs_cis"] = "../model.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(d, "has no weight_map of file names beside it")


def test_our_run_directories_refuse_a_dtype(tmp_path, tiny_model_factory):
    run = tiny_model_factory(64).save(tmp_path / "run")
    _fails(run, r"dtype=torch.bfloat16 applies to Huginn checkpoints", dtype=torch.bfloat16)

"""Property-based tests of the public API's arguments (hypothesis): whatever a caller passes -- token ids of any
dtype, shape and range, loop counts from 0 to huge, rules built by name with any numbers, any text -- each entry
point either works or raises a one-line :class:`~drc_core.errors.DrcError`, within a time bound: never another
exception (``IndexError``, ``TypeError``, ``RuntimeError`` from deep inside torch or tokenizers), never a hang.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings  # a dev dependency (pyproject.toml)
from hypothesis import strategies as st

import drc_core
from drc_core.data.tokenizer import train_bpe
from drc_core.errors import DrcError
from drc_core.halting.generate import generate as generate_ids
from drc_core.halting.reference import masked_forward
from drc_core.halting.skipping import skip_forward
from drc_core.model.config import ModelConfig
from drc_core.model.lm import DepthRecurrentLM, iterate

SECONDS = 5.0  # the time bound of one call: a tiny model at its largest accepted depth takes well under this
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    derandomize=True)


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["The president spoke to Congress about the state of the union."] * 20 + ["numbers 1 2 3 and more"] * 20
    return train_bpe(texts, 300)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.get_vocab_size(), d_model=16, n_heads=2, n_prelude=1, n_core=1,
                      n_coda=1, max_seq_len=12)
    return DepthRecurrentLM(cfg).eval()


def works_or_drc_error(fn) -> None:
    """Call ``fn``: it must return or raise DrcError (one line), within :data:`SECONDS`."""
    t0 = time.perf_counter()
    try:
        fn()
    except DrcError as exc:
        assert "\n" not in str(exc).strip(), f"a DrcError of several lines: {exc}"
    seconds = time.perf_counter() - t0
    assert seconds < SECONDS, f"took {seconds:.1f} s"


INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8]
DTYPES = [*INT_DTYPES, torch.float32, torch.float64, torch.bool]


@st.composite
def id_tensors(draw) -> torch.Tensor:
    """Tensors a caller might pass as token ids: mostly plausible, often out of range, of another dtype or shape."""
    dims = draw(st.integers(0, 3))
    shape = draw(st.lists(st.integers(0, 20), min_size=dims, max_size=dims))
    dtype = draw(st.sampled_from(DTYPES))
    lo, hi = draw(st.sampled_from([(0, 300), (-5, 5), (290, 70000), (0, 2), (-(2**40), 2**40)]))
    n = math.prod(shape)
    values = draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
    t = torch.tensor(values, dtype=torch.int64).reshape(shape)
    if dtype in (torch.float32, torch.float64, torch.bool):
        return t.to(dtype)
    info = torch.iinfo(dtype)
    return t.clamp(info.min, info.max).to(dtype)


LOOPS = st.one_of(st.integers(-3, 40), st.sampled_from([1024, 1025, 10**9, 2**63]), st.floats(allow_nan=True),
                  st.booleans(), st.none(), st.text(max_size=3))


@PROPERTY
@given(ids=id_tensors(), loops=LOOPS)
def test_forward_takes_any_ids_and_loops(model, ids, loops):
    works_or_drc_error(lambda: model(ids, loops))


@PROPERTY
@given(ids=id_tensors(), loops=LOOPS, readout=st.sampled_from(["logits", "log_probs", None, "probs"]))
def test_iterate_takes_any_ids_and_loops(model, ids, loops, readout):
    works_or_drc_error(lambda: list(iterate(model, ids, loops, readout=readout)))


RULE_NAMES = st.sampled_from([*drc_core.RULE_FAMILIES, "oracle", "nope"])
NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 2**40), st.booleans(),
                    st.none(), st.text(max_size=2))
RULE_KW = st.dictionaries(st.sampled_from(["min_loops", "max_loops", "max_loops", "typo"]),
                          st.one_of(st.sampled_from([1024, 1025, 10**9]), st.integers(-2, 40), NUMBERS), max_size=2)


def default_args(name: str) -> list:
    """The arguments a family is usually built with: its first grid value (the threshold), or none."""
    cls = drc_core.RULE_FAMILIES.get(name)
    if name == "uniform":
        return [2]
    return [cls.grid[0]] if cls is not None and cls.grid else []


@st.composite
def rule_calls(draw) -> tuple[str, list, dict]:
    name = draw(RULE_NAMES)
    args = draw(st.one_of(st.just(default_args(name)), st.lists(NUMBERS, max_size=2)))
    kwargs = draw(st.one_of(st.builds(dict, max_loops=st.sampled_from([16, 1024, 1025, 10**9])), RULE_KW))
    return name, args, kwargs


@PROPERTY
@given(call=rule_calls(), ids=id_tensors(), skipping=st.booleans())
def test_rules_by_name_run_or_refuse(model, call, ids, skipping):
    """make_rule with any numbers; a rule it accepts runs (skip_forward or masked_forward) within the bound: a huge
    loop count is refused at construction, never left to hang the run."""
    name, args, kwargs = call

    def run():
        rule = drc_core.make_rule(name, *args, **kwargs)
        assert rule.max_loops <= 1024
        (skip_forward if skipping else masked_forward)(model, ids, rule)

    works_or_drc_error(run)


@PROPERTY
@given(ids=id_tensors(), new=st.one_of(st.integers(-2, 20), NUMBERS), k=st.integers(1, 8))
def test_generate_takes_any_prompt_and_length(model, ids, new, k):
    works_or_drc_error(lambda: generate_ids(model, ids, new, drc_core.make_rule("uniform", k)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(text=st.one_of(st.text(max_size=30), st.text(st.characters(codec="utf-8"), max_size=30),
                      st.sampled_from(["", " ", "\x00", "\ufffd" * 3, "a" * 500])),
       loops=st.one_of(st.integers(-1, 6), st.sampled_from([1025, 10**12])))
def test_trace_and_generate_take_any_text(model, tokenizer, text, loops):
    works_or_drc_error(lambda: drc_core.trace(model, text, max_loops=loops, tokenizer=tokenizer))
    works_or_drc_error(lambda: drc_core.generate(model, tokenizer, text, max_new_tokens=2,
                                                 rule=drc_core.make_rule("uniform", 2)))


@pytest.mark.parametrize("name", [n for n in drc_core.RULE_FAMILIES if n != "uniform"])
def test_a_huge_loop_count_is_refused_when_the_rule_is_built(name):
    with pytest.raises(DrcError, match="limit of 1024"):
        drc_core.make_rule(name, *default_args(name), max_loops=10**9)
    with pytest.raises(DrcError, match="limit of 1024"):
        drc_core.make_rule("uniform", 10**9)

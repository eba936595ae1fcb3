"""The depth-tasks source: generator and independent solver agree, answers follow their questions, labels land
on the answer tokens of a prepared corpus, and the per-answer measurements read the right rows."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch

from drc_book import known_depth as dt
from drc_core.analysis.measure import Measurement
from drc_core.data.depth_tasks import (
    FAMILIES,
    DepthTaskConfig,
    SolveError,
    _hop_path,
    documents,
    generate_document,
    solve,
    token_labels,
)
from drc_core.data.labels import read_labels
from drc_core.data.prepare import PrepareConfig, prepare
from drc_core.data.sampler import Corpus
from drc_core.data.sources import SourceSpec
from drc_core.errors import DrcError
from drc_core.halting.rules import KLThreshold, Never
from drc_core.halting.sweep import RuleSpec, offline_pass
from drc_core.model.config import ModelConfig
from drc_core.model.lm import DepthRecurrentLM


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k_range", [(1, 6), (7, 12), (15, 15)])
def test_solver_agrees_with_generator(family, k_range):
    cfg = DepthTaskConfig(docs=40, min_k=k_range[0], max_k=k_range[1], families=(family,), repeat_share=0.0)
    seen = set()
    for i in range(cfg.docs):
        text, problems = generate_document(cfg, i)
        solved = solve(text)
        recorded = [(w, k) for p in problems for w, k in p.answers]
        assert [(a.word, a.k) for a in solved] == recorded
        assert all(a.family == family for a in solved)
        assert all(text[a.start : a.end] == a.word for a in solved)
        seen |= {a.k for a in solved}
    assert seen == set(range(k_range[0], k_range[1] + 1))  # every k of the range occurs


@pytest.mark.parametrize("family", ["containers", "links"])
def test_ask_every_asks_each_object_of_each_asked_chain(family):
    """Deepest-first, a chain of length n is asked n times with k = n, n-1, .., 1; shuffled, the same statements
    and questions in another order, where a question after one about an object further down its chain takes
    that shortcut (fewer lookups, never more)."""
    cfg = DepthTaskConfig(docs=20, max_k=5, families=(family,), repeat_share=0.0, ask_every=True,
                          ask_order="deepest-first")
    shorter = 0
    for i in range(cfg.docs):
        deep_text, deep = generate_document(cfg, i)
        text, shuffled = generate_document(replace(cfg, ask_order="shuffled"), i)
        for t, problems in ((deep_text, deep), (text, shuffled)):
            assert [(a.word, a.k) for a in solve(t)] == [(w, k) for p in problems for w, k in p.answers]
        assert sorted(text.split()) == sorted(deep_text.split())
        for p, q in zip(deep, shuffled, strict=True):
            ks = sorted(k for _, k in p.answers)
            assert ks.count(1) == 3 and all(ks.count(k) >= ks.count(k + 1) for k in range(1, 5))
            assert sum(k for _, k in q.answers) <= sum(ks) and len(q.answers) == len(ks)
            shorter += sum(k for _, k in q.answers) < sum(ks)
    assert shorter > 0
    assert DepthTaskConfig().ask_every is False and DepthTaskConfig().ask_order == "shuffled"


def test_an_answered_question_shortens_a_later_one():
    text = "Links: cup box . box bag . bag barn . ? box barn . ? cup barn . ? bag barn ."
    assert [a.k for a in solve(text)] == [2, 2, 1]  # cup -> box, then the answer to '? box barn'
    assert [a.k for a in solve(text.replace("? box barn . ? cup barn", "? cup barn . ? box barn"))] == [3, 2, 1]
    prose = ("The cup is in the box. The box is in the bag. The bag is in the barn. Where is the box? It is in the "
             "barn. Where is the cup? It is in the barn.")
    assert [a.k for a in solve(prose)] == [2, 2]
    with pytest.raises(DrcError, match="ask_order"):
        DepthTaskConfig(ask_order="random").validate()


def test_links_is_the_compact_notation_of_containers():
    text = "Links: cup box . box barn . ? cup barn . ? box barn ."
    assert [(a.word, a.k, a.family) for a in solve(text)] == [("barn", 2, "links"), ("barn", 1, "links")]
    with pytest.raises(SolveError):
        solve(text.replace("? cup barn", "? cup box"))


def test_answers_come_after_their_question_and_are_not_stated_before():
    cfg = DepthTaskConfig(docs=30)
    for i in range(cfg.docs):
        text, _ = generate_document(cfg, i)
        for a in solve(text):
            par_start = text.rfind("\n\n", 0, a.start) + 2 if "\n\n" in text[: a.start] else 0
            before = text[par_start : a.start]
            assert "?" in before or "Jump" in before  # the question precedes the answer
            question = before[max(before.rfind("."), before.rfind("?", 0, len(before) - 1)) :]
            if a.family == "containers":
                # the question names an object, never the place that answers it
                asked = re.search(r"Where is the (\w+)\?", before[before.rfind("Where") :]).group(1)
                assert asked != a.word
            assert a.word not in question.split("?")[0].split()


def test_generation_is_a_function_of_seed_and_index():
    a = DepthTaskConfig(docs=5, seed=3)
    assert documents(a)[:3] == documents(DepthTaskConfig(docs=3, seed=3))
    assert documents(a) != documents(DepthTaskConfig(docs=5, seed=4))


def test_solver_recomputes_instead_of_trusting_the_text():
    good = "The cup is in the box. The box is in the barn. Where is the cup? It is in the barn."
    assert [(a.word, a.k) for a in solve(good)] == [("barn", 2)]
    with pytest.raises(SolveError):
        solve(good.replace("It is in the barn", "It is in the attic"))
    swaps = ("Ann has the red ball. Bob has the blue ball. Cara has the green ball. Ann and Bob swap balls. "
             "Bob and Cara swap balls. Which ball does Cara have now? It is the red ball.")
    assert [(a.word, a.k) for a in solve(swaps)] == [("red", 3)]  # Cara <- Bob <- Ann: two swaps + the start
    hops = "Letters: a b c a d c . Jump 2 times from the last letter: d."
    # c (pos 5) -> after the c at 2: a (pos 3) -> after the a at 0: b (pos 1)
    assert _hop_path(["a", "b", "c", "a", "d", "c"], 2) == 1
    with pytest.raises(SolveError):
        solve(hops)
    assert [(a.word, a.k) for a in solve(hops.replace(": d.", ": b."))] == [("b", 2)]


def test_hops_answers_differ_at_every_shorter_jump_count():
    cfg = DepthTaskConfig(docs=30, families=("hops",), max_k=10, repeat_share=0.0)
    for i in range(cfg.docs):
        text, _ = generate_document(cfg, i)
        for m in re.finditer(r"Letters: ((?:\w )+)\. Jump (\d+) times", text):
            seq, k = m.group(1).split(), int(m.group(2))
            path = [seq[_hop_path(seq, j)] for j in range(k + 1)]
            assert len(set(path)) == k + 1


def test_config_is_checked():
    for bad in (DepthTaskConfig(docs=1), DepthTaskConfig(min_k=0), DepthTaskConfig(min_k=5, max_k=4),
                DepthTaskConfig(max_k=16), DepthTaskConfig(families=("riddles",)), DepthTaskConfig(problems=0),
                DepthTaskConfig(repeat_share=1.5), DepthTaskConfig(families=(), repeat_share=0.5)):
        with pytest.raises(DrcError):
            bad.validate()


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed") / "corpus"
    spec = SourceSpec(name="sotu+depth-tasks", max_docs=2, tasks=DepthTaskConfig(docs=200, problems=3))
    prepare(PrepareConfig(source=spec, out=str(out), vocab_size=1024, seq_len=64), progress=False)
    return Corpus.open(out)


def test_prepared_labels_sit_on_the_answer_tokens(mixed_corpus):
    labels = read_labels(mixed_corpus.path)
    tok = mixed_corpus.tokenizer()
    assert set(labels.split) == {"train", "val"}
    for split in ("train", "val"):
        ids = mixed_corpus.tokens(split)
        lab = labels[labels.split == split]
        docs = mixed_corpus.docs[mixed_corpus.docs.split == split].set_index("doc_id")
        for r in lab.itertuples():
            assert tok.decode([int(ids[r.token])]) == " " + r.answer
            assert r.token == docs.loc[r.doc_id, "tok_start"] + r.pos
    # every answer the solver finds in the documents' texts is labelled
    tasks = DepthTaskConfig(docs=200, problems=3)
    assert len(labels) == sum(len(solve(generate_document(tasks, i)[0])) for i in range(tasks.docs))


def test_a_corpus_without_tasks_has_no_labels(tmp_path):
    with pytest.raises(DrcError, match="depth-tasks"):
        read_labels(tmp_path)


def test_an_answer_split_over_tokens_is_refused():
    class Enc:  # an encoding that cuts the answer "barn" in two
        offsets: list[tuple[int, int]] = []

    text = "The cup is in the barn. Where is the cup? It is in the barn."
    Enc.offsets = [(0, len(text) - 4), (len(text) - 4, len(text) - 2), (len(text) - 2, len(text))]
    with pytest.raises(DrcError, match="not one token"):
        token_labels(text, Enc())


def test_answer_measurements_read_the_answer_rows(mixed_corpus, one_thread):
    tw = dt.corpus_task_windows(mixed_corpus, 64, n_docs=4, split="train")
    ids = tw.windows
    rows = tw.answers
    assert len(rows) > 0
    assert (ids[rows.window.to_numpy(), rows.pos.to_numpy() + 1].numpy().copy()
            == [mixed_corpus.tokenizer().token_to_id("Ġ" + a) for a in rows.answer]).all()
    torch.manual_seed(0)
    model = DepthRecurrentLM(ModelConfig(vocab_size=mixed_corpus.vocab_size, d_model=32, n_heads=2, n_prelude=1,
                                         n_core=1, n_coda=1, max_seq_len=64)).eval()
    traj = dt.answer_trajectories(model, tw, 6)
    assert len(traj) == len(rows) and traj.max_loops == 6
    acc = dt.accuracy_by_k(traj, n_boot=50)
    assert ((acc.acc >= 0) & (acc.acc <= 1)).all() and set(acc.loop) == set(range(1, 7))
    depths = dt.answer_depths(traj)
    assert ((depths.commit >= 1) & (depths.commit <= 6)).all()
    # commit: the argmax from that loop on equals the final one, and the loop before differs (when > 1)
    arg = traj.stats["argmax"]
    for i, c in enumerate(depths.commit):
        assert (arg[i, c - 1 :] == arg[i, -1]).all()
        if c > 1:
            assert arg[i, c - 2] != arg[i, -1]
    # exits by k: read from one offline pass, the answers' exits of each k and every token's
    specs = [RuleSpec("kl", 1e-2, KLThreshold(1e-2, max_loops=6)), RuleSpec("never", 6, Never(max_loops=6))]
    passed = offline_pass(model, tw.windows, specs, reference_loops=4)
    exits = dt.exits_by_k(passed, tw, specs, oracle_eps=(1e-3,), n_boot=50)
    never = exits[exits.rule == str(specs[1].rule)]
    assert set(never.k) == {*map(int, rows.k.unique()), "all tokens"} and (never.exit == 6).all()
    ex = passed.token_exits()[str(specs[0].rule)]
    k1 = exits[(exits.rule == str(specs[0].rule)) & (exits.k == int(rows.k.min()))].exit.iloc[0]
    sel = rows[rows.k == rows.k.min()]
    assert k1 == pytest.approx(ex[sel.window.to_numpy(), sel.pos.to_numpy()].mean())
    with pytest.raises(DrcError, match="did not replay"):
        dt.exits_by_k(passed, tw, [RuleSpec("kl", 0.5, KLThreshold(0.5, max_loops=6))])


@pytest.mark.parametrize(("max_loops", "one_pass"), [(8, True), (8, False), (3, True)])
def test_task_passes_equal_the_two_separate_passes_bit_for_bit(mixed_corpus, one_thread, monkeypatch, max_loops,
                                                               one_pass):
    # one run of the core loops for the answer trajectories and the offline pass: the same bits as each alone, with
    # every loop's log-probs kept (one pass) or the deepest / reference output from a first pass, the measurement
    # deeper or shallower than the rules, over several batches
    import drc_core.analysis.measure as measure_mod
    import drc_core.halting.sweep as sweep_mod
    from drc_core.halting.sweep import default_rules

    if not one_pass:
        monkeypatch.setattr(measure_mod, "ONE_PASS_BYTES", 0)
        monkeypatch.setattr(sweep_mod, "ONE_PASS_BYTES", 0)
    tw = dt.corpus_task_windows(mixed_corpus, 64, n_docs=7, split="train")
    torch.manual_seed(0)
    model = DepthRecurrentLM(ModelConfig(vocab_size=mixed_corpus.vocab_size, d_model=32, n_heads=2, n_prelude=1,
                                         n_core=1, n_coda=1, max_seq_len=64)).eval()
    with torch.no_grad():
        for w in model.core.parameters():
            w.mul_(3.0)  # outputs keep moving, so that the rules exit at different loops
    specs = default_rules(6)
    passed, traj = dt.task_passes(model, tw, specs, max_loops, 4, batch_size=3)
    alone_traj = dt.answer_trajectories(model, tw, max_loops, batch_size=3)
    alone = offline_pass(model, tw.windows, specs, reference_loops=4, batch_size=3)
    assert list(traj.stats) == list(alone_traj.stats)
    for name, values in alone_traj.stats.items():
        assert traj.stats[name].dtype == values.dtype
        np.testing.assert_array_equal(traj.stats[name], values)
    pd.testing.assert_frame_equal(traj.meta, alone_traj.meta)
    assert traj.attrs == alone_traj.attrs and len(traj) == len(tw.answers) and traj.max_loops == max_loops
    for field in ("ce", "kl_ref", "argmax"):
        assert torch.equal(getattr(passed, field), getattr(alone, field)), field
    assert list(passed.exits) == list(alone.exits)
    assert all(torch.equal(passed.exits[k], alone.exits[k]) for k in alone.exits)
    assert len({tuple(ex.unique().tolist()) for ex in alone.exits.values()}) > 3  # rules that exit differently
    assert (passed.specs, passed.reference_loops, passed.batch_size) == (alone.specs, 4, 3)
    # the sweep takes the shared pass for its set, and refuses one of other rules
    sets = {"task": (tw.windows, np.arange(len(tw.windows)), np.arange(len(tw.windows)))}
    kw = {"reference_loops": 4, "ce_tolerance": 0.01}
    given = dt.sweep_window_sets(model, sets, specs, passed={"task": passed}, **kw)
    assert given[0]["task"] is passed
    pd.testing.assert_frame_equal(given[2]["task"], dt.sweep_window_sets(model, sets, specs, **kw)[2]["task"])
    with pytest.raises(DrcError, match="not the pass of these windows"):
        dt.sweep_window_sets(model, sets, specs[:2], passed={"task": passed}, **kw)


def test_overthinking_and_commit_on_a_made_up_trajectory():
    # one answer, 4 loops: wrong, right, wrong, right -> overthinks; commits at loop 4
    frame = pd.DataFrame({"window": 0, "pos": 0, "loop": [1, 2, 3, 4], "k": 2, "family": "swaps", "doc": "d",
                          "argmax": [5, 7, 5, 7], "target": 7, "kl": [np.nan, 1.0, 1.0, 1.0]})
    d = dt.answer_depths(Measurement.from_frame(frame, stats=["argmax", "kl"]))
    assert d.overthinks.item() and d.commit.item() == 4 and d.first_correct.item() == 2
    assert d.correct_final.item()


def test_spearman_interval_brackets_a_clear_correlation():
    rng = np.random.default_rng(0)
    x = rng.integers(1, 7, size=300)
    y = x + rng.normal(0, 1, size=300)
    p, lo, hi = dt.spearman_ci(x, y, np.arange(300) // 3, n_boot=200)
    assert lo < p < hi and lo > 0.6


def test_resampled_spearman_equals_scipy_on_each_resample_built_out():
    # ties in both variables, pairs drawn 0..3 times, and one resample constant in x (no correlation)
    from scipy import stats as sps
    rng = np.random.default_rng(3)
    x, y = rng.integers(1, 4, size=40).astype(float), rng.integers(1, 9, size=40).astype(float)
    draws = rng.integers(0, 4, size=(6, 40)).astype(float)
    draws[5] = 0
    draws[5, x == 2] = 2
    got = dt._resampled_spearman(x, y, draws)
    want = [sps.spearmanr(np.repeat(x, d.astype(int)), np.repeat(y, d.astype(int))).statistic for d in draws[:5]]
    np.testing.assert_allclose(got[:5], want, rtol=0, atol=1e-12)
    assert np.isnan(got[5])


def test_depth_growth_tells_linear_from_logarithmic():
    acc = pd.DataFrame([{"k": k, "loop": lp, "acc": float(lp >= k + 1)} for k in range(1, 9) for lp in range(1, 12)])
    g = dt.depth_growth(acc)
    assert g.loops_needed.tolist() == [k + 1 for k in range(1, 9)]
    assert g.attrs["r2_linear"] > g.attrs["r2_log"]
    acc2 = acc.assign(acc=[float(lp >= 1 + np.ceil(np.log2(k))) for k in range(1, 9) for lp in range(1, 12)])
    g2 = dt.depth_growth(acc2)
    assert g2.attrs["r2_log"] > g2.attrs["r2_linear"]


def test_answer_weights_sit_on_the_targets_that_are_answers(mixed_corpus):
    from drc_core.data.sampler import WindowSampler
    from drc_core.training.train import answer_weights

    assert answer_weights(mixed_corpus, 1.0) is None
    w = answer_weights(mixed_corpus, 7.0)
    labels = read_labels(mixed_corpus.path, "train")
    assert (w == 7.0).sum() == len(labels) and set(np.unique(w)) == {1.0, 7.0}
    tokens = mixed_corpus.tokens("train")
    sampler = WindowSampler(tokens, 64, 8, seed=3)
    x, y = sampler.batch(5)
    tw = sampler.target_weights(5, w)
    answer_ids = {int(tokens[t]) for t in labels.token}
    assert tw.shape == y.shape and (tw == 7.0).any()
    assert all(int(t) in answer_ids for t in y[tw == 7.0])


def test_weighted_loss_is_the_weighted_mean_of_token_losses():
    from drc_core.training.train import weighted_loss

    torch.manual_seed(0)
    logits, y = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    w = torch.ones(2, 5)
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    assert torch.allclose(weighted_loss(logits, y, w), plain)
    w[0, 2] = 10.0
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    assert torch.allclose(weighted_loss(logits, y, w), (ce * w.flatten()).sum() / w.sum())


def test_training_with_answer_weights_runs(mixed_corpus, tmp_path, one_thread):
    from drc_core.training.config import apply_overrides, preset
    from drc_core.training.train import train

    cfg = apply_overrides(preset("tiny"), [f"model.vocab_size={mixed_corpus.vocab_size}", "max_steps=3",
                                           "eval_every=3", "ckpt_every=3", "answer_weight=10"])
    train(cfg, mixed_corpus.path, tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_repeats_are_said_twice_and_carry_no_label():
    cfg = DepthTaskConfig(docs=20, families=(), repeat_share=1.0)
    for i in range(cfg.docs):
        text, problems = generate_document(cfg, i)
        assert solve(text) == [] and all(p.answers == [] for p in problems)
        for par in text.split("\n\n"):
            first, second = re.fullmatch(r"Repeat: (.*) \. Again: (.*) \.", par).groups()
            assert first == second and 8 <= len(first.split()) <= 24


def test_copy_accuracy_reads_the_second_saying(mixed_corpus, monkeypatch, one_thread):
    torch.manual_seed(0)
    model = DepthRecurrentLM(ModelConfig(vocab_size=mixed_corpus.vocab_size, d_model=32, n_heads=2, n_prelude=1,
                                         n_core=1, n_coda=1, max_seq_len=128)).eval()
    table = dt.copy_accuracy(model, mixed_corpus.tokenizer(), [1, 2], docs=4, max_len=128)
    assert table.loop.tolist() == [1, 2] and ((table.copy_acc >= 0) & (table.copy_acc <= 1)).all()
    assert (table.n == 4).all()
    seeds: list[tuple[int, int]] = []

    def oracle(_model, x, loops, generator):  # the true next token everywhere it is known
        seeds.append((loops, generator.initial_seed()))
        out = torch.zeros(1, x.shape[1], mixed_corpus.vocab_size)
        out[0, torch.arange(x.shape[1] - 1), x[0, 1:]] = 1.0
        return out

    monkeypatch.setattr(dt, "logits_at", oracle)
    perfect = dt.copy_accuracy(model, mixed_corpus.tokenizer(), [1, 3], docs=6, max_len=128, seed=5)
    assert (perfect.copy_acc == 1.0).all()  # the span is exactly the repeated words, each scored once
    # paragraph i starts from the state seeded with seed + i at every loop count, not from the global RNG
    assert seeds == [(lp, 5 + i) for i in range(6) for lp in (1, 3)]


def test_labels_of_an_older_rule_are_refused_and_prepared_again(tmp_path, one_thread):
    """A label table without the current rule's version (written before answered questions counted) is refused
    with one line; preparing the same corpus again rewrites it (same tokens) instead of calling it up to date."""
    spec = SourceSpec(name="depth-tasks", tasks=DepthTaskConfig(docs=30, families=("links",), min_k=3, max_k=3,
                                                                   ask_every=True, repeat_share=0.0))
    cfg = PrepareConfig(source=spec, out=str(tmp_path / "c"), vocab_size=512, seq_len=64)
    prepare(cfg, progress=False)
    path = tmp_path / "c" / "labels.parquet"
    tokens = (tmp_path / "c" / "train.bin").read_bytes()
    fresh = read_labels(tmp_path / "c")
    fresh.to_parquet(path, index=False)  # as version 1 wrote it: no version recorded
    with pytest.raises(DrcError, match="older rule"):
        read_labels(tmp_path / "c")
    assert not prepare(cfg, progress=False).cached
    pd.testing.assert_frame_equal(read_labels(tmp_path / "c"), fresh)
    assert (tmp_path / "c" / "train.bin").read_bytes() == tokens
    assert prepare(cfg, progress=False).cached


def test_a_small_vocabulary_leaves_split_answers_out_and_counts_them(tmp_path, one_thread):
    spec = SourceSpec(name="sotu+depth-tasks", max_docs=3, tasks=DepthTaskConfig(docs=40, problems=3))
    res = prepare(PrepareConfig(source=spec, out=str(tmp_path / "c"), vocab_size=300, seq_len=64), progress=False)
    counts = res.meta["depth_task_answers"]
    found = sum(len(solve(generate_document(spec.tasks, i)[0])) for i in range(spec.tasks.docs))
    assert sum(counts["labelled"].values()) + sum(counts["split_answers"].values()) == found
    assert sum(counts["split_answers"].values()) > 0  # 300 symbols cannot hold every answer word whole


def test_prepare_cli_takes_the_task_options(tmp_path, capsys):
    """``--task-min-k/--task-max-k/--task-families/--task-ask-every`` reach the generator: links chains of exactly
    three, every object asked (k = 1..3 labelled); an empty k range is one line and exit 2."""
    from drc_core.data.__main__ import main
    from drc_core.errors import run_cli

    out = tmp_path / "c"
    argv = ["prepare", "--source", "depth-tasks", "--task-docs", "30", "--task-min-k", "3", "--task-max-k", "3",
            "--task-families", "links", "--task-ask-every", "--task-repeat-share", "0", "--vocab-size", "512",
            "--seq-len", "64", "--out", str(out), "--quiet"]
    assert run_cli(main, argv) == 0
    labels = read_labels(out)
    assert set(labels.k) == {1, 2, 3} and set(labels.family) == {"links"}
    assert (labels.k.value_counts() >= 30).all()  # three asked chains per problem, each asked at every object
    counts = labels.k.value_counts()
    assert counts[3] < counts[1]  # shuffled: some three-link questions follow the answer two links down
    deep = tmp_path / "deep"
    assert run_cli(main, [*argv[:-2], str(deep), "--quiet", "--task-ask-order", "deepest-first"]) == 0
    counts = read_labels(deep).k.value_counts()
    assert counts[1] == counts[2] == counts[3]  # no shortcut: each chain asked with k = 3, 2, 1
    bad = argv[:-3] + ["--task-min-k", "4", "--out", str(tmp_path / "d"), "--quiet"]
    assert run_cli(main, bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4..3" in err[0]


def test_depth_law_tells_linear_from_logarithmic_with_intervals():
    rng = np.random.default_rng(0)
    k = np.repeat(np.arange(1, 9), 60)
    doc = np.arange(len(k)) % 40
    lin = pd.DataFrame({"k": k, "doc": doc, "depth": 2.0 * k + rng.normal(0, 0.5, len(k))})
    law = dt.depth_law(lin, n_boot=200).set_index("law")
    assert law.loc["linear", "r2"] > law.loc["log", "r2"] and law.loc["linear", "r2_lo"] > 0.9
    assert law.loc["linear", "slope_lo"] < 2.0 < law.loc["linear", "slope_hi"]
    log = lin.assign(depth=3.0 * np.log2(k) + rng.normal(0, 0.3, len(k)))
    law = dt.depth_law(log, n_boot=200).set_index("law")
    assert law.loc["log", "r2"] > law.loc["linear", "r2"]
    with pytest.raises(DrcError, match="at least 3 values of k"):
        dt.depth_law(lin[lin.k <= 2])


def test_halting_against_overthinking_on_made_up_trajectories():
    # 40 documents x 2 answers, 6 loops; answer 0 (k = 1) is right from loop 2 on and its output settles at loop 3;
    # answer 1 (k = 5) is right at loops 3-4 only (overthought) and settles at loop 4
    rows = []
    for d in range(40):
        for a, (k, right, kl) in enumerate([(1, [0, 1, 1, 1, 1, 1], [np.nan, 1, 1e-4, 0, 0, 0]),
                                            (5, [0, 0, 1, 1, 0, 0], [np.nan, 1, 1, 1e-4, 1, 1])]):
            for lp in range(6):
                rows.append({"window": d, "pos": a, "loop": lp + 1, "k": k, "doc": f"d{d}", "target": 7,
                             "argmax": 7 if right[lp] else 3, "kl": kl[lp]})
    m = Measurement.from_frame(pd.DataFrame(rows), stats=["argmax", "kl"])
    out = dt.halting_against_overthinking(m, reference_loops=4, eps=1e-3, alpha=0.1, delta=0.1, trained_k=4,
                                          n_boot=100).set_index(["way", "group"])
    assert out.loc[("fixed 6", "k > 4"), "acc"] == 0 and out.loc[("fixed 6", "k > 4"), "overthought"] == 1
    assert out.loc[("kl(0.001)", "k > 4"), "acc"] == 1 and out.loc[("kl(0.001)", "k > 4"), "recovered"] == 1
    assert out.loc[("kl(0.001)", "k <= 4"), "mean_exit"] == 3 and out.loc[("kl(0.001)", "k > 4"), "mean_exit"] == 4
    assert out.loc[("oracle (first right loop)", "all"), "acc"] == 1
    assert out.attrs["calibration_documents"] + out.attrs["test_documents"] == 40


@pytest.mark.parametrize("family", ["links", "hops"])
def test_lever_study_reads_a_family_at_twice_its_trained_k(family, one_thread):
    """The study of a shipped model on fresh problems of one family, k = 1..2 trained_k, and its row of the law
    table: each family's fits of convergence depth and loops needed against k and log2 k."""
    from pathlib import Path

    study = dt.lever_study(str(Path(__file__).resolve().parents[1] / "data" / "known-depth-k4"), trained_k=2,
                           docs=4, max_loops=8, eps=1e-3, alpha=0.2, delta=0.1, family=family)
    assert study["family"] == family and set(study["accuracy"].k) <= {1, 2, 3, 4}
    assert study["best"].beyond.tolist() == [k > 2 for k in study["best"].k]
    assert set(study["loops_needed"].k) == set(study["accuracy"].k)
    cells = study["cells"]
    if family == "links":  # every question of a chain asked: a cell per (chain length, position), k within it
        assert len(cells) and (cells.k_max <= cells.chain).all() and (cells.turn < cells.chain).all()
        assert cells.n.sum() == study["n_answers"]
    else:
        assert cells.empty
    assert set(study["trained_range"]["accuracy_at_depth"]) <= {1, 2}
    table = dt.law_table({"links": None, family: study})
    assert table.family.tolist() == [family, family] and table.law.tolist() == ["linear", "log"]
    assert ((table.r2 >= 0) & (table.r2 <= 1)).all()
    # the savings' answer accuracy, from the offline pass, equals the trajectories' (another readout of the same
    # core loops): at uniform depth R the argmax at loop R; at the oracle's exit the argmax at that loop
    saved = study["savings"].set_index("family")
    assert {"oracle", "kl"} <= set(saved.index) and (saved.saved_frac <= 1).all()  # negative: more loops
    traj_right = study["accuracy"].set_index(["k", "loop"])
    n_k = study["accuracy"].groupby("k").n.first()
    at_r = sum(traj_right.loc[(k, 8), "acc"] * n for k, n in n_k.items()) / n_k.sum()  # R = 8 for this model
    assert saved.answer_acc_uniform.iloc[0] == pytest.approx(at_r)
    assert saved.acc_lost.to_numpy() == pytest.approx(100 * (saved.answer_acc_uniform - saved.answer_acc).to_numpy(),
                                                      nan_ok=True)
    with pytest.raises(DrcError, match="raise max_loops"):
        dt.lever_study(str(Path(__file__).resolve().parents[1] / "data" / "known-depth-k4"), trained_k=2, docs=1,
                       max_loops=4, eps=1e-3, alpha=0.2, delta=0.1, family=family)


def test_the_solver_names_each_question_s_chain_and_position():
    """``chain`` counts the links of the asked object's whole chain, ``turn`` the earlier questions about it."""
    text = "Links: fan trunk . trunk book . book hall . cup barn . ? book hall . ? cup barn . ? fan hall ."
    got = [(a.word, a.k, a.chain, a.turn) for a in solve(text)]
    assert got == [("hall", 1, 3, 0), ("barn", 1, 1, 0), ("hall", 3, 3, 1)]
    prose = "The cup is in the box. The box is in the barn. Where is the box? It is in the barn."
    assert [(a.chain, a.turn) for a in solve(prose)] == [(2, 0)]


def test_lever_records_judge_extrapolation_from_the_recorded_probe(tmp_path):
    """Each lever's shipped record: best accuracy per k, the best above the training mean, and the targets (80% at
    K + 1 and 50% at K + 2 above it while rising; Spearman 0.7), checked against a record written here."""
    import json

    def probe(acc5: dict[int, float], acc6: dict[int, float], rho: float) -> dict:
        per_k = {}
        for k, by_loop in ((1, {4: 1.0, 8: 1.0, 16: 1.0}), (2, {4: 0.9, 8: 0.95, 16: 0.95}), (5, acc5), (6, acc6)):
            best = max(by_loop, key=by_loop.get)
            per_k[str(k)] = {"answers": 10, "acc_by_loop": {str(lp): a for lp, a in by_loop.items()},
                             "best_loop": best, "best_acc": by_loop[best], "best_ci": [by_loop[best] - 0.1, 1.0],
                             "mean_depth": float(k), "overthought": 0.0}
        return {"extrapolation_probe": {"this model": {"trained_k": 4, "spearman_depth": [rho, rho - 0.1, rho + 0.1],
                                                       "per_k": per_k}}}

    good, flat = tmp_path / "good", tmp_path / "flat"
    for path, record in ((good, probe({4: 0.3, 8: 0.6, 16: 0.85}, {8: 0.2, 16: 0.55}, 0.8)),
                         (flat, probe({4: 0.9, 8: 0.9, 16: 0.9}, {8: 0.6, 16: 0.4}, 0.5))):
        path.mkdir()
        (path / "source.json").write_text(json.dumps(record))
    table, targets = dt.lever_records({"good": good, "flat": flat}, 8)
    row = table.set_index(["lever", "k"]).loc[("good", 5)]
    assert row.beyond and row.best_above == 0.85 and row.loop_above == 16 and row.acc_at_8 == 0.6
    t = targets.set_index(["lever", "target"]).met
    assert t[("good", "k = 5: accuracy >= 0.8 above loop 8")] and t[("good", "k = 6: accuracy >= 0.5 above loop 8")]
    assert t[("good", "Spearman(k, depth) >= 0.7, k = 1..8")]
    # 0.9 at k = 5, but no higher than at loop 8: looping more did not help, so the target is not met
    assert not t[("flat", "k = 5: accuracy >= 0.8 above loop 8")]
    assert not t[("flat", "k = 6: accuracy >= 0.5 above loop 8")] and not t[("flat", "Spearman(k, depth) >= 0.7, "
                                                                                   "k = 1..8")]
    said = dt.lever_sentence(targets)
    assert "**good** meets 3 of 3" in said and "**flat** meets 0 of 3" in said and "+0.000 over" in said
    (flat / "source.json").write_text(json.dumps({"kind": "a model with no probe"}))
    with pytest.raises(DrcError, match="has no extrapolation probe of the model: run scripts/extrapolation_probe"):
        dt.lever_records({"flat": flat}, 8)


def test_extrapolation_probe_record_round_trips_through_lever_records(tmp_path, one_thread):
    """The probe record of real trajectories (the shipped lever model on a few generated chains of 1..4 links) is
    what lever_records reads: the same best accuracy per k, and the KL rule's replay stops where the KL first falls
    below eps (else at the last loop)."""
    import json
    from pathlib import Path

    from drc_core import DepthTaskConfig, eot_id, load

    lm = load(str(Path(__file__).resolve().parents[1] / "data" / "known-depth-k4"))
    tasks = DepthTaskConfig(docs=3, min_k=1, max_k=4, families=("links",), ask_every=True, ask_order="shuffled",
                            seed=5, repeat_share=0.0)
    tw = dt.generated_task_windows(lm.tokenizer, tasks, lm.model.max_seq_len, pad_id=eot_id(lm.tokenizer))
    traj = dt.answer_trajectories(lm.model, tw, 8)
    probe = dt.extrapolation_probe(traj, [1, 2, 4, 8], 1e-3, n_boot=20)
    # accuracy at chosen loops only: the same rows as every loop's table filtered to them
    every, some = dt.accuracy_by_k(traj, n_boot=20), dt.accuracy_by_k(traj, n_boot=20, loops=[8, 1, 4, 2])
    pd.testing.assert_frame_equal(some, every[every.loop.isin([1, 2, 4, 8])].reset_index(drop=True))
    table = probe.pop("table")
    assert list(table.columns) == [1, 2, 4, 8] and set(probe["per_k"]) == set(tw.answers.k)
    kl = np.nan_to_num(traj.matrix("kl"), nan=np.inf)
    for k, r in probe["per_k"].items():
        rows = np.flatnonzero(traj.meta.k.to_numpy() == k)
        stops = [int(np.argmax(kl[i] < 1e-3)) + 1 if (kl[i] < 1e-3).any() else 8 for i in rows]
        assert r["kl_rule"]["mean_exit"] == pytest.approx(np.mean(stops)) and r["answers"] == len(rows)
        assert r["best_acc"] == max(r["acc_by_loop"].values()) == table.loc[k].max()
    (tmp_path / "source.json").write_text(json.dumps({"extrapolation_probe": {"this model": {
        "trained_k": 2, **probe}}}))
    levers, _ = dt.lever_records({"here": tmp_path}, 4)
    assert levers.set_index("k").best_acc.to_dict() == {k: r["best_acc"] for k, r in probe["per_k"].items()}

"""Documents whose answer tokens need a known number ``k`` of sequential lookups (the ``depth-tasks`` source).

A document is a few problems (paragraphs), each of a labelled family: ``containers`` (``The lamp is in the box. ...
Where is the lamp? It is in the garden.``: a reference chain, ``k`` links), ``links`` (the same chains in compact
notation), ``swaps`` (``Ann and Bob swap balls. ... Which ball does Ann have now?``: ``k = 1 +`` the swaps on the
asked person's path) or ``hops`` (p-hop induction, arXiv 2502.17416: the letter after ``k`` jumps); or an unlabelled
``repeats`` paragraph (a random word sequence said twice: the in-context copying every lookup builds on). Every
answer is one word the byte-level BPE keeps as one token. A label is the fewest lookups that reach the answer from
the text before its question (an answered question is a shortcut for later ones), computed by :func:`solve` from the
text alone; :func:`generate_problem` records its own ``k`` and the tests check that the two agree. All randomness is
a pure function of ``(seed, document index)``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from drc_core.errors import MAX_SEED, MAX_TASK_DOCS, MAX_TASK_PROBLEMS, DrcError

FAMILIES = ("containers", "swaps", "hops", "links")  # the labelled families
DEFAULT_FAMILIES = ("containers", "swaps", "hops")
REPEATS = "repeats"  # unlabelled in-context copying
SOURCE_NAME = "depth-tasks"

OBJECTS = (
    "lamp", "box", "key", "bag", "cup", "book", "coin", "ring", "shoe", "hat", "coat", "pen", "card", "bowl", "jar",
    "map", "clock", "bell", "rope", "basket", "bottle", "letter", "brush", "comb", "drum", "flag", "glove", "knife",
    "ladder", "mirror", "needle", "pillow", "plate", "purse", "shell", "spoon", "stone", "table", "towel", "trunk",
    "vase", "wallet", "watch", "wheel", "whistle", "candle", "chair", "blanket", "bucket", "button", "camera",
    "carpet", "crown", "desk", "doll", "egg", "fan", "fork", "hammer", "helmet", "jacket", "kettle", "lock", "mask",
    "medal", "nail", "net", "paper", "pipe", "pot", "radio", "ribbon", "saddle", "scarf", "shirt", "sock", "stamp",
    "sword", "ticket", "toy", "tray", "umbrella", "violin", "wire",
)
PLACES = (
    "garden", "kitchen", "attic", "cellar", "barn", "office", "library", "hall", "shed", "garage", "church",
    "school", "market", "station", "harbor", "forest", "tower", "bridge", "castle", "museum",
)
PEOPLE = (
    "Ann", "Bob", "Cara", "Dan", "Eve", "Fred", "Grace", "Hugo", "Ida", "Jack", "Kate", "Leo", "Mia", "Ned", "Olga",
    "Paul", "Rose", "Sam", "Tina", "Victor", "Will", "Zoe", "Alice", "Ben", "Clara", "David", "Emma", "Frank",
    "Helen", "Henry",
)
COLOURS = ("red", "blue", "green", "yellow", "white", "black", "brown", "pink")
LETTERS = tuple("abcdefghijklmnop")  # 16: a path of k <= 15 jumps meets k + 1 distinct letters


# fields added to DepthTaskConfig after corpora were prepared with it, and their defaults: left out of a corpus's
# fingerprint at the default, so that a corpus prepared before they existed still matches
TASK_FIELDS_ADDED_LATER = {"ask_every": False, "ask_order": "shuffled"}
ASK_ORDERS = ("shuffled", "deepest-first")


@dataclass(frozen=True)
class DepthTaskConfig:
    """What the ``depth-tasks`` source generates: ``docs`` documents of ``problems`` problems, each a ``repeats``
    paragraph with probability ``repeat_share``, else of one of ``families`` with ``k`` uniform in ``min_k..max_k``.
    ``ask_every``: ask about every object of each asked chain, not only its first; ``ask_order`` (with it):
    ``shuffled`` (a question after one about an object further down its chain needs fewer lookups) or
    ``deepest-first`` (each chain's objects from first to last: ``k = n, n-1, .., 1``, no shortcut)."""

    docs: int = 20_000
    min_k: int = 1
    max_k: int = 6
    problems: int = 4
    families: tuple[str, ...] = DEFAULT_FAMILIES
    repeat_share: float = 0.5
    seed: int = 0
    ask_every: bool = False
    ask_order: str = "shuffled"

    def validate(self) -> None:
        for name in ("docs", "min_k", "max_k", "problems", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise DrcError(f"depth-tasks {name}={v!r} must be an integer")
        if isinstance(self.repeat_share, bool) or not isinstance(self.repeat_share, int | float) or not (
                0 <= self.repeat_share <= 1):
            raise DrcError(f"depth-tasks repeat_share={self.repeat_share!r} must be a number in [0, 1]: e.g. 0.5")
        if not isinstance(self.families, tuple | list) or not all(isinstance(f, str) for f in self.families):
            raise DrcError(f"depth-tasks families={self.families!r} must be a list of family names")
        if self.docs > MAX_TASK_DOCS:
            raise DrcError(f"depth-tasks docs={self.docs:,} is above the limit of {MAX_TASK_DOCS:,} documents (they "
                           "are generated in memory): use at most that many")
        if self.problems > MAX_TASK_PROBLEMS:
            raise DrcError(f"depth-tasks problems={self.problems} is above the limit of {MAX_TASK_PROBLEMS} per "
                           "document: use at most that many")
        if self.seed > MAX_SEED:
            raise DrcError(f"depth-tasks seed={self.seed} is above the largest seed {MAX_SEED} (2**63 - 1)")
        if self.docs < 2:
            raise DrcError(f"depth-tasks docs={self.docs} must be >= 2 (a train and a val document): e.g. 12000")
        if not 1 <= self.min_k <= self.max_k <= 15:
            raise DrcError(f"depth-tasks k range {self.min_k}..{self.max_k} must satisfy 1 <= min_k <= max_k <= 15")
        if self.problems < 1:
            raise DrcError(f"depth-tasks problems={self.problems} must be >= 1 per document")
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown or not (self.families or self.repeat_share == 1):
            raise DrcError(f"depth-tasks families {list(self.families)} must be a subset of {', '.join(FAMILIES)} "
                           "(empty only with repeat_share=1)")
        if self.seed < 0:
            raise DrcError(f"depth-tasks seed={self.seed} must be >= 0")
        if not isinstance(self.ask_every, bool):
            raise DrcError(f"depth-tasks ask_every={self.ask_every!r} must be True or False")
        if self.ask_order not in ASK_ORDERS:
            raise DrcError(f"depth-tasks ask_order '{self.ask_order}' must be one of {', '.join(ASK_ORDERS)}")


@dataclass(frozen=True)
class Answer:
    """One labelled answer: the answer word at ``start:end`` of the text, the family and its lookups ``k``."""

    start: int
    end: int
    word: str
    family: str
    k: int
    problem: int  # index of the problem (paragraph) in its document
    chain: int = 0  # chain families: the links of the asked object's whole chain (0 in the other families)
    turn: int = 0  # chain families: how many questions about the same chain came before this one


@dataclass
class Problem:
    text: str
    family: str
    answers: list[tuple[str, int]] = field(default_factory=list)  # (word, k) in text order: generator's record


# ------------------------------------------------------------------------------------------------ generation


def _containers(rng: np.random.Generator, ks: list[int], objects: list[str], family: str = "containers",
                ask_every: bool = False, ask_order: str = "shuffled") -> Problem:
    """One chain per requested k plus a distractor chain, shuffled statements, one question per chain; in prose
    (``containers``) or as ``links`` (``Links: cup box . box barn . ? cup barn .``: one hop, one induction lookup)."""
    lengths = list(ks) + [int(rng.integers(1, max(ks) + 1))]
    places = rng.choice(len(PLACES), size=len(lengths), replace=True)
    statements, chains = [], []
    for length, p in zip(lengths, places, strict=True):
        chain = [objects.pop() for _ in range(length)]  # chain[0] in chain[1] in ... in place
        links = chain + [PLACES[int(p)]]
        statements += [(links[i], links[i + 1]) for i in range(length)]
        chains.append(chain)
    order = rng.permutation(len(statements))
    said = "The {} is in the {}." if family == "containers" else "{} {} ."
    asked_as = " Where is the {0}? It is in the {1}." if family == "containers" else " ? {0} {1} ."
    text = ("" if family == "containers" else "Links: ") + " ".join(said.format(*statements[i]) for i in order)
    prob = Problem(text=text, family=family)
    asked = [(c, 0) for c in rng.permutation(len(ks))]  # the last chain is never asked: a distractor
    if ask_every:
        every = [(c, i) for c in range(len(ks)) for i in range(len(chains[c]))]
        asked = [every[int(j)] for j in rng.permutation(len(every))]
        if ask_order == "deepest-first":  # the same interleaving of chains, each chain's objects in chain order
            turns = {c: iter(range(len(chains[c]))) for c in range(len(ks))}
            asked = [(c, next(turns[c])) for c, _ in asked]
    answered: dict[int, list[int]] = {c: [] for c in range(len(ks))}
    for c, i in asked:
        chain, place = chains[c], PLACES[int(places[c])]
        prob.text += asked_as.format(chain[i], place)
        # the chain's statements, or down to an object asked before and then its answer
        prob.answers.append((place, min([len(chain) - i] + [j - i + 1 for j in answered[c] if j > i])))
        answered[c].append(i)
    return prob


def _swaps(rng: np.random.Generator, k: int, people: list[str]) -> Problem:
    """Three or four people with balls, then swaps; one question whose backward path crosses ``k - 1`` swaps (built
    backwards from the asked person)."""
    n = int(rng.integers(3, 5))
    names = people[-n:]
    del people[-n:]
    who = int(rng.integers(n))
    n_swaps = k - 1 + int(rng.integers(0, 4))
    relevant = set(int(i) for i in rng.choice(n_swaps, size=k - 1, replace=False)) if k > 1 else set()
    pairs: list[tuple[int, int]] = []
    cur = who
    for slot in reversed(range(n_swaps)):
        if slot in relevant:
            other = int(rng.choice([p for p in range(n) if p != cur]))
            pair, cur = (cur, other), other
        else:
            a, b = rng.choice([p for p in range(n) if p != cur], size=2, replace=False)
            pair = (int(a), int(b))
        pairs.append(pair if rng.random() < 0.5 else pair[::-1])
    pairs.reverse()
    colours = rng.choice(len(COLOURS), size=n, replace=False)
    holding = [COLOURS[int(c)] for c in colours]
    parts = [f"{names[i]} has the {holding[i]} ball." for i in rng.permutation(n)]
    for a, b in pairs:
        parts.append(f"{names[a]} and {names[b]} swap balls.")
        holding[a], holding[b] = holding[b], holding[a]
    parts.append(f"Which ball does {names[who]} have now? It is the {holding[who]} ball.")
    return Problem(text=" ".join(parts), family="swaps", answers=[(holding[who], k)])


def _hop_path(seq: list[str], jumps: int) -> int | None:
    """Position reached by ``jumps`` jumps from the last position, or None where a jump has nowhere to go."""
    pos = len(seq) - 1
    for _ in range(jumps):
        prev = [j for j in range(pos) if seq[j] == seq[pos]]
        if not prev:
            return None
        pos = prev[-1] + 1
    return pos


def _hops(rng: np.random.Generator, k: int) -> Problem:
    """A letter sequence in which ``k`` jumps from the last letter land on the answer, built from the path: distinct
    letters at jumps ``0..k`` (no shorter path), and no filler letter that breaks a jump."""
    letters = [LETTERS[int(i)] for i in rng.choice(len(LETTERS), size=k + 1, replace=False)]
    gaps = rng.integers(2, 6, size=k)
    first = 1 + int(rng.integers(0, 4))  # position of the answer
    path = [first + int(gaps[i:].sum()) for i in range(k)] + [first]  # path[0] = last position
    n = path[0] + 1
    seq: list[str | None] = [None] * n
    forbid: list[set[str]] = [set() for _ in range(n)]
    for i in range(k + 1):
        seq[path[i]] = letters[i]
    for i in range(k):
        seq[path[i + 1] - 1] = letters[i]
        for j in range(path[i + 1], path[i]):
            forbid[j].add(letters[i])
    for j in range(n):
        if seq[j] is None:
            allowed = [c for c in LETTERS if c not in forbid[j]]
            seq[j] = allowed[int(rng.integers(len(allowed)))]
    answer = seq[path[k]]
    text = f"Letters: {' '.join(seq)} . Jump {k} times from the last letter: {answer}."
    return Problem(text=text, family="hops", answers=[(str(answer), k)])


def _repeats(rng: np.random.Generator) -> Problem:
    """A random sequence of 8..24 words from every pool, said twice (no labels)."""
    pool = OBJECTS + PLACES + PEOPLE + COLOURS + LETTERS
    words = [pool[int(i)] for i in rng.integers(len(pool), size=int(rng.integers(8, 25)))]
    return Problem(text=f"Repeat: {' '.join(words)} . Again: {' '.join(words)} .", family=REPEATS)


def generate_problem(rng: np.random.Generator, family: str, cfg: DepthTaskConfig, objects: list[str],
                     people: list[str]) -> Problem:
    """One problem of ``family`` with its answers' k drawn uniformly from ``cfg.min_k..cfg.max_k``."""
    draw = lambda: int(rng.integers(cfg.min_k, cfg.max_k + 1))  # noqa: E731
    if family == REPEATS:
        return _repeats(rng)
    if family in ("containers", "links"):
        return _containers(rng, [draw() for _ in range(3)], objects, family, cfg.ask_every, cfg.ask_order)
    if family == "swaps":
        return _swaps(rng, draw(), people)
    return _hops(rng, draw())


def generate_document(cfg: DepthTaskConfig, index: int) -> tuple[str, list[Problem]]:
    """Document ``index``: ``cfg.problems`` problems joined by blank lines (names drawn without replacement)."""
    rng = np.random.default_rng([cfg.seed, index, 0x6B])
    objects: list[str] = []
    people: list[str] = []
    problems = []
    for _ in range(cfg.problems):
        family = REPEATS if rng.random() < cfg.repeat_share else cfg.families[int(rng.integers(len(cfg.families)))]
        if len(objects) < 4 * (cfg.max_k + 1) + cfg.max_k:
            objects = [OBJECTS[int(i)] for i in rng.permutation(len(OBJECTS))]
        if len(people) < 4:
            people = [PEOPLE[int(i)] for i in rng.permutation(len(PEOPLE))]
        problems.append(generate_problem(rng, family, cfg, objects, people))
    return "\n\n".join(p.text for p in problems), problems


def documents(cfg: DepthTaskConfig) -> list[dict[str, str]]:
    """Rows (``text``, ``source``, ``doc_id``) for :mod:`drc_core.data.sources`."""
    cfg.validate()
    return [{"text": generate_document(cfg, i)[0], "source": SOURCE_NAME, "doc_id": f"{SOURCE_NAME}:{i}"}
            for i in range(cfg.docs)]


# ---------------------------------------------------------------------------------------- independent solver

_CONTAIN = re.compile(r"The (\w+) is in the (\w+)\.")
_WHERE = re.compile(r"Where is the (\w+)\? It is in the (\w+)\.")
_HAS = re.compile(r"(\w+) has the (\w+) ball\.")
_SWAP = re.compile(r"(\w+) and (\w+) swap balls\.")
_WHICH = re.compile(r"Which ball does (\w+) have now\? It is the (\w+) ball\.")
_LINK = re.compile(r"(?<!\? )\b(\w+) (\w+) \.")  # not a question (``? a b .``), which reads like one
_LINK_Q = re.compile(r"\? (\w+) (\w+) \.")
_HOPS = re.compile(r"Letters: ((?:\w )+)\. Jump (\d+) times from the last letter: (\w+)\.")


class SolveError(ValueError):
    """The text states an answer that does not follow from what comes before it."""


def _follow(inside: dict[str, str], start: str, answered: dict[str, str]) -> tuple[str, int]:
    """Where the chain of containers from ``start`` ends, and the fewest lookups: along the statements, or down to an
    object an earlier question ``answered`` and then that answer."""
    cur, k, seen = start, 0, set()
    fewest = math.inf
    while True:
        if cur in answered:
            fewest = min(fewest, k + 1)
        if cur not in inside:
            break
        if cur in seen:
            raise SolveError(f"containment cycle at '{cur}'")
        seen.add(cur)
        cur, k = inside[cur], k + 1
    return cur, int(min(fewest, k))


def _cell(inside: dict[str, str], obj: str, asked: list[str]) -> tuple[int, int]:
    """``(chain, turn)`` of a question about ``obj``: the links of its whole chain (up to the place and down to the
    innermost object) and how many earlier questions (``asked``: their chains' innermost objects) hit that chain;
    the innermost object is appended to ``asked``."""
    below = {v: k for k, v in inside.items()}
    up, cur = 0, obj
    while cur in inside and up <= len(inside):
        cur, up = inside[cur], up + 1
    down, cur = 0, obj
    while cur in below and down <= len(inside):
        cur, down = below[cur], down + 1
    asked.append(cur)
    return up + down, asked.count(cur) - 1


def _solve_chains(par: str, statement: re.Pattern, question: re.Pattern) -> list[tuple[int, str, int, int, int]]:
    """``containers`` and ``links``: each question answered from the statements before it (a later one overriding an
    earlier one) and from what the questions before it say (checked against the statements when asked)."""
    out = []
    statements = list(statement.finditer(par))
    inside: dict[str, str] = {}
    answered: dict[str, str] = {}
    asked: list[str] = []
    j = 0
    for q in question.finditer(par):
        while j < len(statements) and statements[j].end() <= q.start():
            inside[statements[j].group(1)] = statements[j].group(2)
            j += 1
        out.append((q.start(2), *_follow(inside, q.group(1), answered), *_cell(inside, q.group(1), asked)))
        answered[q.group(1)] = q.group(2)
    return out


def _solve_swaps(par: str) -> list[tuple[int, str, int]]:
    out = []
    for q in _WHICH.finditer(par):
        before = par[: q.start()]
        # events in text order: ('has', name, colour) or ('swap', a, b)
        events = sorted([(m.start(), "has", m.group(1), m.group(2)) for m in _HAS.finditer(before)]
                        + [(m.start(), "swap", m.group(1), m.group(2)) for m in _SWAP.finditer(before)])
        cur, k = q.group(1), 1
        for _, kind, a, b in reversed(events):
            if kind == "swap" and cur in (a, b):
                cur, k = (b if cur == a else a), k + 1
            elif kind == "has" and a == cur:
                out.append((q.start(2), b, k))
                break
        else:
            raise SolveError(f"nobody is said to hold a ball for '{q.group(1)}'")
    return out


def _solve_hops(par: str) -> list[tuple[int, str, int]]:
    out = []
    for q in _HOPS.finditer(par):
        seq, jumps = q.group(1).split(), int(q.group(2))
        pos = _hop_path(seq, jumps)
        if pos is None:
            raise SolveError(f"{jumps} jumps leave the sequence")
        out.append((q.start(3), seq[pos], jumps))
    return out


_SOLVERS = {"containers": lambda par: _solve_chains(par, _CONTAIN, _WHERE), "swaps": _solve_swaps,
            "hops": _solve_hops, "links": lambda par: _solve_chains(par, _LINK, _LINK_Q)}


def solve(text: str) -> list[Answer]:
    """Every answer in ``text`` with its family and ``k``, recomputed from the statements before its question; a
    stated answer that differs is a :class:`SolveError`."""
    answers = []
    offset = 0
    for p_index, par in enumerate(text.split("\n\n")):
        for family, fn in _SOLVERS.items():
            for start, word, k, *cell in fn(par):
                stated = re.match(r"\w+", par[start:]).group(0)
                if stated != word:
                    raise SolveError(f"problem {p_index}: the text answers '{stated}', the statements give '{word}'")
                answers.append(Answer(offset + start, offset + start + len(word), word, family, k, p_index, *cell))
        offset += len(par) + 2
    return sorted(answers, key=lambda a: a.start)


# -------------------------------------------------------------------------------------------- token alignment


def token_labels(text: str, encoding, strict: bool = True,
                 answers: list[Answer] | None = None) -> list[tuple[int, Answer]]:
    """``(token index, answer)`` for each answer (``solve(text)`` unless given) that is one token of ``encoding``; a
    split answer is a :class:`DrcError`, or left out with ``strict=False``."""
    starts = {}
    for i, (a, b) in enumerate(encoding.offsets):
        starts.setdefault(b, []).append((i, a))
    out = []
    for ans in solve(text) if answers is None else answers:
        hit = [i for i, a in starts.get(ans.end, []) if a <= ans.start and a >= ans.start - 1]
        if len(hit) != 1:
            if not strict:
                continue
            raise DrcError(f"answer '{ans.word}' at character {ans.start} is not one token in this tokenizer: train "
                           "the BPE with more depth-task text (a larger --vocab-size or more documents)")
        out.append((hit[0], ans))
    return out

"""One exception type for problems a user can fix (:class:`DrcError`, a one-line message), the number validators and
limits every input is checked against, and :func:`run_cli`, which turns bad input, the disk or Ctrl-C into one
``error: ...`` line (any other exception is a bug and keeps its traceback; ``--debug`` or ``DRC_DEBUG=1`` shows it)."""

from __future__ import annotations

import argparse
import errno
import math
import numbers
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import NoReturn


class DrcError(ValueError):
    """A user-fixable problem. The message is one line: what is wrong, then how to fix it."""


class Interrupted(DrcError):
    """Ctrl-C during a long run; the message says what was kept and how to go on (exit 1)."""


MB = 1 << 20


def need_disk(path: str | Path, nbytes: int, what: str) -> None:
    """A :class:`DrcError` unless the filesystem of ``path`` has ``nbytes`` + 1 MB free for ``what``."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    if free < nbytes + MB:
        raise DrcError(f"not enough disk space at {p} for {what}: need {max(1, -(-nbytes // MB))} MB, have "
                       f"{free // MB} MB; free some space or write somewhere else")


def first_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message (else its type name), cut to ``limit`` characters when given."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line if limit is None else line[:limit]


def _os_error_line(exc: OSError) -> str:
    where = exc.filename or "the output path"
    if exc.errno == errno.ENOSPC:
        return f"not enough disk space at {where} (the disk filled up while writing): free some space and rerun"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {where}: {exc.strerror.lower()}; choose a writable directory"
    if exc.errno == errno.ENOTDIR:
        return f"{where} is not a directory (a file stands where a directory is needed): choose another path"
    if exc.errno == errno.ENOENT:
        return f"{where} does not exist: check the path"
    return f"{exc.strerror or type(exc).__name__} at {where}: check the path and the disk"


def need_int(name: str, value: object, minimum: int, owner: str = "", maximum: int | None = None) -> int:
    """``value`` as an int, or a one-line :class:`DrcError` unless it is an integer (not a bool) in
    ``minimum..maximum``; ``owner`` (e.g. a rule's name) prefixes the message."""
    prefix = f"{owner}: " if owner else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise DrcError(f"{prefix}{name}={value!r} is invalid; it must be an integer >= {minimum}")
    if maximum is not None and value > maximum:
        raise DrcError(f"{prefix}{name}={value} is above the limit of {maximum:,}: use at most {maximum:,}")
    return int(value)


def check_fields(cls: type, data: object, where: str) -> dict:
    """``data`` as a dict holding exactly the fields of the dataclass ``cls``, or a one-line :class:`DrcError`."""
    names = [f.name for f in fields(cls)]
    if not isinstance(data, dict):
        raise DrcError(f"{where} is not a JSON object of {cls.__name__} fields: restore the file")
    if unknown := sorted(set(data) - set(names)):
        raise DrcError(f"{where} has unknown {cls.__name__} key {unknown[0]!r}: remove it (valid keys: "
                       f"{', '.join(names)})")
    if missing := [n for n in names if n not in data]:
        raise DrcError(f"{where} lacks {cls.__name__} field{'s' if len(missing) > 1 else ''} {', '.join(missing)}: "
                       "the file is damaged or was edited; restore it from the run that wrote it")
    return dict(data)


# ------------------------------------------------------------------------------------------------------ limits
# Every size an input can ask for is bounded here and checked before anything is allocated (docs/bad-input.md),
# far above the largest preset (paper-135m).
MAX_LOOPS = 1024  # the most core loops any call runs; the state converges in tens of loops
MAX_SEED = 2**63 - 1  # torch.manual_seed takes at most a 64-bit integer
MAX_VOCAB = 1 << 20  # token ids of a vocabulary
MAX_D_MODEL = 16384  # the model width
MAX_LAYERS = 64  # blocks in each of the prelude, the core and the coda
MAX_SEQ_LEN = 32768  # a model's max_seq_len (its RoPE tables) and a training window
MAX_MODEL_PARAMS = 1_000_000_000  # parameters + RoPE table entries of a ModelConfig (4 GB in float32)
MAX_BATCH_TOKENS = 1 << 22  # batch_size * seq_len of one training step (16x the paper preset's)
MAX_SIGMA = 4.0  # recurrence.sigma: the loop-count draw's lognormal spread (exp(sigma^2) overflows soon above)
MAX_TASK_DOCS = 4_000_000  # depth-task documents generated in memory (10x the paper profile's)
MAX_TASK_PROBLEMS = 64  # depth-task problems per document
MAX_JSON_BYTES = 64 * MB  # any JSON file read (configs, records, meta.json, tokenizer.json, manifests, results)
MAX_TEXT_FILE_BYTES = 256 * MB  # one .txt input (one document, read whole)
MAX_DOCUMENT_TOKENS = 1 << 24  # tokens of one document given to the API as text (calibration documents)


def need_loops(name: str, value: object) -> int:
    """A loop count as an int, or a one-line :class:`DrcError` unless it is an integer in 1..:data:`MAX_LOOPS`."""
    n = need_int(name, value, 1)
    if n > MAX_LOOPS:
        raise DrcError(f"{name}={n} is above the limit of {MAX_LOOPS} loops: the state converges within tens of "
                       f"loops; use at most {MAX_LOOPS}")
    return n


def fmt_number(x: float) -> str:
    """A short number for names and messages: 0.001 -> '1e-3', 0.5 -> '0.5'."""
    if x == 0 or not math.isfinite(x) or 1e-2 <= abs(x) < 1e5:
        return f"{x:g}"
    for digits in range(7):
        text = f"{x:.{digits}e}"
        if float(text) == x:
            break
    mantissa, exponent = text.split("e")
    return f"{mantissa}e{int(exponent)}"


def need_float(name: str, value: object, lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False,
               hi_open: bool = False, owner: str = "") -> float:
    """``value`` as a float, or a one-line :class:`DrcError` unless it is a finite real number (not a bool) in
    [lo, hi] (``lo_open`` / ``hi_open`` exclude an end)."""
    lo_text = f"({fmt_number(lo)}" if lo_open or not math.isfinite(lo) else f"[{fmt_number(lo)}"
    hi_text = f"{fmt_number(hi)})" if hi_open or not math.isfinite(hi) else f"{fmt_number(hi)}]"
    if ok := isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
        v = float(value)
        ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        prefix = f"{owner}: " if owner else ""
        raise DrcError(f"{prefix}{name}={value!r} is invalid; it must be a finite number in {lo_text}, {hi_text}")
    return float(value)  # type: ignore[arg-type]


def need_eps(eps: object) -> float:
    """A convergence threshold as a float, or a one-line :class:`DrcError` unless it is a finite number > 0."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < float(eps) < float("inf"):
        raise DrcError(f"eps={eps!r} is invalid; it must be a finite number > 0")
    return float(eps)


def need_level(level: object) -> float:
    """A confidence level as a float, or a one-line :class:`DrcError` unless it lies strictly between 0 and 1."""
    if isinstance(level, bool) or not isinstance(level, int | float) or not 0 < level < 1:
        raise DrcError(f"level={level!r} is invalid; it must lie strictly between 0 and 1")
    return float(level)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one :class:`DrcError` line instead of a usage block."""

    def error(self, message: str) -> NoReturn:
        raise DrcError(f"{self.prog}: {' '.join(message.split())}: see `{self.prog} --help`")


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a CLI entry point: one ``error:`` line and exit 2 for bad input or the disk, exit 1 for an interrupt
    (``--debug``: with the traceback)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("DRC_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]

    def fail(line: str, code: int) -> int:
        if debug:
            traceback.print_exc()
        print(f"error: {line}", file=sys.stderr)
        return code

    try:
        return int(main(args) or 0)
    except Interrupted as exc:
        return fail(str(exc), 1)
    except DrcError as exc:
        return fail(str(exc), 2)
    except KeyboardInterrupt:
        return fail("interrupted (Ctrl-C) before it finished: rerun the command", 1)
    except OSError as exc:
        return fail(_os_error_line(exc), 2)

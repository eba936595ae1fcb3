"""What a CLI may replace, and one writer at a time: the rules every writer of this project goes through.

- :func:`exclusive`: an exclusive ``flock`` on a directory a process writes (a run directory, a prepared corpus, a
  book profile). The lock file is ``.<name>.lock`` beside the directory (so it survives the directory being
  renamed or swapped in), holds the owner's pid, and is removed on release; the OS drops the lock when the process
  dies, so a crash never leaves a stale lock. A second writer gets one :class:`~drc_core.errors.DrcError` line
  naming the holder's pid.
- :func:`owned_file`: an output file named by the user is written only when it is new or a file this tool wrote
  (it carries :data:`OWNER_KEY`); anything else -- a run's ``config.json``, a user's notes -- is refused.
- :func:`remove_leftovers`: temporary siblings (``.<name>.tmp-*``, ``.<name>.old-*``) that a killed writer of the
  same path left behind; only called under that path's lock, so no live writer owns them.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from drc_core.errors import DrcError

__all__ = ["OWNER_KEY", "exclusive", "lock_path", "owned_file", "remove_leftovers", "write_owned_json"]

OWNER_KEY = "written_by"  # the key a JSON output of this project carries, naming the writer


def lock_path(target: str | Path) -> Path:
    """The lock file of ``target``: ``.<name>.lock`` in its parent directory."""
    t = Path(target).absolute()
    return t.parent / f".{t.name}.lock"


def _holder(lock: Path) -> str:
    try:
        pid = lock.read_text().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "a process that is just starting"


@contextmanager
def exclusive(target: str | Path, what: str) -> Iterator[Path]:
    """Hold the exclusive lock of ``target`` (a directory, existing or not) while the block runs; ``what`` names it
    in the error (e.g. ``run directory``). A second process, or a second lock of the same path in this process, gets
    ``DrcError: <what> '<target>' is being written by another process (pid N): ...``."""
    lock = lock_path(target)
    made = [p for p in (lock.parent, *lock.parent.parents) if not p.exists()]  # removed again if left empty
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise DrcError(f"{what} '{target}' is being written by another process ({_holder(lock)}, lock "
                           f"{lock}): wait for it to finish or stop it, then rerun") from None
        try:  # the holder before us may have removed the file after we opened it: lock the one at the path
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield lock
    finally:
        # remove the file before releasing: a waiter that opened it sees another inode at the path and retries
        with suppress(OSError):
            lock.unlink()
        os.close(fd)
        for p in made:  # deepest first; a directory the work filled stays
            with suppress(OSError):
                p.rmdir()


def remove_leftovers(target: str | Path, kinds: tuple[str, ...] = ("tmp", "old")) -> list[Path]:
    """Remove ``.<name>.<kind>-*`` siblings of ``target`` (what an interrupted writer of it left); call under
    :func:`exclusive` of ``target``. Returns what was removed."""
    t = Path(target).absolute()
    if not t.parent.is_dir():
        return []
    removed = []
    for kind in kinds:
        for p in t.parent.glob(f".{t.name}.{kind}-*"):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def owned_file(path: str | Path, writer: str, flag: str, legacy_keys: frozenset[str] = frozenset()) -> Path:
    """``path`` if a JSON output of ``writer`` may be written there: a new file in an existing directory, or a
    file that ``writer`` wrote before (a JSON object whose :data:`OWNER_KEY` is ``writer``, or, for files written
    before the mark existed, whose keys are exactly ``legacy_keys`` when given). Anything else is a
    one-line :class:`DrcError` (``flag`` names the option, e.g. ``--json``): nothing the user did not name as
    replaceable is replaced."""
    p = Path(path)
    if p.is_dir():
        raise DrcError(f"{flag} '{p}' is a directory: pass a file path, e.g. {p / 'eval.json'}")
    if not p.parent.is_dir():
        raise DrcError(f"{flag} '{p}': the directory {p.parent} does not exist: create it or choose another path")
    if p.exists() or p.is_symlink():
        try:
            data = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            data = None
        ours = isinstance(data, dict) and (data.get(OWNER_KEY) == writer or bool(legacy_keys) and set(data) ==
                                           legacy_keys)
        if not ours:
            raise DrcError(f"{flag} '{p}' exists and was not written by {writer}: it is left as it is; choose a new "
                           "file name (or delete that file yourself)")
    return p


def write_owned_json(path: str | Path, data: dict, writer: str, legacy_keys: frozenset[str] = frozenset()) -> Path:
    """Write ``data`` (with :data:`OWNER_KEY` = ``writer``) to ``path`` atomically (a temporary sibling, then a
    rename), after :func:`owned_file` allowed it."""
    p = owned_file(path, writer, "output", legacy_keys)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps({OWNER_KEY: writer, **data}, indent=2) + "\n")
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p

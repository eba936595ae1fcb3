"""What a writer may replace, and one writer at a time: :func:`exclusive` (an ``flock`` beside the target),
:func:`owned_file` (an output is new or ours), :func:`remove_leftovers` (what a killed writer left); size-bounded reads
of regular files only (:func:`read_regular`, :func:`read_json`) and writes that never go through a symbolic link
(:func:`write_file`, :func:`write_dir`, :func:`open_append`, :func:`refuse_links`)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from drc_core.errors import MAX_JSON_BYTES, MB, DrcError, first_line

__all__ = ["OWNER_KEY", "exclusive", "file_kind", "open_append", "owned_file", "parse_json",
           "read_json", "read_regular", "refuse_links", "remove_leftovers", "remove_path", "write_dir", "write_file",
           "write_owned_json"]

OWNER_KEY = "written_by"  # the key a JSON output of this project carries, naming the writer


def file_kind(mode: int) -> str:
    """What a non-regular ``st_mode`` is, for a message: "a directory", "a FIFO", "a device" or "not a regular file"."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"


def remove_path(p: Path, *, strict: bool = False) -> None:
    """Remove ``p``: a directory with what it holds, anything else (a link included) as itself; ``strict`` raises
    what the removal meets instead of leaving what it could not remove."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=not strict)
    else:
        p.unlink(missing_ok=not strict)


def _open_lock(lock: Path) -> int:
    """The lock file's descriptor, opened without following a link; a link, a hard link or not a file is refused."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise DrcError(f"lock file {lock} is a symbolic link: a lock file is a plain file this tool makes; remove "
                       "the link and rerun") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:  # 0: just removed by its holder (retried below)
        os.close(fd)
        kind = "a hard link to another file" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise DrcError(f"lock file {lock} is {kind}: a lock file is a plain file this tool makes; remove it and "
                       "rerun")
    return fd


def _busy(what: str, target: str | Path, lock: Path, why: str) -> DrcError:
    return DrcError(f"{what} '{target}' is being written by another process ({why}, lock {lock}): wait for it "
                    "to finish or stop it, then rerun")


@contextmanager
def exclusive(target: str | Path, what: str) -> Iterator[Path]:
    """Hold the exclusive lock of ``target`` (a directory, existing or not, locked too; ``what`` names it in the
    error) while the block runs, through the lock file ``.<name>.lock`` beside it; the OS drops it when the process
    dies."""
    t = Path(target).absolute()
    lock = t.parent / f".{t.name}.lock"
    made = [p for p in (lock.parent, *lock.parent.parents) if not p.exists()]  # removed again if left empty
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = _open_lock(lock)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            try:
                pid = read_regular(lock, "a lock file", 64).decode(errors="replace").strip()
            except (OSError, DrcError):
                pid = ""
            raise _busy(what, target, lock, f"pid {pid}" if pid.isdigit() else "a process that is just starting"
                        ) from None
        with suppress(FileNotFoundError):  # the holder before us may have removed the file we opened: retry then
            if os.fstat(fd).st_ino == os.stat(lock, follow_symlinks=False).st_ino:
                break
        os.close(fd)
    dir_fd = None
    try:
        if t.is_dir():
            dir_fd = os.open(t, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise _busy(what, target, lock, "its lock file was deleted while it held it") from None
                os.close(dir_fd)  # a filesystem that cannot lock a directory: the lock file alone guards it
                dir_fd = None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield lock
    finally:
        # remove the file before releasing: a waiter that opened it sees another inode at the path and retries
        with suppress(OSError):
            if os.stat(lock, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                lock.unlink()
        os.close(fd)
        if dir_fd is not None:
            os.close(dir_fd)
        for p in made:  # deepest first; a directory the work filled stays
            with suppress(OSError):
                p.rmdir()


def remove_leftovers(target: str | Path, kinds: tuple[str, ...] = ("tmp", "old")) -> None:
    """Remove the ``.<name>.<kind>-*`` siblings a killed writer of ``target`` left (under its lock); where ``target``
    was swapped out and not back, the newest ``.old-*`` is renamed back first."""
    t = Path(target).absolute()
    if not t.parent.is_dir():
        return
    if "old" in kinds and not t.exists() and not t.is_symlink():
        olds = [p for p in t.parent.glob(f".{t.name}.old-*") if p.is_dir() and not p.is_symlink()]
        if olds:
            max(olds, key=lambda p: p.stat().st_mtime).rename(t)
    for kind in kinds:
        for p in t.parent.glob(f".{t.name}.{kind}-*"):
            remove_path(p)


def refuse_links(paths: Iterable[Path], owner: str) -> None:
    """A one-line :class:`DrcError` when any of ``paths``, entries of the directory ``owner`` names, is a link."""
    for p in paths:
        if p.is_symlink():
            raise DrcError(f"{p} is a symbolic link (to {os.readlink(p)}): the {owner} holds only files it wrote "
                           "itself and nothing is written through a link; replace the link by the file it points "
                           "at (or remove it) and rerun")


def read_regular(path: str | Path, what: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of the regular file ``path`` of at most ``limit`` bytes (opened without blocking), else a one-line
    :class:`DrcError` naming ``what``; a missing file raises ``FileNotFoundError``."""
    p = Path(path)
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DrcError(f"'{p}' is {file_kind(st.st_mode)}, not a regular file: {what} must be a file; pass the "
                           "real file")
        chunks, size = [], 0
        while size <= limit:
            if not (chunk := os.read(fd, min(1 << 20, limit + 1 - size))):
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise DrcError(f"'{p}' is larger than the {limit // MB} MB that {what} may hold "
                           "(drc_core.errors limits): it is not one; pass the right file")
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_json(raw: bytes) -> Any:
    """The JSON value of ``raw``; a ``ValueError`` saying why when it is not UTF-8, not JSON or nested too deeply."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        why = f"not UTF-8 at byte {exc.start}"
    except json.JSONDecodeError as exc:
        why = f"not JSON: {first_line(exc, 80)}"
    except RecursionError:
        why = "nested too deeply"
    raise ValueError(why)


def read_json(path: str | Path, what: str, fix: str, limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in ``path``; a damaged file is a one-line ``<what> '<path>' is damaged (<why>): <fix>``."""
    raw = read_regular(path, what, limit)
    try:
        return parse_json(raw)
    except ValueError as exc:
        raise DrcError(f"{what} '{path}' is damaged ({exc}): {fix}") from None


def write_file(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` to ``path`` atomically through a new sibling ``.<name>.tmp-*`` (a link there is replaced)."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.tmp-", dir=p.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, p)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    return p


def write_dir(path: str | Path, fill: Callable[[Path], object], prefix: str | None = None) -> Path:
    """Make the directory ``path`` atomically: ``fill`` writes a new sibling (``prefix``, by default
    ``.<name>.tmp-``), which then replaces ``path`` (a link there is removed, its target untouched)."""
    p = Path(path)
    tmp = Path(tempfile.mkdtemp(prefix=prefix or f".{p.name}.tmp-", dir=p.parent))
    try:
        tmp.chmod(0o755)
        fill(tmp)
        if p.is_symlink() or p.is_file():
            p.unlink()
        else:
            shutil.rmtree(p, ignore_errors=True)
        os.replace(tmp, p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return p


def open_append(path: str | Path) -> IO[str]:
    """``path`` opened for appending text, created if missing; a link or a non-regular file is a :class:`DrcError`."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
    else:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return os.fdopen(fd, "a")
        os.close(fd)
    raise DrcError(f"{p} is a symbolic link or not a regular file: it is left as it is; replace it by the file it "
                   "stands for (or remove it) and rerun")


def owned_file(path: str | Path, writer: str, flag: str, legacy_keys: frozenset[str] = frozenset()) -> Path:
    """``path`` if a JSON output of ``writer`` may go there: new, or one whose :data:`OWNER_KEY` is ``writer`` (or
    whose keys are exactly ``legacy_keys``); else a one-line :class:`DrcError` naming ``flag`` (e.g. ``--json``)."""
    p = Path(path)
    if p.is_dir():
        raise DrcError(f"{flag} '{p}' is a directory: pass a file path, e.g. {p / 'eval.json'}")
    if not p.parent.is_dir():
        raise DrcError(f"{flag} '{p}': the directory {p.parent} does not exist: create it or choose another path")
    if p.exists() or p.is_symlink():
        data = None
        if not p.is_symlink():
            with suppress(OSError, DrcError):
                data = read_json(p, f"{flag} file", "")
        ours = isinstance(data, dict) and (data.get(OWNER_KEY) == writer or bool(legacy_keys) and set(data) ==
                                           legacy_keys)
        if not ours:
            raise DrcError(f"{flag} '{p}' exists and was not written by {writer}: it is left as it is; choose a new "
                           "file name (or delete that file yourself)")
    return p


def write_owned_json(path: str | Path, data: dict, writer: str, legacy_keys: frozenset[str] = frozenset()) -> Path:
    """Write ``data`` marked with ``writer`` to ``path`` under its lock, after :func:`owned_file` allowed it."""
    p = Path(path)
    with exclusive(p, "output file"):
        remove_leftovers(p, ("tmp",))
        owned_file(p, writer, "output", legacy_keys)
        return write_file(p, json.dumps({OWNER_KEY: writer, **data}, indent=2) + "\n")

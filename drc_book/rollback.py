"""What a notebook of ``book run`` may change, and how it is undone when the notebook fails, is interrupted or its
runner is killed: :class:`Rollback`; SIGTERM turned into an exception the runner handles like Ctrl-C
(:class:`Terminated`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from drc_core import DrcError, read_json, write_file

__all__ = ["Rollback", "Terminated", "raise_terminated"]

MANIFEST_FORMAT = 2


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _inside(path: Path, root: Path) -> bool:
    """Whether ``path`` lies in ``root`` once every link on the way is resolved (no ``..``, no symbolic link out)."""
    return path.resolve().is_relative_to(root.resolve())


class Rollback:
    """Copies of what a notebook may change (every file under its ``results_dir``, the files directly in its
    ``work_dir``; not links nor lock files), so that :meth:`undo` puts them back and removes what it added. The copies
    and their manifest (written last: directory, path and sha256 of each) stay on disk while it runs, so that the next
    run undoes a killed one (:meth:`recover`), trusting the manifest only as far as the checks of :meth:`_checked`."""

    MANIFEST = "manifest.json"

    def __init__(self, dirs: list[tuple[Path, bool]], backup: Path, kept: dict[Path, Path]) -> None:
        self.dirs, self.backup, self.kept = dirs, backup, kept

    @classmethod
    def take(cls, dirs: list[tuple[Path, bool]], backup: Path, notebook: str = "") -> Rollback:
        """Copy what ``notebook`` may change into ``backup``, then write the manifest."""
        kept, entries = {}, []
        shutil.rmtree(backup, ignore_errors=True)
        backup.mkdir(parents=True)
        for i, (d, recursive) in enumerate(dirs):
            for f in cls._files(d, recursive):
                rel = f.relative_to(d)
                copy = backup / str(i) / rel
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, copy)
                kept[f] = copy
                entries.append([i, rel.as_posix(), _sha256(copy)])
        record = {"format": MANIFEST_FORMAT, "notebook": notebook, "dirs": [[str(d), r] for d, r in dirs],
                  "kept": entries}
        write_file(backup / cls.MANIFEST, json.dumps(record))
        return cls(dirs, backup, kept)

    @classmethod
    def recover(cls, backup: Path, allowed: list[Path]) -> str | None:
        """Undo the notebook a killed run left half done and return its name (None: none). A manifest naming a
        directory not in ``allowed``, a path outside its directory or another copy is a :class:`DrcError`."""
        manifest = backup / cls.MANIFEST
        name = None
        if manifest.exists() or manifest.is_symlink():
            rollback, name = cls._checked(backup, allowed)
            rollback.undo()
        shutil.rmtree(backup, ignore_errors=True)
        return name

    @classmethod
    def _checked(cls, backup: Path, allowed: list[Path]) -> tuple[Rollback, str]:
        manifest = backup / cls.MANIFEST
        keep = f"nothing was undone; check those outputs by hand, then delete {backup} and rerun"

        def refuse(why: str) -> DrcError:
            return DrcError(f"the rollback record {manifest} of a killed run {why}: {keep}")

        if manifest.is_symlink():
            raise refuse("is a symbolic link")
        record = read_json(manifest, "the rollback record of a killed run", keep)
        if not isinstance(record, dict) or not isinstance(record.get("dirs"), list):
            raise refuse("is not a rollback record")
        dirs: list[tuple[Path, bool]] = []
        roots = [a.resolve() for a in allowed]
        for entry in record["dirs"]:
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and entry[0]
                    and "\x00" not in entry[0] and isinstance(entry[1], bool)):
                raise refuse("names a directory that is not [path, recursive]")
            d = Path(entry[0])
            if d.resolve() not in roots:
                raise refuse(f"names {d}, which is not an output directory (results_dir, work_dir) of this profile "
                             "as run now (rerun with the --set values of the killed run to undo it)")
            dirs.append((d, entry[1]))
        pairs: list[tuple[int, str, str | None]] = []
        if record.get("format") == MANIFEST_FORMAT:
            if not isinstance(record.get("kept", []), list):
                raise refuse("keeps no list of [directory, path, sha256] entries")
            for entry in record.get("kept", []):
                if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], int)
                        and not isinstance(entry[0], bool) and isinstance(entry[1], str) and "\x00" not in entry[1]
                        and isinstance(entry[2], str)):
                    raise refuse("holds an entry that is not [directory, path, sha256]")
                pairs.append((entry[0], entry[1], entry[2]))
        elif "format" not in record and isinstance(record.get("kept"), dict):  # written before the format field
            for f, c in record["kept"].items():
                for i, (d, _) in enumerate(dirs):
                    rel = Path(f).relative_to(d) if Path(f).is_relative_to(d) else None
                    if rel is not None and isinstance(c, str) and Path(c) == backup / str(i) / rel:
                        pairs.append((i, rel.as_posix(), None))
                        break
                else:
                    raise refuse(f"keeps {f!r}, which lies in none of its directories")
        else:
            raise refuse("is not a rollback record this version writes")
        kept: dict[Path, Path] = {}
        for i, rel, digest in pairs:
            if not 0 <= i < len(dirs) or Path(rel).is_absolute() or ".." in Path(rel).parts or not rel:
                raise refuse(f"keeps {rel!r}, which is not a path inside its directory")
            d, recursive = dirs[i]
            if not recursive and len(Path(rel).parts) != 1:
                raise refuse(f"keeps {rel!r} below {d}, where only its own files are kept")
            f, copy = d / rel, backup / str(i) / rel
            if not (copy.is_file() and not copy.is_symlink() and _inside(copy, backup)):
                raise refuse(f"keeps {rel!r}, whose copy is missing or not a file in {backup}")
            if not _inside(f.parent if f.parent.exists() else d, d):
                raise refuse(f"keeps {f}, which a symbolic link takes out of {d}")
            if digest is not None and _sha256(copy) != digest:
                raise refuse(f"keeps {rel!r}, whose copy is not the one recorded (sha256 differs)")
            kept[f] = copy
        return cls(dirs, backup, kept), str(record.get("notebook") or "?")

    @staticmethod
    def _files(d: Path, recursive: bool) -> list[Path]:
        """The regular files of ``d`` (and below it, when ``recursive``), lock files excluded."""
        if not d.is_dir():
            return []
        found = []
        for root, subdirs, files in os.walk(d, followlinks=False):
            if not recursive:
                subdirs.clear()
            for name in files:
                f = Path(root) / name
                if f.is_file() and not f.is_symlink() and not (name.startswith(".") and name.endswith(".lock")):
                    found.append(f)
        return found

    def undo(self) -> None:
        for d, recursive in self.dirs:
            for f in self._files(d, recursive):
                if f not in self.kept:
                    f.unlink()
        for f, copy in self.kept.items():
            f.parent.mkdir(parents=True, exist_ok=True)
            if f.is_symlink():  # a link put where a kept file was: replaced, its target untouched
                f.unlink()
            shutil.copy2(copy, f)

    def close(self) -> None:
        shutil.rmtree(self.backup, ignore_errors=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the runner the way Ctrl-C is, so that the running notebook's outputs are undone."""


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()

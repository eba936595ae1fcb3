"""What a notebook of ``book run`` may change, and how it is undone when the notebook fails, is interrupted or its
runner is killed: :class:`Rollback`; SIGTERM turned into an exception the runner handles like Ctrl-C
(:class:`Terminated`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = ["Rollback", "Terminated", "raise_terminated"]


class Rollback:
    """What a notebook may change, kept so that a failed, interrupted or killed notebook changes nothing: every file
    under its ``results_dir`` (results, figure JSON) and the files directly in its ``work_dir`` (frames), copied
    before it runs; :meth:`undo` puts them back and removes the files it added there. (The directories below
    ``work_dir`` -- the model, training runs -- are written atomically and under their own locks.)

    The copies and a manifest (written last, atomically) stay on disk while the notebook runs, so that when the
    runner itself is killed (SIGKILL, power) the next run of the profile finds them and undoes the notebook
    first (:meth:`recover`)."""

    MANIFEST = "manifest.json"

    def __init__(self, dirs: list[tuple[Path, bool]], backup: Path, kept: dict[Path, Path]) -> None:
        self.dirs, self.backup, self.kept = dirs, backup, kept

    @classmethod
    def take(cls, dirs: list[tuple[Path, bool]], backup: Path, notebook: str = "") -> Rollback:
        """Copy what ``notebook`` may change into ``backup``, then write the manifest."""
        kept = {}
        shutil.rmtree(backup, ignore_errors=True)
        backup.mkdir(parents=True)
        for i, (d, recursive) in enumerate(dirs):
            for f in cls._files(d, recursive):
                copy = backup / str(i) / f.relative_to(d)
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, copy)
                kept[f] = copy
        record = {"notebook": notebook, "dirs": [[str(d), r] for d, r in dirs],
                  "kept": {str(f): str(c) for f, c in kept.items()}}
        tmp = backup / (cls.MANIFEST + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, backup / cls.MANIFEST)
        return cls(dirs, backup, kept)

    @classmethod
    def recover(cls, backup: Path) -> str | None:
        """Undo the notebook a killed run left half done (the name of that notebook), or None when there is none.
        Copies without a manifest were interrupted before their notebook started: nothing to undo."""
        manifest = backup / cls.MANIFEST
        name = None
        if manifest.is_file():
            record = json.loads(manifest.read_text())
            cls([(Path(d), bool(r)) for d, r in record["dirs"]], backup,
                {Path(f): Path(c) for f, c in record["kept"].items()}).undo()
            name = str(record.get("notebook") or "?")
        shutil.rmtree(backup, ignore_errors=True)
        return name

    @staticmethod
    def _files(d: Path, recursive: bool) -> list[Path]:
        if not d.is_dir():
            return []
        found = d.rglob("*") if recursive else d.iterdir()
        return [f for f in found if f.is_file() and not f.is_symlink()]

    def undo(self) -> None:
        for d, recursive in self.dirs:
            for f in self._files(d, recursive):
                if f not in self.kept:
                    f.unlink()
        for f, copy in self.kept.items():
            f.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(copy, f)

    def close(self) -> None:
        shutil.rmtree(self.backup, ignore_errors=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the runner the way Ctrl-C is, so that the running notebook's outputs are undone."""


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()

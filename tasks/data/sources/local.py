"""Local files: a file, a directory (recursively) or a glob, of the formats in `tasks.data.formats`
(a directory of Parquet shards is a directory). Documents' identities are their paths relative to a root
the user named: the directory itself, a file's parent, or a glob's fixed part (`data/**/*.jsonl` → `data`),
never something that depends on which files matched (a new subdirectory must not move the others)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from tasks.data.errors import DataError
from tasks.data.formats import KNOWN_SUFFIXES, is_known
from tasks.data.sources.base import SourceKind


def _is_glob(source: str) -> bool:
    return glob.has_magic(source) and not Path(os.path.expanduser(source)).exists()


def glob_root(pattern: str) -> Path:
    """The directory a glob names before its first wildcard component."""
    fixed: list[str] = []
    for part in Path(os.path.expanduser(pattern)).parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return Path(*fixed).resolve() if fixed else Path.cwd()


def _glob_files(source: str) -> list[Path]:
    matches = sorted(Path(p).resolve() for p in glob.glob(os.path.expanduser(source), recursive=True))
    return [p for p in matches if p.is_file()]


def check(source: str) -> None:
    if _is_glob(source):
        if not _glob_files(source):
            raise DataError(
                f"The glob {source!r} matches no files; check the pattern and the working directory."
            )
        return
    path = Path(os.path.expanduser(source)).resolve()
    if not path.exists():
        raise DataError(
            f"Data path {source!r} does not exist (resolved to {path}); give an existing file, directory or glob,"
            " 'stdlib', or 'hf:NAME' for a Hugging Face dataset."
        )


def list_files(source: str) -> tuple[list[Path], Path]:
    check(source)
    if _is_glob(source):
        return _glob_files(source), glob_root(source)
    path = Path(os.path.expanduser(source)).resolve()
    if not path.is_dir():
        return [path], path.parent
    files = sorted(
        p for p in path.rglob("*") if p.is_file() and is_known(p.name) and "__pycache__" not in p.parts
    )
    if not files:
        raise DataError(
            f"Directory {path} holds no files with a known extension {KNOWN_SUFFIXES}; point data at text files."
        )
    return files, path


KIND = SourceKind(name="local", priority=100, claims=lambda source: True, check=check, list_files=list_files)

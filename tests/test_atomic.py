"""model.atomic: files and directories appear whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.atomic import atomic_dir, atomic_file, remove_stale


def test_the_first_directory_published_wins_unless_replacing(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "key"
    with atomic_dir(final) as theirs:
        (theirs.path / "meta.json").write_text("{}")
    with atomic_dir(final) as mine:
        (mine.path / "meta.json").write_text('{"late": true}')
    assert theirs.published and not mine.published
    assert not mine.path.exists() and (final / "meta.json").read_text() == "{}"

    with atomic_dir(final, replace=True, durable=True) as newer:
        (newer.path / "meta.json").write_text('{"newer": true}')
    assert newer.published and (final / "meta.json").read_text() == '{"newer": true}'
    assert sorted(p.name for p in final.parent.iterdir()) == ["key"]  # the old copy is gone too


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "d") as staged:
        (staged.path / "half").write_text("x")
        raise RuntimeError("killed")
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "f.json") as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_stale_staging_entries_of_killed_writers_are_removed(tmp_path: Path) -> None:
    (tmp_path / ".step_000004.tmp-123-abcd").mkdir()
    (tmp_path / ".x.json.tmp-9-ef01").write_text("")
    (tmp_path / "step_000002").mkdir()
    removed = remove_stale(tmp_path, "step_*")
    assert [p.name for p in removed] == [".step_000004.tmp-123-abcd"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".x.json.tmp-9-ef01", "step_000002"]


READER = """
import os, sys
final, stop = sys.argv[1], sys.argv[2]
print("ready", flush=True)
missing = 0
while not os.path.exists(stop):
    missing += not os.path.exists(os.path.join(final, "meta.json"))
print(missing, flush=True)
"""


def test_replacing_a_directory_never_leaves_its_place_empty(tmp_path: Path) -> None:
    """A reader in another process polls the directory while it is replaced 100 times: it is always there."""
    import subprocess
    import sys

    final, stop = tmp_path / "step_000004", tmp_path / "stop"
    with atomic_dir(final) as first:
        (first.path / "meta.json").write_text("0")
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(final), str(stop)], stdout=subprocess.PIPE, text=True
    )
    assert reader.stdout is not None and reader.stdout.readline() == "ready\n"
    for version in range(1, 101):
        with atomic_dir(final, replace=True) as staged:
            (staged.path / "meta.json").write_text(str(version))
    stop.touch()
    out, _ = reader.communicate(timeout=60)
    assert int(out) == 0, f"the reader found no {final.name} {out.strip()} times"
    assert (final / "meta.json").read_text() == "100"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004", "stop"]


def test_a_replace_killed_between_its_renames_gets_the_old_directory_back(tmp_path: Path) -> None:
    """Without an atomic exchange the old directory is moved aside first; a writer killed right then leaves
    it aside (and its own staging directory): `remove_stale` puts the old one back."""
    aside = tmp_path / ".step_000004.old-123-abcd"
    aside.mkdir()
    (aside / "meta.json").write_text("old")
    (tmp_path / ".step_000004.tmp-123-ef01").mkdir()
    remove_stale(tmp_path, "step_*")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004"]
    assert (tmp_path / "step_000004" / "meta.json").read_text() == "old"
    # An aside copy whose place was filled again is only removed.
    aside.mkdir()
    remove_stale(tmp_path, "step_*")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000004"]


def test_replace_without_an_atomic_exchange_still_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import model.atomic

    monkeypatch.setattr(
        model.atomic, "_exchange", lambda a, b: False
    )  # a file system without RENAME_EXCHANGE
    final = tmp_path / "key"
    for version in ("1", "2"):
        with atomic_dir(final, replace=True) as staged:
            (staged.path / "meta.json").write_text(version)
    assert (final / "meta.json").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key"]

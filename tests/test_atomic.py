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

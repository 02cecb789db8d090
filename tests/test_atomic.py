"""`mlaquant.atomic`: a failed write leaves the old file or directory and no temporary behind."""

from __future__ import annotations

import json
import os
import stat

import pytest

from mlaquant import atomic
from mlaquant.atomic import atomic_directory, atomic_write, recover_directory, write_json


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_write_replaces_content_with_mode(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    atomic_write(path, "héllo\n")
    atomic_write(path, b"bytes")
    assert path.read_bytes() == b"bytes" and _mode(path) == 0o644
    atomic_write(path, "x", mode=0o600)
    assert _mode(path) == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.txt"]


def test_write_json_round_trips_and_an_unserialisable_object_keeps_the_old_file(tmp_path):
    path = tmp_path / "rows.json"
    write_json(path, [{"row": "a", "loss": 0.5}])
    assert json.loads(path.read_text()) == [{"row": "a", "loss": 0.5}]
    with pytest.raises(TypeError):
        write_json(path, [{"row": object()}])
    assert json.loads(path.read_text()) == [{"row": "a", "loss": 0.5}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]


@pytest.mark.parametrize("fail", ["wrong type", "fsync"])
def test_failed_atomic_write_keeps_old_content_and_no_temp(tmp_path, monkeypatch, fail):
    path = tmp_path / "f.json"
    path.write_text("old")
    if fail == "wrong type":
        with pytest.raises(TypeError):
            atomic_write(path, 123)  # type: ignore[arg-type]
    else:
        def crash(fd):
            raise KeyboardInterrupt

        monkeypatch.setattr(atomic.os, "fsync", crash)  # after the data reached the temp file
        with pytest.raises(KeyboardInterrupt):
            atomic_write(path, "new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_atomic_directory_replaces_and_cleans_up(tmp_path):
    out = tmp_path / "plan"
    for text in ("one", "two"):
        with atomic_directory(out) as tmp:
            (tmp / "a.txt").write_text(text)
    assert (out / "a.txt").read_text() == "two" and _mode(out) == 0o700
    with atomic_directory(out, mode=0o755) as tmp:
        (tmp / "b.txt").write_text("three")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"] and _mode(out) == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def test_exception_in_atomic_directory_leaves_destination_untouched(tmp_path):
    out = tmp_path / "plan"
    with atomic_directory(out) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(out) as tmp:
        (tmp / "a.txt").write_text("new")
        (tmp / "b.txt").write_text("new")
        raise RuntimeError("mid-write")
    assert sorted(p.name for p in out.iterdir()) == ["a.txt"] and (out / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "fresh"):
        raise RuntimeError("before anything existed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def test_failed_swap_puts_the_previous_directory_back(tmp_path, monkeypatch):
    out = tmp_path / "plan"
    with atomic_directory(out) as tmp:
        (tmp / "a.txt").write_text("old")
    real = os.replace
    calls = []

    def second_rename_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the new directory into place, after the old one went aside
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", second_rename_fails)
    with pytest.raises(KeyboardInterrupt), atomic_directory(out) as tmp:
        (tmp / "a.txt").write_text("new")
    monkeypatch.setattr(atomic.os, "replace", real)
    assert (out / "a.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def test_recover_directory_settles_a_killed_swap(tmp_path):
    out, old = tmp_path / "plan", tmp_path / ".plan.old"
    old.mkdir()
    (old / "a.txt").write_text("previous")
    recover_directory(out)  # killed between the renames: the previous directory goes back
    assert (out / "a.txt").read_text() == "previous" and not old.exists()
    old.mkdir()
    recover_directory(out)  # killed after the second rename: the set-aside copy is dropped
    assert not old.exists() and (out / "a.txt").read_text() == "previous"
    old.mkdir()
    (old / "stale").write_text("x")
    with atomic_directory(out) as tmp:  # a stale set-aside copy does not block the next replacement
        (tmp / "a.txt").write_text("new")
    assert (out / "a.txt").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["plan"]

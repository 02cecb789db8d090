"""The stdlib corpus: collecting files, the path-hash split, JSONL + manifest, and the shipped splits."""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

import pytest

from mlaquant.bundled import corpus
from mlaquant.bundled.train import load_train_config
from mlaquant.errors import MLAQuantError
from mlaquant.evaluation.samples import load_texts


def _make_tree(root: Path, n: int = 60) -> None:
    for i in range(n):
        sub = root / f"pkg{i % 5}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 7))


def test_collect_skips_site_packages_binary_and_empty(tmp_path):
    _make_tree(tmp_path, 6)
    (tmp_path / "site-packages" / "thirdparty").mkdir(parents=True)
    (tmp_path / "site-packages" / "thirdparty" / "x.py").write_text("import os\n")
    (tmp_path / "latin1.py").write_bytes(b"# caf\xe9\n")
    (tmp_path / "empty.py").write_text("  \n")
    (tmp_path / "notes.txt").write_text("not python\n")
    (tmp_path / "big.py").write_text("x = 1\n" * 1000)
    files = corpus.collect_sources(tmp_path, max_file_bytes=5000)
    paths = [f.path for f in files]
    assert paths == sorted(paths)
    assert len(paths) == 6 and all(p.startswith("pkg") for p in paths)
    assert files[0].text == (tmp_path / files[0].path).read_text()


@pytest.mark.parametrize("kind", ["missing", "empty", "file"])
def test_collect_rejects_unusable_roots(tmp_path, kind):
    root = tmp_path / "corpus"
    if kind == "empty":
        root.mkdir()
        (root / "README").write_text("no python here\n")
    elif kind == "file":
        root.write_text("x = 1\n")
    with pytest.raises(MLAQuantError, match="corpus"):
        corpus.collect_sources(root)


def test_split_is_by_path_hash_disjoint_and_capped(tmp_path):
    _make_tree(tmp_path, 200)
    files = corpus.collect_sources(tmp_path)
    splits = corpus.split_sources(files, held_out_fraction=0.1, max_split_bytes=10**9)
    names = {k: {f.path for f in v} for k, v in splits.items()}
    assert sum(len(v) for v in names.values()) == len(files)
    for a in corpus.SPLITS:
        for b in corpus.SPLITS:
            assert a == b or not names[a] & names[b]
    # Independent check of the rule: bucket = floor(sha256(path)[:8] / 2^64 / fraction).
    for f in files:
        x = int.from_bytes(hashlib.sha256(f.path.encode()).digest()[:8], "big") / 2**64
        expect = corpus.HELD_OUT[int(x / 0.1)] if x < 0.3 else "train"
        assert f.path in names[expect]
    # A file's split does not depend on which other files exist.
    fewer = corpus.split_sources(files[::2], held_out_fraction=0.1, max_split_bytes=10**9)
    for k, v in fewer.items():
        assert {f.path for f in v} <= names[k]
    capped = corpus.split_sources(files, held_out_fraction=0.1, max_split_bytes=300)
    for name in corpus.HELD_OUT:
        assert sum(f.nbytes for f in capped[name]) <= 300
        assert {f.path for f in capped[name]} <= names[name]
    assert {f.path for f in capped["train"]} == names["train"]


def _read_split(path: Path) -> list[corpus.SourceFile]:
    """One `{"path", "text"}` JSONL split back, as `corpus.write_splits` wrote it."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [corpus.SourceFile(str(r["path"]), str(r["text"])) for r in rows]


def test_write_and_read_splits_round_trip(tmp_path):
    _make_tree(tmp_path / "src", 120)
    files = corpus.collect_sources(tmp_path / "src")
    splits = corpus.split_sources(files, held_out_fraction=0.1)
    manifest = corpus.write_splits(splits, tmp_path / "out", tmp_path / "src")
    on_disk = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert on_disk == manifest
    for name in corpus.HELD_OUT:
        back = _read_split(tmp_path / "out" / f"{name}.jsonl")
        assert back == splits[name]
        entries = manifest["splits"][name]["files"]
        assert [e["path"] for e in entries] == [f.path for f in back]
        for e in entries:
            raw = (tmp_path / "src" / e["path"]).read_bytes()
            assert e["sha256"] == hashlib.sha256(raw).hexdigest() and e["bytes"] == len(raw)
    assert not list((tmp_path / "out").glob(".*"))  # no temp files left behind


def test_a_split_read_as_data_names_a_bad_line(tmp_path):
    """The package reads JSONL splits through `samples.load_texts` (calibration data): a bad line is named."""
    p = tmp_path / "bad.jsonl"
    p.write_text('{"path": "a.py", "text": "x"}\n{"oops": 1}\n')
    with pytest.raises(MLAQuantError, match="bad.jsonl:2"):
        load_texts(p)


def test_shipped_splits_match_manifest_and_are_small():
    data = Path(str(resources.files("mlaquant.calib").joinpath("data")))
    manifest_path = data / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    fraction = load_train_config(None).corpus.held_out_fraction  # the packaged configs/train.yaml's
    total, seen = 0, set()
    for name in corpus.HELD_OUT:
        path = data / f"{name}.jsonl"
        total += path.stat().st_size
        files = _read_split(path)
        entries = manifest["splits"][name]["files"]
        assert [e["path"] for e in entries] == [f.path for f in files]
        for f, e in zip(files, entries):
            assert hashlib.sha256(f.text.encode()).hexdigest() == e["sha256"]
            assert len(f.text.encode()) == e["bytes"]
            # Held out by the documented rule: the path hash falls in this split's bucket.
            assert corpus.HELD_OUT[int(corpus.path_fraction(f.path) / fraction)] == name
        assert not seen & {f.path for f in files}
        seen |= {f.path for f in files}
    assert total <= 5_000_000
    assert manifest["python_version"].count(".") == 2

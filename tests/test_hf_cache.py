"""Models from the local Hugging Face cache: a snapshot folder (symlinks into blobs) or
ORG/NAME, never downloaded."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from bitformat.cli import main
from bitformat.container import convert, open_model
from bitformat.errors import BitformatIOError
from bitformat.io.hf_cache import cache_dir, cache_repo_name, resolve


@pytest.fixture(scope="module")
def hub(tiny_gguf, tmp_path_factory):
    """A hub cache holding models--bitformat--tiny at commit abc123 (files as blob links)."""
    root = tmp_path_factory.mktemp("hub")
    export = root / "export"
    convert(tiny_gguf, export, "hf")
    repo = root / "models--bitformat--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(export.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        f.rename(blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return root, snap


def test_resolve(hub, monkeypatch, tmp_path):
    root, snap = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    assert cache_dir() == root
    assert resolve("bitformat/tiny") == snap
    assert cache_repo_name(snap) == "tiny"
    with pytest.raises(BitformatIOError, match="not in the Hugging Face cache.*does not "
                       "download"):
        resolve("bitformat/absent")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "hub"


def test_open_and_cli(hub, monkeypatch, tmp_path):
    root, snap = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    with open_model(snap) as a, open_model("bitformat/tiny") as b:
        assert [e.name for e in a.entries] == [e.name for e in b.entries]
        name = next(e.name for e in a.entries if e.ternary)
        assert a.ternary(name).equals(b.ternary(name))
    r = CliRunner().invoke(main, ["inspect", "--json", "bitformat/tiny"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["architecture"] == "bitnet-b1.58"
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["convert", "bitformat/tiny", "--to", "q2_0"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "tiny.q2_0.gguf").is_file()  # next to us, not inside the cache
    r = CliRunner().invoke(main, ["inspect", "bitformat/absent"])
    assert r.exit_code != 0 and "not in the Hugging Face cache" in r.output

"""numba's cached kernels are dropped when any source file of the cpu package changes
(runtime/cpu/kernel_cache.py): a kernel that inlines a sibling file's code must not outlive it."""

from __future__ import annotations

from bitformat.runtime.cpu import kernel_cache as KC


def _cached(folder):
    return sorted(p.name for p in (folder / "__pycache__").glob("*.nb*"))


def test_a_change_in_any_source_drops_every_cached_kernel(tmp_path):
    (tmp_path / "amx.py").write_text("X = 1\n")
    (tmp_path / "decode.py").write_text("Y = 2\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()

    def fake_cache():
        for n in ("decode.decode_rows-1.py311.nbi", "decode.decode_rows-1.py311.1.nbc"):
            (cache / n).write_bytes(b"compiled")

    fake_cache()
    assert KC.check(tmp_path)  # no digest yet: whatever was cached may be stale
    assert _cached(tmp_path) == []
    fake_cache()
    assert not KC.check(tmp_path) and len(_cached(tmp_path)) == 2  # nothing changed: kept
    (tmp_path / "amx.py").write_text("X = 3\n")  # a sibling of decode.py changes
    assert KC.check(tmp_path) and _cached(tmp_path) == []
    fake_cache()
    assert not KC.check(tmp_path) and len(_cached(tmp_path)) == 2
    (tmp_path / "new.py").write_text("")  # a file added counts too
    assert KC.check(tmp_path) and _cached(tmp_path) == []


def test_a_change_in_the_codecs_drops_the_backend_kernels(tmp_path):
    """The cpu kernels inline the codecs' rANS step: a codec change clears both folders."""
    cpu, codecs = tmp_path / "cpu", tmp_path / "codecs"
    for d, name in ((cpu, "rans.py"), (codecs, "rans_decode.py")):
        d.mkdir()
        (d / name).write_text("X = 1\n")
        (d / "__pycache__").mkdir()
    compiled = (cpu / "__pycache__" / "rans.rans_mv-1.py311.nbi",
                codecs / "__pycache__" / "rans_decode._step-1.py311.nbi")
    KC.check(cpu, codecs)
    for f in compiled:
        f.write_bytes(b"compiled")
    assert not KC.check(cpu, codecs)
    (codecs / "rans_decode.py").write_text("X = 2\n")
    assert KC.check(cpu, codecs) and not any(f.exists() for f in compiled)


def test_unwritable_cache_is_left_alone(tmp_path):
    (tmp_path / "a.py").write_text("")
    (tmp_path / "__pycache__").write_text("not a folder")  # mkdir fails: no error, nothing done
    assert KC.check(tmp_path) is False


def test_the_package_digest_is_current_after_import():
    import bitformat.runtime.cpu  # noqa: F401  (runs the check)

    stamp = KC.HERE / "__pycache__" / KC.STAMP
    if stamp.is_file():  # (absent only where __pycache__ is not writable)
        assert stamp.read_text().strip() == KC.sources_digest()

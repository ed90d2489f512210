"""The wheel `pip install .` builds: its name, its files (package data included), its command.

The tracked files are copied to a temporary folder and built there without build isolation
(the test environment's setuptools, no download), so the checkout gets no build/ or egg-info.
"""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("setuptools < 77 cannot read an SPDX license expression")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    src = tmp_path_factory.mktemp("src")
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(src)], check=True, capture_output=True)
    (whl,) = out.glob("*.whl")
    assert whl.name.startswith("bitformat_ternary-")
    with zipfile.ZipFile(whl) as z:
        yield z


@pytest.mark.slow
def test_wheel_holds_the_package_and_its_data(wheel):
    names = set(wheel.namelist())
    want = {p.relative_to(ROOT).as_posix() for pattern in
            ("bitformat/**/*.py", "bitformat/data/*.json",
             "bitformat/runtime/wgpu/kernels/*.wgsl") for p in ROOT.glob(pattern)
            if "__pycache__" not in p.parts}
    assert any(n.endswith(".wgsl") for n in want) and any(n.endswith(".json") for n in want)
    assert want <= names, sorted(want - names)
    assert not [n for n in names if n.startswith(("tests/", "tools/", "docs/"))
                or "__pycache__" in n or n.endswith((".nbi", ".nbc"))]


@pytest.mark.slow
def test_wheel_metadata(wheel):
    meta_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    meta = email.message_from_bytes(wheel.read(meta_name))
    assert meta["Name"] == "bitformat-ternary"
    assert meta["License-Expression"] == "MIT"
    assert meta["Requires-Python"] == ">=3.10"
    entry = wheel.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    assert "bitformat = bitformat.cli:main" in entry

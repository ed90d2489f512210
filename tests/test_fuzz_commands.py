"""Fuzzing past the parsers (tools/fuzz_commands.py): structure-aware mutations of every
container and of hf folders through ``inspect``, ``convert`` and ``run`` on the cpu and numpy
backends, in worker processes under a memory cap. No case may end in a traceback, a signal,
a hang or an over-allocation. ``BITFORMAT_FUZZ_COMMAND_CASES`` sets how many (default 2000);
the cases that once found bugs (tests/fixtures/fuzz/corpus.json) run every time."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import fuzz_commands as fc  # noqa: E402

CASES = int(os.environ.get("BITFORMAT_FUZZ_COMMAND_CASES", "2000"))
CORPUS = json.loads((ROOT / "tests/fixtures/fuzz/corpus.json").read_text())["cases"]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzzbases")
    fc.build_bases(d)
    return d


def check(res: dict) -> None:
    bad = res["failures"]
    assert not bad, "\n".join(json.dumps(f) for f in bad[:10])
    assert all(res["figures"][f] == 0 for f in fc.FAILURES), res["figures"]


def test_corpus_of_cases_that_found_bugs(bases):
    res = fc.fuzz([c["case"] for c in CORPUS], workers=1, subprocess_every=0, base_dir=bases)
    check(res)
    assert res["figures"]["error"] + res["figures"]["ok"] == len(CORPUS)


def test_fuzz_commands(bases):
    res = fc.fuzz(list(range(fc.SCHEME_2, fc.SCHEME_2 + CASES)), workers=2, subprocess_every=50,
                  base_dir=bases)
    check(res)
    f = res["figures"]
    assert f["ok"] + f["error"] + f["skipped"] == CASES
    assert f["error"] > CASES // 5 and f["ok"] > CASES // 10, f  # the mutations bite, not all
    assert f["skipped"] < CASES // 20, f
    assert res["subprocess_cases"] >= CASES // 60
    for target in fc.TARGETS:  # every container and command was exercised
        for command in fc.COMMANDS:
            assert res["per_target_command"][f"{target} {command}"] >= CASES // 40


def test_classify():
    assert fc.classify(0, "", None) == "ok"
    assert fc.classify(1, "error: x.gguf: bad\n", None) == "error"
    assert fc.classify(1, "error: internal error (TypeError: x)\n", None) == "traceback"
    assert fc.classify(1, "error: out of memory (...)\n", None) == "over_allocation"
    assert fc.classify(1, "", KeyError("x")) == "traceback"
    assert fc.classify(-11, "", None) == "traceback"

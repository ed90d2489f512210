"""Every citation points inside the repository: links in the README and docs/, and the
``docs/...`` and ``tools/...`` paths that code and docs name, lead to files that exist here;
nothing cites material that is not part of the repository (the developers' notes)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SOURCES = [p for d in ("bitformat", "tools", "tests") for p in sorted((ROOT / d).rglob("*.py"))
           if p.name != "test_citations.py"]
#: a path the text names: docs/x.md, docs/formats/x.md, tools/x.py, bitformat/x/y.py
NAMED = re.compile(r"(?<![\w/.-])((?:docs|tools|bitformat)/[\w./-]+\.(?:md|py|json|wgsl))")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
OUTSIDE = re.compile(r"FORMATS\.md|shared/(?:research|seeds|data)|STYLE\.md")


def test_markdown_links_resolve():
    bad = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            if not (doc.parent / target).exists():
                bad.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not bad, bad


def test_named_paths_exist():
    bad = []
    for f in DOCS + SOURCES:
        for path in NAMED.findall(f.read_text(encoding="utf-8")):
            path = path.rstrip(".")
            if "*" in path or "<" in path:
                continue
            if not (ROOT / path).exists():
                bad.append(f"{f.relative_to(ROOT)} names {path}")
    assert not bad, bad


def test_nothing_cites_material_outside_the_repository():
    bad = [f"{f.relative_to(ROOT)}: {m.group(0)}" for f in DOCS + SOURCES
           for m in OUTSIDE.finditer(f.read_text(encoding="utf-8"))]
    assert not bad, bad

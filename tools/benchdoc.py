"""Shared by the benchmark scripts: rewrite one section of docs/benchmarks.md in place."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def replace_section(doc: Path, title: str, body: str) -> None:
    """Replace the ``## title`` section of ``doc`` with ``body`` (appended if missing)."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start = text.find(f"## {title}")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + text[end + 1:] if end >= 0 else text[:start]
    doc.write_text(text.rstrip() + "\n\n" + body.rstrip() + "\n")

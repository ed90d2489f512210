"""Shared by the benchmark scripts: rewrite one section of docs/benchmarks.md in place."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def host_cpu() -> str:
    """The host CPU's model name (/proc/cpuinfo), for a section to name; '?' if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        return "?"


def section_text(doc: Path, title: str) -> str:
    """The ``## title`` section of ``doc`` as it stands, up to the next ``## `` heading; ''
    if there is none."""
    text = doc.read_text() if doc.exists() else ""
    start = text.find(f"## {title}")
    if start < 0:
        return ""
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def section_tail(doc: Path, title: str) -> str:
    """The hand-written text of the ``## title`` section after its first table (with the
    blank line before it), so a tool that rewrites the table can keep it; '' if none."""
    lines = section_text(doc, title).split("\n")
    seen = False
    for i, line in enumerate(lines):
        if line.startswith("|"):
            seen = True
        elif seen:
            return "\n".join(lines[i:]).rstrip() + "\n"
    return ""


def replace_section(doc: Path, title: str, body: str, after: str | None = None) -> None:
    """Replace the ``## title`` section of ``doc`` with ``body`` (moved to the end, or appended
    if missing).

    With ``after``, the section is replaced where it stands, and a missing one goes right after
    the ``## after`` section, where that one exists and is not the last."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start = text.find(f"## {title}")
    if start >= 0 and after:
        end = text.find("\n## ", start + 1)
        if end >= 0:
            doc.write_text(text[:start] + body.rstrip() + "\n" + text[end:])
            return
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start] + text[end + 1:] if end >= 0 else text[:start]
    elif after and (at := text.find(f"## {after}")) >= 0:
        end = text.find("\n## ", at + 1)
        if end >= 0:
            doc.write_text(text[:end + 1] + body.rstrip() + "\n\n" + text[end + 1:])
            return
    doc.write_text(text.rstrip() + "\n\n" + body.rstrip() + "\n")

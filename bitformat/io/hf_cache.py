"""Where models come from: a path, a Hugging Face cache snapshot, or ``ORG/NAME`` in the cache.

The hub cache (``huggingface_hub``'s layout) keeps each repository as::

    <cache>/models--ORG--NAME/refs/main            the commit hash "main" points to
    <cache>/models--ORG--NAME/snapshots/<hash>/    the files, as symlinks into ../../blobs

``<cache>`` is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``.
:func:`resolve` never downloads: a repository that is not in the cache is a clear error
naming where it looked. A snapshot folder is an ordinary HF folder (its symlinks are read
through), sharded checkpoints included (``model.safetensors.index.json``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import BitformatIOError

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def cache_dir() -> Path:
    """The hub cache folder, by the environment as huggingface_hub reads it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text)) and ".." not in text


def resolve(source: str | os.PathLike) -> Path:
    """The file or folder ``source`` names: an existing path as it is, else ``ORG/NAME``
    resolved to its snapshot in the local cache (``refs/main``, or the only snapshot)."""
    p = Path(source).expanduser()
    if p.exists():
        return p
    text = str(source)
    if not is_repo_id(text):
        raise BitformatIOError(f"no such file or folder: {text}")
    org, name = text.split("/")
    repo = cache_dir() / f"models--{org}--{name}"
    if not repo.is_dir():
        raise BitformatIOError(
            f"{text} is not a file here and not in the Hugging Face cache ({repo} does not "
            "exist); bitformat does not download: fetch it with `huggingface-cli download "
            f"{text}` or pass a folder")
    snaps = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        if (snaps / commit).is_dir():
            return snaps / commit
    found = sorted(d for d in snaps.iterdir() if d.is_dir()) if snaps.is_dir() else []
    if len(found) == 1:
        return found[0]
    if not found:
        raise BitformatIOError(f"{text}: the cache holds no snapshot under {snaps}")
    raise BitformatIOError(f"{text}: the cache holds {len(found)} snapshots and refs/main "
                           f"names none of them; pass one folder of {snaps}")


def cache_repo_name(path: Path) -> str | None:
    """``NAME`` if ``path`` lies in a cache snapshot ``models--ORG--NAME/snapshots/<hash>``."""
    parts = path.resolve().parts if path.exists() else path.parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            return parts[i].split("--")[-1]
    for i in range(len(path.parts) - 2):  # the unresolved path (symlinked snapshots)
        if path.parts[i].startswith("models--") and path.parts[i + 1] == "snapshots":
            return path.parts[i].split("--")[-1]
    return None

"""The ``bitformat`` command: its commands (``main``), the interactive chat (``chat``) and what
they show while they work (``helpers``)."""

from __future__ import annotations

from .main import main

__all__ = ["main"]

"""``python -m bitformat.cli``: the ``bitformat`` command."""

from .main import main

main()

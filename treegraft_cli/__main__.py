"""``python -m treegraft_cli`` runs the CLI (same as the ``treegraft`` script)."""

from .cli import main

main()

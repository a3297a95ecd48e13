"""``python -m orchestrator.cli`` runs the command line."""

from orchestrator.cli import main

main()

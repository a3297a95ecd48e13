"""The ``--smoke`` form every benchmark takes: its smallest run through every row.

``python benchmarks/<name>.py --smoke`` runs the benchmark's smallest
configuration that still goes through the code of every row it reports (tiny
sizes, one round, the shortest windows), so that a broken row shows in seconds
instead of at the end of ``make bench``.  Its figures measure nothing: the run
says so on its first line, and its last stdout line, the JSON object every
benchmark ends with, carries ``"smoke": true``.  ``tests/benchmarks/test_smoke.py``
runs every benchmark this way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["HELP", "add_flag", "announce", "parse", "result_line"]

HELP = (
    "the smallest run through every row (tiny sizes, one round): checks that the "
    "benchmark runs; its figures are not measurements"
)


def add_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--smoke`` to a benchmark's arguments."""
    parser.add_argument("--smoke", action="store_true", help=HELP)


def announce(what: str) -> None:
    """Say, first, that this run is a smoke run and what it shrinks."""
    print(f"SMOKE RUN ({what}): no figure below is a measurement", flush=True)


def parse(
    parser: argparse.ArgumentParser, smoke: dict[str, Any], argv: Sequence[str] | None = None
) -> argparse.Namespace:
    """Parse a benchmark's arguments, ``--smoke`` added; with it, ``smoke`` (argument
    name -> value) replaces the defaults, so options given beside it still win.  A
    smoke run is announced before anything else is printed."""
    add_flag(parser)
    given = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" in given:
        parser.set_defaults(**smoke)
    args = parser.parse_args(given)
    if args.smoke:
        announce(", ".join(f"{k}={getattr(args, k)}" for k in smoke) or "as its docstring says")
    return args


def result_line(figures: dict[str, Any], smoke: bool, *, sort_keys: bool = False) -> str:
    """The benchmark's last line: ``figures`` as JSON, marked ``"smoke": true`` in a
    smoke run (and left as it was otherwise)."""
    return json.dumps({**figures, "smoke": True} if smoke else figures, sort_keys=sort_keys)

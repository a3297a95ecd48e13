"""Figures for people to read (status, reports): sizes in bytes."""

from __future__ import annotations

__all__ = ["size_text"]


def size_text(n: float) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 MiB``, up to GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

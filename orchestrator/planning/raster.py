"""A small rasterizer: line charts written as PNG with the standard library alone.

Enough for the plan's two curves: a white canvas, axes, polylines, dots, and
labels in a 3x5 pixel font (digits, capitals and a few signs), scaled up.
The PNG is 8-bit RGB, one IDAT chunk compressed with :mod:`zlib`.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

__all__ = ["Canvas", "line_chart_png"]

Color = tuple[int, int, int]

# each glyph: five rows of three pixels, '#' set
_FONT: dict[str, str] = {
    "0": "### #.# #.# #.# ###",
    "1": ".#. ##. .#. .#. ###",
    "2": "### ..# ### #.. ###",
    "3": "### ..# .## ..# ###",
    "4": "#.# #.# ### ..# ..#",
    "5": "### #.. ### ..# ###",
    "6": "### #.. ### #.# ###",
    "7": "### ..# ..# .#. .#.",
    "8": "### #.# ### #.# ###",
    "9": "### #.# ### ..# ###",
    ".": "... ... ... ... .#.",
    "%": "#.# ..# .#. #.. #.#",
    "-": "... ... ### ... ...",
    " ": "... ... ... ... ...",
    "/": "..# ..# .#. #.. #..",
    "(": ".#. #.. #.. #.. .#.",
    ")": ".#. ..# ..# ..# .#.",
    ":": "... .#. ... .#. ...",
    "A": ".#. #.# ### #.# #.#",
    "B": "##. #.# ##. #.# ##.",
    "C": ".## #.. #.. #.. .##",
    "D": "##. #.# #.# #.# ##.",
    "E": "### #.. ##. #.. ###",
    "F": "### #.. ##. #.. #..",
    "G": ".## #.. #.# #.# .##",
    "H": "#.# #.# ### #.# #.#",
    "I": "### .#. .#. .#. ###",
    "J": "..# ..# ..# #.# .#.",
    "K": "#.# #.# ##. #.# #.#",
    "L": "#.. #.. #.. #.. ###",
    "M": "#.# ### ### #.# #.#",
    "N": "##. #.# #.# #.# #.#",
    "O": ".#. #.# #.# #.# .#.",
    "P": "##. #.# ##. #.. #..",
    "Q": ".#. #.# #.# ##. .##",
    "R": "##. #.# ##. #.# #.#",
    "S": ".## #.. .#. ..# ##.",
    "T": "### .#. .#. .#. .#.",
    "U": "#.# #.# #.# #.# ###",
    "V": "#.# #.# #.# #.# .#.",
    "W": "#.# #.# ### ### #.#",
    "X": "#.# #.# .#. #.# #.#",
    "Y": "#.# #.# .#. .#. .#.",
    "Z": "### ..# .#. #.. ###",
}


class Canvas:
    """An RGB image in memory."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def dot(self, x: int, y: int, color: Color, size: int = 1) -> None:
        for dy in range(size):
            for dx in range(size):
                px, py = x + dx - size // 2, y + dy - size // 2
                if 0 <= px < self.width and 0 <= py < self.height:
                    i = (py * self.width + px) * 3
                    self.pixels[i : i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """Bresenham's line, ``width`` pixels thick."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.dot(x0, y0, color, width)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color = (0, 0, 0), scale: int = 2) -> None:
        """``text`` (upper-cased; unknown characters as blanks) with its top left at x, y."""
        for n, char in enumerate(text.upper()):
            rows = _FONT.get(char, _FONT[" "]).split()
            for row, bits in enumerate(rows):
                for col, bit in enumerate(bits):
                    if bit != "#":
                        continue
                    left, top = x + n * 4 * scale + col * scale, y + row * scale
                    for k in range(scale * scale):
                        self.dot(left + k % scale, top + k // scale, color)

    def png(self) -> bytes:
        raw = b"".join(
            b"\x00" + bytes(self.pixels[y * self.width * 3 : (y + 1) * self.width * 3])
            for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def _label(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _panel(
    canvas: Canvas,
    box: tuple[int, int, int, int],
    title: str,
    xlabel: str,
    points: Sequence[tuple[float, float]],
    marked: float | None,
) -> None:
    """One chart inside ``box`` (left, top, right, bottom); y is a share, shown in %."""
    gray, ink, blue, red = (200, 200, 200), (40, 40, 40), (31, 119, 180), (214, 39, 40)
    left, top, right, bottom = box
    canvas.text(left, 12, title, ink)
    canvas.text(left + (right - left) // 2 - len(xlabel) * 4, bottom + 30, xlabel, ink)
    if not points:
        return
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 0.01
    pad = (y1 - y0) * 0.08
    y0, y1 = max(0.0, y0 - pad), min(1.0, y1 + pad)  # a share: never below 0 % or above 100 %
    if y1 <= y0:
        y0, y1 = max(0.0, y1 - 0.01), min(1.0, y0 + 0.01)

    def at(x: float, y: float) -> tuple[int, int]:
        px = left + round((x - x0) / (x1 - x0) * (right - left))
        return px, bottom - round((y - y0) / (y1 - y0) * (bottom - top))

    canvas.line(left, bottom, right, bottom, ink)
    canvas.line(left, top, left, bottom, ink)
    for frac in (0.0, 0.5, 1.0):
        yv = y0 + frac * (y1 - y0)
        _, py = at(x0, yv)
        canvas.line(left + 1, py, right, py, gray)
        canvas.text(left - 64, py - 5, f"{yv * 100:.2f}%", ink)
    for xv in (x0, x1):
        px, _ = at(xv, y0)
        canvas.text(px - 8, bottom + 8, _label(xv), ink)
    if marked is not None:
        px, _ = at(marked, y0)
        canvas.line(px, top, px, bottom, red)
    previous = None
    for x, y in points:
        here = at(x, y)
        if previous is not None:
            canvas.line(*previous, *here, blue, 2)
        canvas.dot(*here, blue, 6)
        previous = here


def line_chart_png(
    panels: Sequence[tuple[str, str, Sequence[tuple[float, float]], float | None]],
    width: int = 960,
    height: int = 380,
) -> bytes:
    """Side-by-side line charts as PNG bytes.

    Args:
        panels: ``(title, x label, points, marked x)`` per panel; y is a share, shown in %.
    """
    canvas = Canvas(width, height)
    pw = width // max(1, len(panels))
    for i, (title, xlabel, points, marked) in enumerate(panels):
        box = (i * pw + 70, 40, (i + 1) * pw - 20, height - 60)
        _panel(canvas, box, title, xlabel, points, marked)
    return canvas.png()

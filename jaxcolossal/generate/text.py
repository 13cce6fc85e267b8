"""Text helpers of the samplers."""

from __future__ import annotations


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters other than newline and tab (the raw
    bytes a barely trained byte-level model emits) are shown as ``\\xNN`` escapes."""
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}" for c in text)

"""Text that others wrote, made safe to print on a person's terminal: the one escaping function.

What an engine printed, what the agent wrote in its status file, what a held verdict says: any of it may carry
escape sequences that set a terminal's title, clear its screen or write its clipboard (OSC 52), and whoever runs
``meridian-node logs``, ``status`` or ``gpu-health`` would run them. ``escape_text`` turns every byte a terminal
could act on into visible text; every output that shows such text goes through it (the ``logs`` verb, ``status``,
``gpu-health``, the agent's text-format log lines).

The rules (docs/LOGS.md, "Escaped output"). The escaped text spells out bytes: the UTF-8 of the text, where a
lone surrogate made by ``surrogateescape`` (U+DC80..U+DCFF) stands for the byte that was not UTF-8.

- Printable characters, tab, and (unless ``one_line``) newline are kept as they are.
- Every other C0 control (U+0000..U+001F: ESC, BEL, carriage return, backspace ...), DEL (U+007F) and every C1
  control (U+0080..U+009F: 0x9b CSI, 0x9d OSC ...) is written as its UTF-8 bytes, each as ``\\xNN`` (two
  lowercase hex digits): ESC is ``\\x1b``, U+009B is ``\\xc2\\x9b``.
- A byte that was not valid UTF-8 is ``\\xNN`` too (0xff is ``\\xff``), and so is each byte of any other lone
  surrogate (``surrogatepass``'s bytes): the output is always valid UTF-8 with no control in it.
- A backslash is written ``\\\\`` when the character after it is a backslash, an ``x`` or a character that is
  escaped; otherwise it stays one backslash. So ``\\x1b`` in the output is always an escape and never text the
  engine printed (that would be ``\\\\x1b``), while a backslash in ordinary text (``C:\\models``, JSON's ``\\"``)
  reads as written.

``unescape_text`` reverses it, to the bytes: the transformation loses nothing and cannot be confused.
"""

from __future__ import annotations

import re

__all__ = ["escape_text", "unescape_text"]

# Kept: tab (0x09) always, newline (0x0a) unless one_line. Everything else below 0x20, DEL, C1, and surrogates.
_UNSAFE = "\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff"
_MULTI_LINE = re.compile(f"\\\\(?=[\\\\x{_UNSAFE}])|[{_UNSAFE}]")
_ONE_LINE = re.compile(f"\\\\(?=[\\\\x\n{_UNSAFE}])|[\n{_UNSAFE}]")
_ESCAPED = re.compile(r"\\(\\|x[0-9a-f]{2})")
_SURROGATE_ESCAPE = range(0xDC80, 0xDD00)


def escape_text(text: str | bytes, *, one_line: bool = False) -> str:
    """``text`` with every control character, C1 character and invalid byte written visibly (the module's rules).

    Bytes are read as UTF-8, a byte that is not as ``\\xNN``. ``one_line`` escapes newlines too (``\\x0a``): for a
    value shown in a table row or a log line, which must not start a line of its own.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    return (_ONE_LINE if one_line else _MULTI_LINE).sub(_escape, text)


def unescape_text(text: str) -> bytes:
    """The bytes ``escape_text`` spelled out: ``\\xNN`` is that byte, ``\\\\`` a backslash, the rest is UTF-8."""
    out = bytearray()
    position = 0
    for found in _ESCAPED.finditer(text):
        out += text[position : found.start()].encode("utf-8", "surrogateescape")
        escaped = found.group(1)
        out += b"\\" if escaped == "\\" else bytes([int(escaped[1:], 16)])
        position = found.end()
    out += text[position:].encode("utf-8", "surrogateescape")
    return bytes(out)


def _escape(found: re.Match[str]) -> str:
    character = found.group()
    if character == "\\":
        return "\\\\"
    code = ord(character)
    if code in _SURROGATE_ESCAPE:
        return f"\\x{code - 0xDC00:02x}"
    return "".join(f"\\x{byte:02x}" for byte in character.encode("utf-8", "surrogatepass"))

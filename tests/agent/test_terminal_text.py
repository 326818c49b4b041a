"""``terminal_text.escape_text``: what reaches a person's terminal from text others wrote. A table of what engines
(and a compromised agent) print, then the two properties that make it safe: nothing a terminal acts on survives,
and the escaped text is unambiguous (``unescape_text`` gives back every byte, for every string of a small
alphabet that holds every hard case)."""

from __future__ import annotations

import itertools

import pytest

from meridian_node_agent.terminal_text import escape_text, unescape_text

# What a terminal may act on: C0 but tab and newline, DEL, C1, and any surrogate (not text at all).
FORBIDDEN = {chr(code) for code in [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]}

ROWS = [
    ("plain text", "loading model tiny", "loading model tiny"),
    ("non-ASCII text stays", "température 80 °C — ok ✓", "température 80 °C — ok ✓"),
    ("tab stays", "a\tb", "a\tb"),
    ("ESC", "\x1b", r"\x1b"),
    ("CSI clear screen", "\x1b[2J\x1b[H", r"\x1b[2J\x1b[H"),
    ("OSC 0 window title, BEL-ended", "\x1b]0;pwned\x07", r"\x1b]0;pwned\x07"),
    ("OSC 0 window title, ST-ended", "\x1b]0;pwned\x1b\\", r"\x1b]0;pwned\x1b" + "\\"),
    ("OSC 52 clipboard write", "\x1b]52;c;cm0gLXJmIC8K\x07", r"\x1b]52;c;cm0gLXJmIC8K\x07"),
    ("BEL", "ding\x07", r"ding\x07"),
    ("NUL, backspace, carriage return", "ok\x00\x08\r", r"ok\x00\x08\x0d"),
    ("DEL", "a\x7fb", r"a\x7fb"),
    ("C1 CSI U+009B as text", "\x9b2J", r"\xc2\x9b2J"),
    ("C1 OSC U+009D as text", "\x9d0;t\x9c", r"\xc2\x9d0;t\xc2\x9c"),
    ("C1 next line U+0085", "a\x85b", r"a\xc2\x85b"),
    ("C1 CSI 0x9b as a raw byte", b"\x9b2J", r"\x9b2J"),
    ("C1 OSC 0x9d as a raw byte", b"\x9d0;t\x07", r"\x9d0;t\x07"),
    ("invalid UTF-8 byte", b"bad \xff here", r"bad \xff here"),
    ("truncated UTF-8 sequence", b"\xe2\x82", r"\xe2\x82"),
    ("overlong encoding of ESC", b"\xc0\x9b", r"\xc0\x9b"),
    ("UTF-8 of a surrogate", b"\xed\xa0\x80", r"\xed\xa0\x80"),
    ("valid UTF-8 bytes decode", "é€".encode(), "é€"),
    ("a lone surrogate in text", "\ud800", r"\xed\xa0\x80"),
    ("surrogateescape byte in text", "\udcff", r"\xff"),
    ("a backslash in prose stays single", r"C:\models\tiny", r"C:\models\tiny"),
    ("JSON's escaped quote stays", r'{"msg": "a \"b\""}', r'{"msg": "a \"b\""}'),
    ("a backslash before x is doubled", r"\x1b printed as text", r"\\x1b printed as text"),
    ("a backslash before a backslash is doubled", "\\\\", "\\\\\\"),
    ("a backslash before an escaped character is doubled", "\\\x1b", r"\\\x1b"),
    ("a backslash at the end stays", "end\\", "end\\"),
]


@pytest.mark.parametrize(("text", "shown"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_each_case_is_shown_as_the_table_says(text: str | bytes, shown: str) -> None:
    assert escape_text(text) == shown
    assert unescape_text(shown) == (text if isinstance(text, bytes) else _bytes(text))


def test_newlines_stay_in_text_and_are_escaped_on_one_line() -> None:
    assert escape_text("first\nsecond") == "first\nsecond"
    assert escape_text("first\nnode  forged", one_line=True) == r"first\x0anode  forged"
    assert escape_text("a\\\nb", one_line=True) == r"a\\\x0ab"


def test_nothing_a_terminal_acts_on_survives_any_byte() -> None:
    every_byte = bytes(range(256))
    for text in (every_byte, every_byte.decode("latin-1"), "".join(map(chr, range(0x2000))), "\ud800\udbff\udfff"):
        shown = escape_text(text, one_line=True)
        assert not FORBIDDEN & set(shown)
        shown.encode("utf-8")  # strict: valid UTF-8, no surrogate left


# Every hard case in one alphabet: a backslash, the letter x, hex digits, ESC, a C1 character, a byte that was not
# UTF-8 (surrogateescape), a lone surrogate, newline, and plain letters.
ALPHABET = ["\\", "x", "1", "b", "\x1b", "\x9b", "\udcff", "\ud800", "\n", "a"]


@pytest.mark.parametrize("one_line", [False, True], ids=["text", "one-line"])
def test_the_escaping_is_unambiguous_for_every_short_string(one_line: bool) -> None:
    seen: dict[str, str] = {}
    for length in range(6):
        for letters in itertools.product(ALPHABET, repeat=length):
            text = "".join(letters)
            shown = escape_text(text, one_line=one_line)
            assert seen.setdefault(shown, text) == text, f"{text!r} and {seen[shown]!r} both show as {shown!r}"
            assert unescape_text(shown) == _bytes(text), text


def _bytes(text: str) -> bytes:
    return b"".join(
        letter.encode("utf-8", "surrogateescape" if letter == "\udcff" else "surrogatepass") for letter in text
    )

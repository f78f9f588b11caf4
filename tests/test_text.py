"""The one rule for outside text that is printed or written (llamarig.tables.text.printable):
nothing a terminal obeys or a reader misreads gets through, and nothing is lost."""

import ast
import unicodedata

from hypothesis import given, settings
from hypothesis import strategies as st

from llamarig.tables.text import printable


def _shown_raw(character: str) -> bool:
    """What may reach a terminal as it is: printable characters and the plain space."""
    return character.isprintable()


def test_escape_sequences_and_line_breaks_are_shown_not_obeyed():
    assert printable("gpu\x1b[2J\x1b]0;pwned\x07") == "gpu\\x1b[2J\\x1b]0;pwned\\x07"
    assert printable("line\nforged: yes") == "line\\nforged: yes"
    assert printable("a\u2028b\u0085c") == "a\\u2028b\\x85c"


def test_format_characters_and_odd_spaces_are_escaped():
    assert printable("evil\u202egguf.exe") == "evil\\u202egguf.exe"
    assert printable("zero\u200bwidth\u00a0space") == "zero\\u200bwidth\\xa0space"
    assert printable("\x00") == "\\x00"


def test_plain_text_is_kept_as_it_is():
    for text in ("NVIDIA GeForce RTX 3090", "Debian GNU/Linux 12 (bookworm)", "é ü 中文", ""):
        assert printable(text) == text
    assert printable(24576) == "24576"


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.text())
def test_no_unprintable_character_survives_and_nothing_is_lost(text):
    shown = printable(text)
    assert all(_shown_raw(character) for character in shown), ascii(shown)
    # Escaped as repr escapes, so repr's own reading gives back the text, unless the text held
    # a backslash of its own (kept as it is: it is printable).
    if "\\" not in text and "'" not in text:
        assert ast.literal_eval(f"'{shown}'") == text
    for character in text:
        if unicodedata.category(character) in ("Cc", "Cf", "Zl", "Zp"):
            assert character not in shown

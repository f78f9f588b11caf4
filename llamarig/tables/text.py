"""Text from outside llamarig made safe to print or write: the one rule for every value from
rig data, a lock, a tuned file or a probed box that reaches a terminal, a log line or a file.

A terminal obeys escape sequences (ESC [ ... moves the cursor, rewrites lines, sets the window
title), a bidi override (U+202E) reorders what the reader sees, and a line break in a value
forges a line of its own in a log or a YAML entry. So control and format characters, and every
space and line break but the plain space, are shown escaped as Python's ``repr`` shows them
(``\\x1b``, ``\\n``, ``\\u202e``): the reader sees what is there, and nothing is lost.

**Example:**

.. code:: python

    printable("gpu\\x1b[2J")  # 'gpu\\\\x1b[2J': the escape is shown, not obeyed
"""

from __future__ import annotations


def printable(text: object) -> str:
    """``text`` (made a string) with every character that is not printable escaped as
    ``repr`` escapes it; printable characters, the plain space included, are kept as they are.
    The value must be decoded first (percent-decoding, YAML escapes): escaping the encoded
    form lets the decoded one through."""
    value = str(text)
    if value.isprintable():
        return value
    return "".join(
        character if character.isprintable() else repr(character)[1:-1] for character in value
    )

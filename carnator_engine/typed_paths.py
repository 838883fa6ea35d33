"""Paths and URLs as people type them (node inputs, the command line, the web routes), torch-free: a control
character in one is a slip of typing or pasting, refused before any folder is made."""
from __future__ import annotations

import unicodedata


def control_character(text: str) -> str:
    """Why `text` cannot be a path or URL, as a phrase to follow the input's name: its first control character (C0,
    DEL or C1: a newline, a tab, a NUL, ...) and where it stands; "" when it holds none. Filesystems take all of them
    but NUL, so a folder would be made under a name no one can type again; none is accepted."""
    for position, char in enumerate(text):
        if unicodedata.category(char) == "Cc":
            return (f"holds the control character {char!r} (U+{ord(char):04X}) at character {position + 1}, which "
                    "no path or URL holds: retype it")
    return ""

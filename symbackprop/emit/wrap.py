"""Long lines of generated text cut at a fixed width, the same way each time.

A kernel's comment states its math; a large map's can run to hundreds of
characters (gmm's gradient, 691), and so can its LaTeX in derivation.md.
Such a line is wrapped at WIDTH columns: a C comment continues on lines that
begin with ` * `, a Markdown list item's equation on lines indented into the
item (whitespace inside LaTeX math is not significant). Lines are cut at
spaces, and a word longer than a line after `*`, `,` or `(`; a comment longer
than MAX_COMMENT_LINES lines ends in `...` (the C below it says the rest).
"""

from __future__ import annotations

import re

WIDTH = 100
MAX_COMMENT_LINES = 6
_COMMENT = re.compile(r"^(?P<indent> *)/\* (?P<text>.*) \*/$")
_EQUATION = re.compile(r"^(?P<item>\d+\. )(?P<text>\$\$.*\$\$)$")
_CUT_AFTER = re.compile(r"(?<=[*,(])")


def _words(text: str, room: int) -> list[str]:
    """The text's words, each with the space before it, a word longer than
    `room` cut after its `*`, `,` or `(` (the pieces join without a space)."""
    words: list[str] = []
    for number, word in enumerate(_split_outside_brackets(text)):
        space = " " if number else ""
        if len(word) <= room:
            words.append(space + word)
            continue
        piece = space
        for part in _CUT_AFTER.split(word):
            if len(piece) + len(part) > room and piece.strip():
                words.append(piece)
                piece = ""
            piece += part
        words.append(piece)
    return words


def _split_outside_brackets(text: str) -> list[str]:
    """`text` split at its spaces that are not inside an index (the `[i, 0]`
    of "X[i, 0]", which follows a name; a list's `[` does not)."""
    words, start, stack = [], 0, []
    for at, ch in enumerate(text):
        if ch == "[":
            stack.append(at > 0 and (text[at - 1].isalnum() or text[at - 1] in "_]"))
        elif ch == "]" and stack:
            stack.pop()
        elif ch == " " and not any(stack):
            words.append(text[start:at])
            start = at + 1
    return words + [text[start:]]


def wrap(text: str, first: int, rest: int) -> list[str]:
    """`text` as lines of at most `first` (the first) and `rest` characters
    (longer only where a word cannot be cut); a line does not begin with the
    space it was cut at."""
    lines: list[str] = []
    line, room = "", first
    for word in _words(text, min(first, rest)):
        if line and len(line) + len(word) > room:
            lines.append(line)
            line, room = word.lstrip(" "), rest
        else:
            line += word
    lines.append(line)
    return lines


def wrap_c_comments(source: str, width: int = WIDTH) -> str:
    """Every one-line `/* ... */` comment of the C source longer than
    `width` columns, wrapped (and abbreviated past MAX_COMMENT_LINES)."""
    out = []
    for line in source.split("\n"):
        match = _COMMENT.match(line)
        if len(line) <= width or match is None or "*/" in match["text"]:
            out.append(line)
            continue
        indent = match["indent"]
        room = width - len(indent) - len("/*  ... */")  # the most a line may need besides its text
        lines = wrap(match["text"], room, room)
        if len(lines) > MAX_COMMENT_LINES:
            lines = lines[:MAX_COMMENT_LINES]
            lines[-1] = lines[-1] + " ..."
        lines[-1] += " */"
        out.append(f"{indent}/* {lines[0]}")
        out.extend(f"{indent} * {rest}" for rest in lines[1:])
    return "\n".join(out)


def wrap_markdown_equations(text: str, width: int = WIDTH) -> str:
    """Every `1. $$...$$` line of a Markdown list longer than `width`,
    continued on lines indented under the item's text."""
    out = []
    for line in text.split("\n"):
        match = _EQUATION.match(line)
        if len(line) <= width or match is None:
            out.append(line)
            continue
        indent = " " * len(match["item"])
        lines = wrap(match["text"], width - len(indent), width - len(indent))
        out.append(match["item"] + lines[0])
        out.extend(indent + rest for rest in lines[1:])
    return "\n".join(out)


def wrap_c_code(source: str, width: int = WIDTH) -> str:
    """Every line of C code longer than `width` columns: a call of three or
    more arguments (a statement `f(...);`, `return f(...);` or `x = f(...);`)
    one argument a line, like a function's head of many parameters, so that
    an argument added or renamed changes its own line and not the lines
    after it; another long line (an expression) continued on lines indented
    8 columns deeper, cut at spaces outside an index. C reads whitespace
    alike, so the code means the same. Preprocessor lines, comments of
    their own and lines with a string stay whole (the generated C has no
    character literals)."""
    out: list[str] = []
    for line in source.split("\n"):
        text = line.lstrip(" ")
        if len(line) <= width or text.startswith(("#", "/*", "*", "//")) or line.endswith("\\") \
                or '"' in line or "//" in line:
            out.append(line)
            continue
        indent = line[:len(line) - len(text)]
        call = _call(text)
        if call is not None:
            head, args = call
            out.append(f"{indent}{head}(")
            for number, arg in enumerate(args):
                out.extend(_flowed(f"{indent}    {arg}{',' if number < len(args) - 1 else ''}", width))
            out.append(f"{indent});")
            continue
        out.extend(_flowed(line, width))
    return "\n".join(out)


def _flowed(line: str, width: int) -> list[str]:
    """The line, if longer than `width`, continued on lines 8 columns deeper."""
    if len(line) <= width:
        return [line]
    text = line.lstrip(" ")
    indent = line[:len(line) - len(text)]
    lines = wrap(text, width - len(indent), width - len(indent) - 8)
    return [indent + lines[0], *(f"{indent}        {rest}" for rest in lines[1:])]


_CALLEE = re.compile(r"(?:return |[\w *]+ = )?[A-Za-z_]\w*")


def _call(text: str) -> tuple[str, list[str]] | None:
    """(what comes before its `(`, its arguments) where `text` is one call
    statement of three or more arguments, else None."""
    start = text.find("(")
    if start < 0 or not text.endswith(");") or _CALLEE.fullmatch(text[:start]) is None:
        return None
    args, depth, begin = [], 0, start + 1
    for at in range(start, len(text) - 1):
        ch = text[at]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0 and at != len(text) - 2:
                return None  # its `(` closes before the end: not one call
        elif ch == "," and depth == 1:
            args.append(text[begin:at].strip())
            begin = at + 1
    args.append(text[begin:len(text) - 2].strip())
    return (text[:start], args) if depth == 0 and len(args) >= 3 else None

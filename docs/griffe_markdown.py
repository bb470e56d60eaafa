"""A griffe extension for the API reference (mkdocs.yml loads it): the docstrings are plain
text written for `help()`, so before Markdown reads them, doctest examples become code blocks
and index expressions such as `rows[k][i]` stay text rather than reference-style links."""

from __future__ import annotations

import re

import griffe

_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK_PAIR = re.compile(r"\]( ?)\[")  # [text][label] or [text] [label]


def _escape_brackets(line: str) -> str:
    """`][` and `] [` outside code spans as `]\\[`, so Markdown reads no `[text][label]`
    link."""
    parts, last = [], 0
    for match in _CODE_SPAN.finditer(line):
        parts.append(_LINK_PAIR.sub(r"]\1\\[", line[last:match.start()]))
        parts.append(match.group(0))
        last = match.end()
    parts.append(_LINK_PAIR.sub(r"]\1\\[", line[last:]))
    return "".join(parts)


def markdown_docstring(text: str) -> str:
    """Doctest runs (a `>>>` line up to the next blank line) fenced as `pycon`; the rest with
    its `][` escaped. Indented blocks are left alone (Markdown shows them as code)."""
    out, in_doctest = [], False
    for line in text.split("\n"):
        if not in_doctest and line.lstrip().startswith(">>>"):
            out.append("```pycon")
            in_doctest = True
        elif in_doctest and not line.strip():
            out.append("```")
            in_doctest = False
        out.append(line if in_doctest or line.startswith("    ") else _escape_brackets(line))
    if in_doctest:
        out.append("```")
    return "\n".join(out)


class MarkdownDocstrings(griffe.Extension):
    """Rewrites every loaded object's docstring with `markdown_docstring`."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)

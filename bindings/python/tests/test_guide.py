"""The guide's chapter "In-process in Python" (docs/src/python.md): every ```python block runs
against the installed package (the Django settings block is executed as a settings module is
read), and the first prints what the chapter says."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "src" / "python.md"


def blocks() -> list[tuple[int, str]]:
    found, lines, i = [], PAGE.read_text().split("\n"), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            found.append((start + 1, "\n".join(body)))
        i += 1
    return found


def test_every_block_of_the_chapter_runs() -> None:
    found = blocks()
    assert len(found) >= 4
    for line, text in found:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(text, f"docs/src/python.md:{line}", "exec"), {"__name__": "guide"})
        for shown in (l[2:] for l in text.split("\n") if l.startswith("# [")):
            assert out.getvalue().strip() == shown, (line, out.getvalue())

"""The guide's pages of pytollgate: "In-process in Python" (docs/src/python.md), "From
slowapi" and "From django-ratelimit" (docs/src/migrate): every ```python block runs against
the installed package (the Django settings block is executed as a settings module is read;
the migration pages' views with Django set up), and what a block prints is what its
``# [...`` / ``# {...`` lines say. Their "before" blocks (```python,ignore) are the other
packages' code, not run."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "src" / "python.md"
MIGRATIONS = [ROOT / "docs" / "src" / "migrate" / page for page in ("slowapi.md", "django-ratelimit.md")]


def blocks(page: Path = PAGE) -> list[tuple[int, str]]:
    found, lines, i = [], page.read_text().split("\n"), 0
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


def run(page: Path, line: int, text: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(text, f"{page.relative_to(ROOT)}:{line}", "exec"), {"__name__": "guide"})
    shown = [l[2:] for l in text.split("\n") if l.startswith(("# [", "# {"))]
    if shown:
        assert out.getvalue().strip() == "\n".join(shown), (page.name, line, out.getvalue())


def test_every_block_of_the_chapter_runs() -> None:
    found = blocks()
    assert len(found) >= 4
    for line, text in found:
        run(PAGE, line, text)


def test_every_after_of_the_migration_pages_runs() -> None:
    from test_middleware import django_settings

    django_settings()  # RequestFactory needs settings
    for page in MIGRATIONS:
        found = blocks(page)
        assert len(found) >= 2, page
        for line, text in found:
            run(page, line, text)

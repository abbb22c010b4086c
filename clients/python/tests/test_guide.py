"""The guide's Python (every ```python block of docs/src and of the README): each compiles and
names only what `tollgate_client` exports; the clients chapter's example runs against the
real binary and prints what the chapter says it prints."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from pathlib import Path

import tollgate_client
from servers import tollgate

ROOT = Path(__file__).resolve().parents[3]


def blocks() -> list[tuple[str, str]]:
    """Every ```python block: (page:line, text)."""
    found = []
    pages = [ROOT / "README.md", *sorted((ROOT / "docs" / "src").rglob("*.md"))]
    for page in pages:
        lines = page.read_text().split("\n")
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start, body = i + 1, []
                i += 1
                while i < len(lines) and not lines[i].strip().startswith("```"):
                    body.append(lines[i])
                    i += 1
                found.append((f"{page.relative_to(ROOT)}:{start + 1}", "\n".join(body)))
            i += 1
    return found


def test_every_python_block_compiles_and_imports_what_exists() -> None:
    found = blocks()
    assert len(found) >= 2, found
    for where, text in found:
        tree = ast.parse(text, where)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "tollgate_client":
                for alias in node.names:
                    assert hasattr(tollgate_client, alias.name), f"{where}: {alias.name}"


def test_the_clients_chapter_example_prints_what_it_says(tmp_path: Path) -> None:
    (where, text), = [b for b in blocks() if b[0].startswith("docs/src/clients.md")]
    shown = [line[2:] for line in text.split("\n") if line.startswith("# Decision")]
    assert shown[0].startswith("Decision(ok=True, retry_after=None), three times"), where
    # A server that defines no limit of its own: the example sends its config.
    with tollgate("", tmp_path) as server:
        code = text.replace("http://127.0.0.1:8787", server.url)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, where, "exec"), {})
    printed = out.getvalue().splitlines()
    assert printed[:3] == ["Decision(ok=True, retry_after=None)"] * 3, printed
    refused = re.fullmatch(r"Decision\(ok=False, retry_after=(\d+\.\d+)\)", printed[3])
    assert refused and 5_000 < float(refused.group(1)) <= 6_000, printed
    assert shown[1].startswith("Decision(ok=False, retry_after="), shown

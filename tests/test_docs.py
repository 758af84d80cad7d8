"""The docs' references hold: every ``docs/...`` path that README.md and docs/ name in prose exists, and every file
under docs/ is named somewhere (a results file nobody cites is a result nobody can find)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"```.*?```", re.S)
"""Command blocks: a path there is what a command writes (``--out docs/bench/seqS_0``), not a reference."""
PATH = re.compile(r"docs/[\w./*{},\-]*[\w*}]")
LINK = re.compile(r"\]\(([^)#\s]+)\)")
"""Markdown links and images, relative to the page."""


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def expand(path: str) -> list[str]:
    """``docs/x.{json,png}`` as both names."""
    match = re.search(r"\{([^}]*)\}", path)
    if match is None:
        return [path]
    return [n for part in match.group(1).split(",") for n in expand(path[: match.start()] + part + path[match.end():])]


def references() -> dict[str, Path]:
    """Each referenced path, relative to the repository (globs kept), and the page that names it first."""
    found: dict[str, Path] = {}
    for page in pages():
        prose = FENCE.sub("", page.read_text())
        named = [n for raw in PATH.findall(prose) for n in expand(raw)]
        for link in LINK.findall(prose):
            if not re.match(r"[a-z]+:", link):  # not a URL
                target = (page.parent / link).resolve()
                if target.is_relative_to(ROOT):
                    named.append(str(target.relative_to(ROOT)))
        for name in named:
            found.setdefault(name.rstrip("/."), page)
    return found


def test_every_docs_path_named_exists() -> None:
    missing = [f"{page.relative_to(ROOT)} names {name}" for name, page in references().items()
               if name.startswith("docs") and not any(ROOT.glob(name))]  # fmt: skip
    assert not missing, missing


def test_every_file_under_docs_is_named() -> None:
    named = [name for name in references() if name.startswith("docs")]
    unnamed = []
    for path in sorted(p for p in DOCS.rglob("*") if p.is_file()):
        rel = path.relative_to(ROOT)
        if not any(rel.match(name) or rel.is_relative_to(name) or rel.parent.match(name) for name in named):
            unnamed.append(str(rel))
    assert not unnamed, f"files under docs/ that README.md and docs/ never name: {unnamed}"

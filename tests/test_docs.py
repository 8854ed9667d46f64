"""The README stays a guide and the reference lives in docs/: the README's set-up commands are the ones CI runs,
it stays short, no paragraph runs long, every relative link in the repository's documents resolves, and the
docs site (mkdocs.yml) builds without a warning."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text().split("\n")
DOCS = sorted((ROOT / "docs").glob("*.md"))
# the documents a reader follows links through on GitHub: the README, the docs pages, the other READMEs
LINKED = [ROOT / "README.md", *DOCS, ROOT / "js" / "README.md", ROOT / "examples" / "browser" / "README.md",
          ROOT / "bench" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _paragraphs(lines: list[str]) -> list[tuple[int, int]]:
    """(first line, number of lines) of each paragraph outside code fences: consecutive non-blank lines."""
    out, inside, start = [], False, None
    for k, line in enumerate(lines + [""]):
        if line.startswith("```"):
            inside = not inside
        if inside or line.startswith("```") or not line.strip():
            if start is not None:
                out.append((start + 1, k - start))
                start = None
        elif start is None:
            start = k
    return out


def _outside_fences(text: str) -> list[str]:
    lines, inside = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """The anchor of a heading, as GitHub and Python-Markdown's toc both make it for plain headings."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _outside_fences(path.read_text()) if re.match(r"#{1,6} ", line)}


def _broken_links(path: Path) -> list[str]:
    broken = []
    for line in _outside_fences(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):             # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{target} (no such heading)")
    return broken


def test_the_readme_is_a_guide_of_at_most_300_lines():
    assert len(README) <= 300, f"README.md has {len(README)} lines: move reference material into docs/"


def test_no_paragraph_runs_over_15_lines():
    for path in [ROOT / "README.md", *DOCS]:
        long = [(first, n) for first, n in _paragraphs(path.read_text().split("\n")) if n > 15]
        assert not long, f"{path.relative_to(ROOT)}: paragraphs over 15 lines (first line, lines): {long}"


def test_the_paragraph_counter_can_fail():
    assert _paragraphs(["a", "b", "", "```", "c", "d", "e", "```", "f"]) == [(1, 2), (9, 1)]
    assert max(n for _, n in _paragraphs(["x"] * 16)) == 16


def test_ci_runs_the_readme_set_up_commands_word_for_word():
    fence = README.index("```bash")
    commands = [line for line in README[fence + 1:README.index("```", fence + 1)] if not line.startswith("#")]
    ci = (ROOT / ".ci" / "run").read_text()
    assert len(commands) == 2
    for command in commands:
        assert command in ci, command


def test_every_relative_link_resolves():
    broken = {str(p.relative_to(ROOT)): b for p in LINKED if p.exists() and (b := _broken_links(p))}
    assert not broken, broken


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Quick start: from PyTorch\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#quick-start-from-pytorch) [web](https://x.org/y) [here](#b)\n\n# B\n"
                    "[gone](c.md) [bad](a.md#quick-start)\n```\n[in a fence](d.md)\n```\n")
    assert _broken_links(page) == ["c.md (no such file)", "a.md#quick-start (no such heading)"]


def test_every_docs_page_is_in_the_site():
    nav = (ROOT / "mkdocs.yml").read_text()
    assert [p.name for p in DOCS if f" {p.name}" not in nav] == []


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (the test extra)")
def test_the_docs_site_builds_without_a_warning(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    log = run.stdout + run.stderr
    assert run.returncode == 0 and "WARNING" not in log, log
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert "TrainingSession" in reference and "Append the backward graph" in reference   # the docstrings

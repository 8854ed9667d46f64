"""The README stays a README: its set-up commands are the ones CI runs, and no paragraph runs long."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text().split("\n")


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


def test_no_readme_paragraph_runs_over_15_lines():
    long = [(first, n) for first, n in _paragraphs(README) if n > 15]
    assert not long, f"README paragraphs over 15 lines (first line, lines): {long}"


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

"""The Markdown files a reader gets (README.md, CONTRIBUTING.md, docs/*.md), read the way GitHub shows
them: their fenced blocks, their headings' anchors and their relative links."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
#: the info string's first word for the blocks a reader would paste into a shell
SHELL_LANGUAGES = frozenset({"bash", "sh", "console", "shell"})

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<info>[^`\n]*)$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target><[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\)")


#: one guide per reader: a new user, whoever writes GPU pods, placement, an operator, a contributor
READER_DOCS = ("README.md", "docs/usage.md", "docs/placement.md", "docs/operations.md", "CONTRIBUTING.md")


def doc_files() -> list[Path]:
    top = [ROOT / name for name in ("README.md", "CONTRIBUTING.md") if (ROOT / name).is_file()]
    return [*top, *sorted((ROOT / "docs").glob("*.md"))]


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


@dataclass(frozen=True, slots=True)
class Block:
    """A fenced block: ``language`` and ``labels`` are the words of its info string."""

    path: Path
    line: int  # of the opening fence, from 1
    language: str
    labels: tuple[str, ...]
    text: str

    def __str__(self) -> str:
        return where(self.path, self.line)


def blocks(path: Path) -> list[Block]:
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        words = opening["info"].split()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            body.append(lines[j].removeprefix(indent))
            j += 1
        if j == len(lines):
            raise AssertionError(f"{where(path, i + 1)}: a fenced block that never closes")
        language = words[0] if words else ""
        found.append(Block(path, i + 1, language, tuple(words[1:]), "\n".join(body) + "\n"))
        i = j + 1
    return found


def e2e_step(label: str) -> str | None:
    """The step of a block labelled ``e2e:STEP`` (run by tests/install), or None for another label."""
    kind, _, step = label.partition(":")
    return step if kind == "e2e" and step else None


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced blocks."""
    inside = {n for b in blocks(path) for n in range(b.line, b.line + b.text.count("\n") + 2)}
    return [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if n not in inside]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"`|\*\*?|__?", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: Path) -> list[tuple[int, int, str]]:
    """(line number, level, text) of each heading outside fenced blocks."""
    found = []
    for n, line in prose_lines(path):
        match = _HEADING.match(line)
        if match:
            found.append((n, len(match[1]), match[2]))
    return found


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, _, text in headings(path):
        base = slug(text)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of each link and image outside fenced blocks and code spans."""
    found = []
    for n, line in prose_lines(path):
        for match in _LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            found.append((n, match["target"].strip("<>")))
    return found


def section(path: Path, heading: str) -> str:
    """The text under ``heading`` (its exact text, at any level) up to the next heading of its level or
    higher."""
    lines = path.read_text().splitlines()
    marks = headings(path)
    for index, (n, level, text) in enumerate(marks):
        if text == heading:
            end = next((m for m, lv, _ in marks[index + 1 :] if lv <= level), len(lines) + 1)
            return "\n".join(lines[n : end - 1])
    raise AssertionError(f"{path.relative_to(ROOT)} has no heading {heading!r}")

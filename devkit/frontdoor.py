"""The front door measured (issue 41, "Measure"): a Markdown page's lines, words, average
sentence length and longest paragraph. ``python -m devkit.frontdoor [PAGE ...]`` prints them
(README.md by default); ``git show REV:README.md > old.md`` measures an older one.

Words are whitespace-separated tokens of the whole page. Sentences and paragraphs are counted
in its prose only: fenced code blocks, table rows and headings are left out, a paragraph is a
run of non-blank lines, and a sentence ends at ``.``, ``!`` or ``?`` before a space or the
paragraph's end (a paragraph with no such end is one sentence).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.MULTILINE | re.DOTALL)
_SENTENCE_END = re.compile(r"[.!?][)\"'*_`]*(?:\s+|$)")


@dataclass(frozen=True, slots=True)
class PageFigures:
    """What a newcomer meets on one page."""

    lines: int
    words: int
    sentences: int
    prose_words: int
    longest_paragraph_words: int

    @property
    def words_per_sentence(self) -> float:
        return self.prose_words / self.sentences if self.sentences else 0.0

    def __str__(self) -> str:
        return (
            f"{self.lines} lines, {self.words} words, {self.sentences} sentences averaging "
            f"{self.words_per_sentence:.1f} words, longest paragraph "
            f"{self.longest_paragraph_words} words"
        )


def paragraphs(text: str) -> list[str]:
    """The page's prose paragraphs, each joined onto one line."""
    prose = _FENCE.sub("", text)
    found = []
    for chunk in re.split(r"\n\s*\n", prose):
        lines = [
            line
            for line in chunk.splitlines()
            if line.strip() and not line.lstrip().startswith(("|", "#"))
        ]
        if lines:
            found.append(" ".join(line.strip() for line in lines))
    return found


def measure(text: str) -> PageFigures:
    """The figures of one page's text."""
    paras = paragraphs(text)
    sentences = sum(max(1, len(_SENTENCE_END.findall(p))) for p in paras)
    sizes = [len(p.split()) for p in paras]
    return PageFigures(
        lines=len(text.splitlines()),
        words=len(text.split()),
        sentences=sentences,
        prose_words=sum(sizes),
        longest_paragraph_words=max(sizes, default=0),
    )


def main(argv: list[str]) -> int:
    pages = [Path(a) for a in argv] or [ROOT / "README.md"]
    for page in pages:
        print(f"{page}: {measure(page.read_text(encoding='utf-8'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

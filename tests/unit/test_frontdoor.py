"""The front door's figures (devkit.frontdoor): prose only for sentences and paragraphs."""

from __future__ import annotations

from devkit.frontdoor import measure

PAGE = """# Title

One short sentence. Another one here!
It goes on (see `x.py`).

```
code block. with. dots. that are not prose.
```

| table | row. |
"""


def test_sentences_and_paragraphs_are_counted_in_the_prose_only() -> None:
    figures = measure(PAGE)
    assert figures.lines == 10
    assert figures.sentences == 3
    assert figures.prose_words == 11
    assert figures.longest_paragraph_words == 11
    assert figures.words_per_sentence == 11 / 3
    assert figures.words == len(PAGE.split())

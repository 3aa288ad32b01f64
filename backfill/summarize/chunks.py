"""A document too long for one prompt split into chunks that fit, every character kept.

A map step's prompt is the instruction around a chunk's text, and the model must still have
room for the summary; :class:`ChunkBudget` says how many tokens of text that leaves. The
tokens are counted by the engine's own tokenizer: :func:`split_document` takes the count as a
function (the caller binds it to ``Engine.tokenize_prompt`` or to a tokenizer it holds), so
this module imports none and stays pure.

The cut prefers coarse boundaries: a chunk ends at a paragraph break where one lies in the
back half of what fits, else at a line break, a sentence end, a space, and only as a last
resort between two characters (a run of text with no space, longer than a whole chunk).
Separators stay with the text before them, so the chunks concatenated are the document, byte
for byte: nothing of it is dropped or repeated. Counting is the engine's, and tokens do not
add up exactly across a cut (a tokenizer may merge across it), so every chunk returned has been
counted whole and fits.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

TokenCount = Callable[[str], int]
"""Tokens of a text as the engine counts it."""

# Boundaries from coarsest to finest; a unit ends after its separator.
_BOUNDARIES = (
    re.compile(r"\n[ \t\r\f\v]*\n\s*"),  # a paragraph break (a blank line)
    re.compile(r"\n\s*"),  # a line break
    re.compile(r"(?<=[.!?;:。！？])[\"'”’)\]]*\s+"),  # a sentence's end
    re.compile(r"\s+"),  # a space
)
CHARACTER = len(_BOUNDARIES)
"""Rank of a cut between two characters (the finest)."""


class ChunkTooSmall(ValueError):
    """The budget of text tokens holds not even one character."""


@dataclass(frozen=True, slots=True)
class ChunkBudget:
    """How many tokens of document text one prompt may carry."""

    context_tokens: int
    """The model's context length (``max_model_len``)."""
    prompt_tokens: int
    """Tokens the instruction and chat template add around the text."""
    summary_tokens: int
    """Tokens the summary may take (the request's ``max_tokens``)."""
    margin_tokens: int = 8
    """Slack for tokens that merge differently where the text meets the template."""

    @property
    def text_tokens(self) -> int:
        return self.context_tokens - self.prompt_tokens - self.summary_tokens - self.margin_tokens

    def check(self) -> None:
        if self.text_tokens < 1:
            raise ChunkTooSmall(
                f"a context of {self.context_tokens} tokens leaves no room for text after "
                f"{self.prompt_tokens} prompt tokens and a {self.summary_tokens}-token summary"
            )


@dataclass(frozen=True, slots=True)
class _Unit:
    text: str
    rank: int
    """The boundary the unit ends at (0: a paragraph break ... CHARACTER)."""


def _units_at(text: str, level: int) -> list[_Unit]:
    if level >= CHARACTER:
        return [_Unit(char, CHARACTER) for char in text]
    units: list[_Unit] = []
    start = 0
    for match in _BOUNDARIES[level].finditer(text):
        if match.end() > start and match.end() < len(text):
            units.append(_Unit(text[start : match.end()], level))
            start = match.end()
    units.append(_Unit(text[start:], level))
    return units


def _atoms(text: str, level: int, limit: int, count: TokenCount) -> list[_Unit]:
    """``text`` cut into units that each fit ``limit``, as coarse as possible."""
    units = _units_at(text, level)
    if level >= CHARACTER:
        for unit in units:
            if count(unit.text) > limit:
                raise ChunkTooSmall(
                    f"a budget of {limit} text tokens holds not even the character {unit.text!r}"
                )
        return units
    atoms: list[_Unit] = []
    for unit in units:
        if len(units) > 1 and count(unit.text) <= limit:
            atoms.append(unit)
            continue
        finer = _atoms(unit.text, level + 1, limit, count)
        # The last piece of a unit ends where the unit did, at its own (coarser) boundary.
        finer[-1] = _Unit(finer[-1].text, min(finer[-1].rank, unit.rank))
        atoms.extend(finer)
    return atoms


def _longest_fit(atoms: list[_Unit], start: int, limit: int, count: TokenCount) -> int:
    """The most atoms from ``start`` on whose text fits ``limit`` (at least one), found with
    a logarithmic number of counts."""

    def fits(k: int) -> bool:
        return count("".join(a.text for a in atoms[start : start + k])) <= limit

    remaining = len(atoms) - start
    good, step = 1, 1
    while good < remaining:
        probe = min(good + step, remaining)
        if not fits(probe):
            bad = probe
            break
        good, step = probe, step * 2
    else:
        return good
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def _best_end(atoms: list[_Unit], start: int, k: int) -> int:
    """How many of the ``k`` atoms that fit to take: the coarsest boundary in the back half,
    the latest of equals."""
    best = k
    for taken in range(k, max(1, k // 2) - 1, -1):
        if atoms[start + taken - 1].rank < atoms[start + best - 1].rank:
            best = taken
    return best


def split_document(text: str, limit: int, count: TokenCount) -> list[str]:
    """``text`` as chunks of at most ``limit`` tokens each (by ``count``), cut at the coarsest
    boundaries that serve; ``"".join(chunks) == text``. A text that fits is one chunk."""
    if limit < 1:
        raise ChunkTooSmall(f"a chunk must hold at least one token, not {limit}")
    if count(text) <= limit:
        return [text]
    atoms = _atoms(text, 0, limit, count)
    chunks: list[str] = []
    start = 0
    while start < len(atoms):
        k = _longest_fit(atoms, start, limit, count)
        taken = _best_end(atoms, start, k)
        chunk = "".join(a.text for a in atoms[start : start + taken])
        if taken != k and count(chunk) > limit:
            # Tokens are not monotone in a prefix for every tokenizer: keep what was counted.
            taken = k
            chunk = "".join(a.text for a in atoms[start : start + taken])
        chunks.append(chunk)
        start += taken
    return chunks

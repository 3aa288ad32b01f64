"""A document too long for one prompt split into chunks that fit, every character kept.

A map step's prompt is the instruction around a chunk's text, and the model must still have
room for the summary; :class:`ChunkBudget` says how many tokens of text that leaves. The
tokens are counted by the engine's own tokenizer: :func:`split_document` takes the count as a
function (the caller binds it to ``Engine.tokenize_prompt`` or to a tokenizer it holds), so
this module imports none and stays pure.

The cut prefers coarse boundaries: a chunk ends at a paragraph break where one lies in the
back half of what fits, else at a line break, a sentence end, a space, and only as a last
resort between two characters (a run of text with no space, longer than a whole chunk).
The engine is asked as little as it can be (each count is a round trip to its ``/tokenize``
while it may sit idle): a text whose bytes bound its tokens within the limit is not counted,
and the search for a chunk's end aims where the tokens per byte seen so far put it, so a
chunk costs two or three counts.
Separators stay with the text before them, so the chunks concatenated are the document, byte
for byte: nothing of it is dropped or repeated. Counting is the engine's, and tokens do not
add up exactly across a cut (a tokenizer may merge across it), so every chunk returned has been
counted whole (or bounded whole by its bytes) and fits.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

TokenCount = Callable[[str], int]
"""Tokens of a text as the engine counts it."""

BYTES_BOUND_SLACK = 4
"""A text of ``n`` UTF-8 bytes is at most ``n + 4`` tokens for a byte-level or byte-fallback
tokenizer (each token covers a byte or more; the start token and a leading space marker
cover none): a text whose bound fits needs no count."""

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


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def bytes_bound(text: str) -> int:
    """The most tokens ``text`` can count: a byte-level or byte-fallback tokenizer spends at
    most one token per UTF-8 byte, plus :data:`BYTES_BOUND_SLACK`."""
    return _utf8_size(text) + BYTES_BOUND_SLACK


def _fits(text: str, limit: int, count: TokenCount) -> bool:
    """Whether ``text`` fits ``limit``; counted only when its bytes do not settle it."""
    return bytes_bound(text) <= limit or count(text) <= limit


def _atoms(text: str, level: int, limit: int, count: TokenCount) -> list[_Unit]:
    """``text`` cut into units that each fit ``limit``, as coarse as possible (a unit whose
    bytes fit is not counted: most sentences, on a chunk budget of hundreds of tokens)."""
    units = _units_at(text, level)
    if level >= CHARACTER:
        for unit in units:
            if not _fits(unit.text, limit, count):
                raise ChunkTooSmall(
                    f"a budget of {limit} text tokens holds not even the character {unit.text!r}"
                )
        return units
    atoms: list[_Unit] = []
    for unit in units:
        if len(units) > 1 and _fits(unit.text, limit, count):
            atoms.append(unit)
            continue
        finer = _atoms(unit.text, level + 1, limit, count)
        # The last piece of a unit ends where the unit did, at its own (coarser) boundary.
        finer[-1] = _Unit(finer[-1].text, min(finer[-1].rank, unit.rank))
        atoms.extend(finer)
    return atoms


class _Window:
    """The atoms from ``start`` on, as prefixes of ``k`` atoms: each counted at most once, its
    bytes known from the document's running sizes, so its tokens can be estimated from the
    nearest prefix counted (tokens per byte vary little within one document)."""

    def __init__(self, atoms: list[_Unit], sizes: list[int], start: int, count: TokenCount):
        self.atoms, self.sizes, self.start, self._count = atoms, sizes, start, count
        self.counted: dict[int, int] = {}

    @property
    def remaining(self) -> int:
        return len(self.atoms) - self.start

    def bytes(self, k: int) -> int:
        return self.sizes[self.start + k] - self.sizes[self.start]

    def text(self, k: int) -> str:
        return "".join(a.text for a in self.atoms[self.start : self.start + k])

    def tokens(self, k: int) -> int:
        if k not in self.counted:
            self.counted[k] = self._count(self.text(k))
        return self.counted[k]

    def settled(self, k: int, limit: int) -> int:
        """The tokens of a prefix that fits: counted, or its bound when that fits."""
        if k in self.counted:
            return self.counted[k]
        bound = self.bytes(k) + BYTES_BOUND_SLACK
        return bound if bound <= limit else self.tokens(k)

    def aim(self, limit: int, near: int, rate: float) -> int:
        """The most atoms whose tokens, estimated at ``rate`` tokens per byte from the prefix
        of ``near`` atoms (counted, or none), stay within ``limit``."""
        base = self.counted.get(near, 0) if near else 0
        room = (limit - base) / rate + self.bytes(near)
        last = bisect.bisect_right(self.sizes, self.sizes[self.start] + room, lo=self.start) - 1
        return min(last - self.start, self.remaining)


_AIMED_PROBES = 4
"""Probes aimed by the rate before the search halves what is left."""


def _longest_fit(window: _Window, limit: int, rate: float) -> int:
    """The most atoms of ``window`` whose text fits ``limit`` (at least one).

    Each probe aims where the tokens per byte seen so far say the limit falls, so a chunk
    takes two or three counts (the prefix that fits and the one past it); past
    :data:`_AIMED_PROBES`, or when an aim lands on a side already known, the search halves
    what is left, so a wrong rate costs a logarithmic number of counts, never more."""
    remaining = window.remaining
    if window.bytes(remaining) + BYTES_BOUND_SLACK <= limit:
        return remaining
    good, bad = 1, remaining + 1
    probe = window.aim(limit, 0, rate)
    probes = 0
    while bad - good > 1:
        if probes >= _AIMED_PROBES or not good < probe < bad:
            probe = (good + bad) // 2
        tokens = window.tokens(probe)
        probes += 1
        if tokens <= limit:
            good = probe
        else:
            bad = probe
        rate = max(tokens / max(1, window.bytes(probe)), 1e-6)
        aimed = window.aim(limit, probe, rate)
        # Aimed at the last that fits: probe it, or the first past it when it is known to fit.
        probe = aimed + 1 if aimed <= good else aimed
    return good


def _best_end(atoms: list[_Unit], start: int, k: int) -> int:
    """How many of the ``k`` atoms that fit to take: the coarsest boundary in the back half,
    the latest of equals."""
    best = k
    for taken in range(k, max(1, k // 2) - 1, -1):
        if atoms[start + taken - 1].rank < atoms[start + best - 1].rank:
            best = taken
    return best


def split_counted(
    text: str, limit: int, count: TokenCount, tokens: int | None = None
) -> list[tuple[str, int]]:
    """``text`` as chunks of at most ``limit`` tokens each (by ``count``), cut at the coarsest
    boundaries that serve, each with its tokens (counted, or for a text whose bytes fit, its
    bound); the chunks joined are ``text``. ``tokens``: the whole text's count, when the caller
    has it (it is not counted again)."""
    if limit < 1:
        raise ChunkTooSmall(f"a chunk must hold at least one token, not {limit}")
    if tokens is None:
        bound = bytes_bound(text)
        tokens = bound if bound <= limit else count(text)
    if tokens <= limit:
        return [(text, tokens)]
    rate = tokens / max(1, _utf8_size(text))
    atoms = _atoms(text, 0, limit, count)
    sizes = [0, *itertools.accumulate(_utf8_size(a.text) for a in atoms)]
    chunks: list[tuple[str, int]] = []
    start = 0
    while start < len(atoms):
        window = _Window(atoms, sizes, start, count)
        k = _longest_fit(window, limit, rate)
        taken = _best_end(atoms, start, k)
        if taken != k and window.tokens(taken) > limit:
            # Tokens are not monotone in a prefix for every tokenizer: keep what was counted.
            taken = k
        chunks.append((window.text(taken), window.settled(taken, limit)))
        start += taken
    return chunks


def split_document(text: str, limit: int, count: TokenCount) -> list[str]:
    """``text`` as chunks of at most ``limit`` tokens each (by ``count``), cut at the coarsest
    boundaries that serve; ``"".join(chunks) == text``. A text that fits is one chunk."""
    return [chunk for chunk, _ in split_counted(text, limit, count)]

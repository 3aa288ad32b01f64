"""The engine's tokenizer read from the model's own files, where the API can see them, so a
summarisation job's documents are counted without a ``/tokenize`` round trip each.

A job's documents are split by the engine's count (``backfill.summarize.chunks``): 2,000
documents took ~3,800 counts, each a request to the engine's API server (the process that also
serves its interactive traffic), ~3 ms of its CPU apiece and 12 s in all on a 2-core node. The
engine names its model's files in ``/v1/models`` (``root``); where that is a folder the API
can read, with a ``tokenizer.json``, the same tokenizer counts here.

It is trusted only as far as it agrees: :class:`CheckedCount` asks the engine too for the first
:data:`CHECKS` counts and then one in :data:`SPOT_EVERY`, and answers the engine's count
whenever it asked. One disagreement (another version of the files, a special token handled in
Python by the engine's tokenizer class and not in its file) and every count after goes to the
engine, as before. Between spot checks a count is the file's alone: the split rests on it only
while the file has agreed with the engine on every count compared (a chunk's budget keeps
``margin_tokens`` spare for the few tokens a template merges differently, not for a tokenizer
that differs).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from backfill.engine.protocol import Engine, EngineError

log = logging.getLogger("backfill.engine")

TOKENIZER_FILE = "tokenizer.json"
CHECKS = 16
"""Counts compared with the engine's before a local count is answered alone."""
SPOT_EVERY = 64
"""After those, one count in this many is still compared."""
INLINE_CHARS = 4096
"""Texts up to this long are counted on the event loop that asks (longer: in a thread)."""

Count = Callable[[str], int]


def load_counter(root: str | None) -> Count | None:
    """A count of a prompt's tokens (special tokens added, as ``/tokenize`` adds them) by the
    tokenizer file in the folder ``root``; None where there is none to read."""
    if not root:
        return None
    path = Path(root) / TOKENIZER_FILE
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer  # noqa: PLC0415 - only where a file is found

        tokenizer: Any = Tokenizer.from_file(str(path))
    except Exception as exc:
        log.warning("the tokenizer at %s is not readable (%s): the engine counts", path, exc)
        return None

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=True).ids)

    return count


class CheckedCount:
    """Counts by ``local`` where it has agreed with the engine, by the engine where it has
    not been checked enough or has once disagreed. Called from several threads at once."""

    def __init__(self, local: Count, name: str) -> None:
        self._local = local
        self._name = name
        self._lock = threading.Lock()
        self.agreed = 0
        self.calls = 0
        self.disagreed = False

    def _must_check(self) -> bool:
        with self._lock:
            self.calls += 1
            return self.disagreed or self.agreed < CHECKS or self.calls % SPOT_EVERY == 0

    def count(self, text: str, engine: Count) -> int:
        """``text``'s tokens: the engine's whenever it was asked, else the local count."""
        if not self._must_check():
            return self._local(text)
        return self._compared(text, engine(text))

    async def acount(self, text: str, engine: Callable[[str], Awaitable[int]]) -> int:
        """:meth:`count` on an event loop, the engine asked through ``engine``; a long text is
        counted off the loop (a tokenizer holds it ~1 ms per few thousand characters)."""
        if not self._must_check():
            if len(text) <= INLINE_CHARS:
                return self._local(text)
            return await asyncio.to_thread(self._local, text)
        return self._compared(text, await engine(text))

    def _compared(self, text: str, theirs: int) -> int:
        if self.disagreed:
            return theirs
        mine = self._local(text)
        with self._lock:
            if mine == theirs:
                self.agreed += 1
            elif not self.disagreed:
                self.disagreed = True
                log.warning(
                    "the tokenizer file of %s counted %d tokens where its engine counts %d: "
                    "every count goes to the engine",
                    self._name,
                    mine,
                    theirs,
                )
        return theirs


class LocalCounts:
    """A :class:`CheckedCount` per engine and model, read once from the folder the engine
    names as the model's ``root`` (None where this process cannot read it)."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], CheckedCount | None] = {}

    async def counter(self, engine: Engine, url: str, model: str) -> CheckedCount | None:
        if (url, model) not in self._known:
            try:
                root = next((m.root for m in await engine.models() if m.id == model), None)
            except EngineError:
                return None  # asked again next time
            local = await asyncio.to_thread(load_counter, root)
            self._known[(url, model)] = CheckedCount(local, f"{model} at {url}") if local else None
        return self._known[(url, model)]

"""A real ``tokenizers`` tokenizer file that counts as the stand-in engines' ``/tokenize``
does: one token a word, a space run or a punctuation mark, one start token before them."""

from __future__ import annotations

import re
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

PIECES = r"\w+|[^\w\s]|\s+"
_PIECES = re.compile(PIECES)


def word_count(text: str) -> int:
    """The stand-in engine's count: the start token and the pieces."""
    return 1 + len(_PIECES.findall(text))


def write_tokenizer(folder: Path, *, start_token: bool = True) -> Path:
    """``folder/tokenizer.json`` counting as :func:`word_count` (one fewer without
    ``start_token``); returns the folder."""
    tokenizer = Tokenizer(models.WordLevel({"<s>": 0, "<unk>": 1}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PIECES), behavior="isolated")
    if start_token:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder

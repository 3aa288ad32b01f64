"""The demo's summaries read as summaries: ``backfill dev``'s request, on every bundled
document, against the real SmolLM2 engine, counting lines (or sentences) a summary repeats.

SmolLM2-135M decoding greedily copied a title line several times; :data:`devkit.demo_job.SAMPLING`
is what ``backfill dev`` sends to avoid that. ``--compare`` also runs the old request (the old
prompt, temperature 0, no penalty) on the same engine, for the before/after. Requests go
straight to the engine with exactly the bodies ``backfill dev`` submits as its batch.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import httpx

from bench.common import finish, parser, table
from devkit import devengine
from devkit.demo_job import DOCS, batch_lines, copied_lines, repeated_lines
from devkit.dev import DevOptions

NAME = "demo_summaries"
OLD_PROMPT = (
    "Summarise the following document in two or three sentences. Say what it is and what "
    "it says.\n\n{text}"
)


def bodies(model: str, max_tokens: int, *, old: bool) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for line in batch_lines(DOCS, model, max_tokens).decode().splitlines():
        row = json.loads(line)
        body = row["body"]
        if old:
            text = (DOCS / f"{row['custom_id']}.txt").read_text().strip()
            body = {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": 0,
                "messages": [{"role": "user", "content": OLD_PROMPT.format(text=text)}],
            }
        out.append((row["custom_id"], body))
    return out


async def summarise(url: str, work: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        # All at once, as the batch reaches the engine through Backfill: chunked prefills and
        # a full running batch are what the engine has to survive.
        sem = asyncio.Semaphore(len(work))

        async def one(doc: str, body: dict[str, Any]) -> tuple[str, str]:
            async with sem:
                resp = await client.post("/v1/chat/completions", json=body)
                resp.raise_for_status()
                return doc, resp.json()["choices"][0]["message"]["content"].strip()

        return dict(await asyncio.gather(*(one(d, b) for d, b in work)))


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--compare", action="store_true", help="also run the old greedy request")
    p.add_argument("--show", action="store_true", help="print every summary")
    p.add_argument("--dtype", default=None, help="serve in this dtype (default: the engine's pick)")
    args = p.parse_args(argv)
    max_tokens = DevOptions().max_tokens
    with devengine.running_engine("smollm2", kv_cache_gib=1, dtype=args.dtype) as url:
        model = "smollm2"
        runs = {"new": bodies(model, max_tokens, old=False)}
        if args.compare:
            runs["old"] = bodies(model, max_tokens, old=True)
        texts = {name: asyncio.run(summarise(url, work)) for name, work in runs.items()}
    docs = sorted(texts["new"])
    source = {doc: (DOCS / f"{doc}.txt").read_text() for doc in docs}
    rows = []
    for doc in docs:
        rows.append(
            (
                doc,
                *(repeated_lines(texts[name][doc]) for name in runs),
                *(copied_lines(texts[name][doc], source[doc]) for name in runs),
            )
        )
        if args.show:
            for name in runs:
                print(f"--- {doc} ({name})\n{texts[name][doc]}")
    headers = [
        "document",
        *(f"repeated ({n})" for n in runs),
        *(f"copied from doc ({n})" for n in runs),
    ]
    print(table(headers, rows))
    totals = {name: sum(repeated_lines(t) for t in texts[name].values()) for name in runs}
    looping = {name: sum(1 for t in texts[name].values() if repeated_lines(t)) for name in runs}
    copied = {name: sum(copied_lines(texts[name][d], source[d]) for d in docs) for name in runs}
    for name in runs:
        print(
            f"{name}: {totals[name]} repeated lines in {looping[name]} of {len(docs)} "
            f"summaries; {copied[name]} lines copied from their document"
        )
    finish(
        NAME,
        "repeated_lines",
        float(totals["new"]),
        "<=",
        0,
        {
            "documents": len(docs),
            "dtype": args.dtype,
            "totals": totals,
            "looping": looping,
            "copied": copied,
            "summaries": texts,
        },
    )


if __name__ == "__main__":
    main()

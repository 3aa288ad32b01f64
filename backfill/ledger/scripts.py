"""The ledger's Lua scripts (``backfill/lua/``): which there are, and each one's full source.

Each script's header documents its KEYS and ARGV. A script is sent with the constants it
shares with Python (from :mod:`backfill.keys`) and the helpers of ``_lib.lua`` in front.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from backfill import keys as lk

SCRIPTS = (
    "register_pool",
    "reserve",
    "settle",
    "heartbeat",
    "release",
    "release_unconfirmed",
    "preempt",
    "reap",
    "snapshot",
    "observe",
    "restore",
)


@cache
def script_source(name: str) -> str:
    """The full source of one ledger script: constants, shared helpers, then the script."""
    if name not in SCRIPTS:
        raise ValueError(f"no ledger script {name!r}")
    folder = resources.files("backfill") / "lua"
    prelude = (
        f"local SHIFT, MAX_INT, MAX_EPOCH, PPM, ENDED_TTL_MS, REAP_IN_RESERVE = "
        f"{lk.FENCE_EPOCH_SHIFT}, {lk.MAX_INT}, {lk.MAX_EPOCH}, 1000000, {lk.ENDED_TTL_MS}, "
        f"{lk.REAP_IN_RESERVE}\n"
    )
    lib = (folder / "_lib.lua").read_text(encoding="utf-8")
    body = (folder / f"{name}.lua").read_text(encoding="utf-8")
    return f"{prelude}{lib}\n{body}"

"""Public identifiers, shaped like OpenAI's (``batch_...``, ``file-...``)."""

from __future__ import annotations

import secrets


def _token(nbytes: int = 12) -> str:
    return secrets.token_hex(nbytes)


def new_job_id() -> str:
    return f"batch_{_token()}"


def new_summary_job_id() -> str:
    return f"sumjob_{_token()}"


def new_file_id() -> str:
    return f"file-{_token()}"


def new_tenant_id() -> str:
    return f"tnt_{_token(8)}"


def new_lease_id() -> str:
    return f"ls_{_token(10)}"

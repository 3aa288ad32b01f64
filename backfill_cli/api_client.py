"""A small HTTP client of Backfill's own API, for the command line.

It speaks to a running ``queue_api`` the way any tenant would (over HTTP, with a bearer
key), so the CLI needs no database or Redis access and works against a remote deployment.
Every failure becomes an :class:`ApiError` with a one-line message: the CLI prints that
line, never a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

DEFAULT_API_URL = "http://127.0.0.1:8000"


class ApiError(Exception):
    """A request that did not succeed, said in one line."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _message_of(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if body.get("detail"):
            return str(body["detail"])
    text = response.text.strip()
    return text.splitlines()[0][:200] if text else response.reason_phrase


def _explain(response: httpx.Response) -> ApiError:
    message = _message_of(response)
    status = response.status_code
    if status == 401:
        hint = "check --key or BACKFILL_API_KEY"
        return ApiError(f"the API refused the key (401): {message} ({hint})", status)
    if status == 404:
        return ApiError(f"not found (404): {message}", status)
    if status == 429:
        retry = response.headers.get("retry-after")
        after = f"; retry after {retry} s" if retry else ""
        return ApiError(f"rate limited (429): {message}{after}", status)
    return ApiError(f"the API answered {status}: {message}", status)


class ApiClient:
    """One tenant's view of the API at ``base_url``."""

    def __init__(
        self,
        base_url: str,
        key: str | None,
        *,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # The OpenAI SDK's base URL ends in /v1; accept either so one setting serves both.
        self.base_url = self.base_url.removesuffix("/v1")
        if not self.base_url.startswith(("http://", "https://")):
            raise ApiError(f"the API URL must be http(s)://..., got {base_url!r}")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except httpx.ConnectError as exc:
            raise ApiError(f"cannot reach the API at {self.base_url}: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise ApiError(f"the API at {self.base_url} did not answer in time") from exc
        except httpx.HTTPError as exc:
            raise ApiError(f"talking to the API at {self.base_url} failed: {exc}") from exc

    @contextmanager
    def _streamed(
        self, path: str, params: dict[str, Any] | None = None
    ) -> Iterator[Iterator[bytes]]:
        """The non-blank lines of a JSONL body ``path`` answers, as they stream in (no read
        timeout); an error status raised as :class:`ApiError`."""
        with (
            self._translated(),
            self._http.stream("GET", path, params=params, timeout=None) as response,
        ):
            if response.status_code >= 400:
                response.read()
                raise _explain(response)
            yield (line for line in _lines(response) if line.strip())

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        with self._translated():
            response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise _explain(response)
        try:
            body = response.json()
        except ValueError as exc:
            raise ApiError(f"the API answered {path} with something that is not JSON") from exc
        if not isinstance(body, dict):
            raise ApiError(f"the API answered {path} with an unexpected shape")
        return body

    def upload_file(self, filename: str, content: bytes) -> dict[str, Any]:
        return self._json(
            "POST", "/v1/files", files={"file": (filename, content)}, data={"purpose": "batch"}
        )

    def create_batch(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        *,
        metadata: dict[str, str] | None = None,
        idempotency_key: str | None = None,
    ) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        body: dict[str, Any] = {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": completion_window,
        }
        if metadata:
            body["metadata"] = metadata
        return self._json("POST", "/v1/batches", json=body, headers=headers)

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/batches/{batch_id}")

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/batches/{batch_id}/cancel")

    def list_batches(self, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if after:
            params["after"] = after
        return self._json("GET", "/v1/batches", params=params)

    def capacity(self) -> dict[str, Any]:
        return self._json("GET", "/v1/capacity")

    def create_webhook_endpoint(
        self, url: str, event_types: list[str] | None = None, name: str | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"url": url}
        if event_types:
            body["event_types"] = event_types
        if name:
            body["name"] = name
        return self._json("POST", "/v1/webhook_endpoints", json=body)

    def webhook_endpoints(self, limit: int = 100, after: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if after:
            params["after"] = after
        return self._json("GET", "/v1/webhook_endpoints", params=params)

    def delete_webhook_endpoint(self, endpoint_id: str) -> dict[str, Any]:
        return self._json("DELETE", f"/v1/webhook_endpoints/{endpoint_id}")

    def webhook_deliveries(
        self,
        *,
        endpoint_id: str | None = None,
        batch_id: str | None = None,
        limit: int = 20,
        after: str | None = None,
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        for name, value in (
            ("webhook_endpoint_id", endpoint_id),
            ("batch_id", batch_id),
            ("after", after),
        ):
            if value:
                params[name] = value
        return self._json("GET", "/v1/webhook_deliveries", params=params)

    def results(self, batch_id: str, states: Iterable[str] = ()) -> Iterator[bytes]:
        """Finished results as JSONL lines (each ending in a newline), as the API streams
        them: a large batch is never held in memory."""
        params = {"state": list(states)}
        with self._streamed(f"/v1/batches/{batch_id}/results", params) as lines:
            for line in lines:
                yield line + b"\n"

    # -- summarisation jobs (/v1/summary_jobs) ------------------------------------------------

    def create_summary_job(
        self, model: str, instruction: str, max_summary_tokens: int, completion_window: str
    ) -> dict[str, Any]:
        body = {
            "model": model,
            "instruction": instruction,
            "max_summary_tokens": max_summary_tokens,
            "completion_window": completion_window,
        }
        return self._json("POST", "/v1/summary_jobs", json=body)

    def add_summary_documents(
        self, job_id: str, pieces: Iterable[bytes], size: int
    ) -> dict[str, Any]:
        """One page of documents, as JSON lines in ``pieces`` of ``size`` bytes in all, sent
        one piece after the other as they come, never joined (the engine counts them: no read
        timeout)."""
        return self._json(
            "POST",
            f"/v1/summary_jobs/{job_id}/documents",
            content=iter(pieces),
            headers={"Content-Length": str(size)},
            timeout=None,
        )

    def start_summary_job(
        self, job_id: str, *, more_documents: bool = False, expected_documents: int | None = None
    ) -> dict[str, Any]:
        """Start the job; with ``more_documents`` before its last document (it then takes
        them until :meth:`close_summary_job`)."""
        body: dict[str, Any] = {"more_documents": more_documents}
        if expected_documents is not None:
            body["expected_documents"] = expected_documents
        return self._json("POST", f"/v1/summary_jobs/{job_id}/start", json=body)

    def close_summary_job(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/summary_jobs/{job_id}/close")

    def summary_job(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/summary_jobs/{job_id}")

    def cancel_summary_job(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/summary_jobs/{job_id}/cancel")

    def summary_results(self, job_id: str) -> Iterator[dict[str, Any]]:
        """The job's result rows as the API streams them (partial while it runs)."""
        with self._streamed(f"/v1/summary_jobs/{job_id}/results") as lines:
            for line in lines:
                yield json.loads(line)


def _lines(response: httpx.Response) -> Iterator[bytes]:
    """A streamed JSONL body's lines, split on ``\n`` only: httpx's ``iter_lines`` also
    splits on U+2028, U+0085 and friends, which JSON leaves unescaped inside strings, so a
    model's text holding one cut a result in two."""
    rest = b""
    for piece in response.iter_bytes():
        *lines, rest = (rest + piece).split(b"\n")
        yield from lines
    if rest:
        yield rest


def summarisation_lines(
    documents: Iterable[tuple[str, str]], model: str, max_tokens: int, prompt: str
) -> bytes:
    """An OpenAI batch input file asking for a summary of each ``(custom_id, text)``."""
    lines = []
    for custom_id, text in documents:
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt.replace("{text}", text.strip())}],
        }
        lines.append(
            json.dumps(
                {
                    "custom_id": custom_id,
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": body,
                }
            )
        )
    return ("\n".join(lines) + "\n").encode() if lines else b""

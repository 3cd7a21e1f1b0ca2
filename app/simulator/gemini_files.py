"""The Gemini API's Files API, simulated, as far as Gemini Batch Mode uses it: a
resumable upload (``POST /upload/{version}/files`` with ``X-Goog-Upload-Command:
start``, then the bytes to the ``x-goog-upload-url`` it answers with ``upload,
finalize``), a file's metadata (``GET /{version}/files/{id}``) and its bytes
(``GET /{version}/files/{id}:download?alt=media``), and the result files a batch job
writes (:func:`write`). Files are kept in memory, per API key.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from batchgen.simulator import native_errors as errors
from batchgen.simulator.state import key_id


@dataclass
class Files:
    """Uploaded and written files by name (``files/<id>``), with their owner's key, and
    the uploads started but not finalised."""

    data: dict[str, tuple[str, str, bytes]] = field(default_factory=dict)
    pending: dict[str, tuple[str, str, str]] = field(default_factory=dict)


FILES = web.AppKey("gemini_files", Files)


def _key(request: web.Request) -> str:
    return key_id(request.headers.get("x-goog-api-key") or None)


def _error(status: int, message: str) -> web.Response:
    return web.json_response(errors.error_body(errors.GEMINI, status, message), status=status)


def describe(name: str, mime: str, data: bytes) -> dict[str, Any]:
    return {
        "name": name,
        "mimeType": mime,
        "sizeBytes": str(len(data)),
        "state": "ACTIVE",
        "source": "UPLOADED",
        "downloadUri": f"{name}:download",
    }


def read(app: web.Application, name: str, key: str) -> bytes | None:
    """A file's bytes (None: no such file of ``key``'s)."""
    found = app[FILES].data.get(name)
    return found[2] if found is not None and found[0] == key else None


def write(app: web.Application, key: str, data: bytes, mime: str = "application/jsonl") -> str:
    """A file the service writes (a batch job's results); its name."""
    name = f"files/{uuid.uuid4().hex[:16]}"
    app[FILES].data[name] = (key, mime, data)
    return name


async def upload(request: web.Request) -> web.Response:
    files = request.app[FILES]
    upload_id = request.query.get("upload_id")
    command = request.headers.get("X-Goog-Upload-Command", "")
    if upload_id is None:
        if command != "start":
            return _error(400, "the simulator takes resumable uploads only")
        body = await request.json()
        meta = body.get("file") or {}
        upload_id = uuid.uuid4().hex
        name = meta.get("name") or f"files/{uuid.uuid4().hex[:16]}"
        mime = meta.get("mimeType") or "application/octet-stream"
        files.pending[upload_id] = (_key(request), name, mime)
        url = f"{request.url.with_query({'upload_id': upload_id})}"
        return web.json_response({}, headers={"x-goog-upload-url": url})
    pending = files.pending.get(upload_id)
    if pending is None or "finalize" not in command:
        return _error(400, "unknown upload, or one sent in parts (not simulated)")
    key, name, mime = files.pending.pop(upload_id)
    data = await request.read()
    files.data[name] = (key, mime, data)
    return web.json_response(
        {"file": describe(name, mime, data)}, headers={"x-goog-upload-status": "final"}
    )


async def get(request: web.Request) -> web.StreamResponse:
    """A file's metadata, or its bytes (``:download``)."""
    name, _, method = request.match_info["call"].partition(":")
    name = f"files/{name}"
    data = read(request.app, name, _key(request))
    if data is None:
        return _error(404, "no such file")
    if method == "download":
        return web.Response(body=data, content_type="application/octet-stream")
    return web.json_response(describe(name, request.app[FILES].data[name][1], data))


def add_routes(app: web.Application) -> None:
    app[FILES] = Files()
    app.router.add_post("/upload/{version}/files", upload)
    app.router.add_get("/{version}/files/{call}", get)

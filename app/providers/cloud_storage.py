"""Google Cloud Storage's JSON API, the little of it Vertex AI's batch prediction needs:
put an object, read one, list a prefix (``httpx``; a bearer token from the deployment's
credentials; ``endpoint``: Google's, or an emulator's)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx

GOOGLE_STORAGE = "https://storage.googleapis.com"
TIMEOUT_S = 60.0


def location(uri: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix`` as ``("bucket", "some/prefix")``."""
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    return bucket, name.strip("/")


class Bucket:
    def __init__(self, endpoint: str | None, bucket: str, token: str | None) -> None:
        self.base = (endpoint or GOOGLE_STORAGE).rstrip("/")
        self.bucket = bucket
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def put(self, name: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        url = f"{self.base}/upload/storage/v1/b/{self.bucket}/o"
        params = {"uploadType": "media", "name": name}
        headers = {**self.headers, "Content-Type": content_type}
        httpx.post(
            url, params=params, content=data, headers=headers, timeout=TIMEOUT_S
        ).raise_for_status()

    def get(self, name: str) -> bytes:
        url = f"{self.base}/storage/v1/b/{self.bucket}/o/{quote(name, safe='')}"
        answer = httpx.get(url, params={"alt": "media"}, headers=self.headers, timeout=TIMEOUT_S)
        answer.raise_for_status()
        return answer.content

    def names(self, prefix: str) -> list[str]:
        url = f"{self.base}/storage/v1/b/{self.bucket}/o"
        out: list[str] = []
        token: str | None = None
        while True:
            params: dict[str, Any] = {"prefix": prefix}
            if token:
                params["pageToken"] = token
            answer = httpx.get(url, params=params, headers=self.headers, timeout=TIMEOUT_S)
            answer.raise_for_status()
            body = answer.json()
            out += [str(item["name"]) for item in body.get("items") or []]
            token = body.get("nextPageToken")
            if not token:
                return out

"""Incremental reruns of a nightly job: which request a stored description answers.

A product's request is hashed whole but for its ``custom_id`` (the product key): the
model, the messages, ``max_tokens`` and every other parameter of the body, and the
endpoint. A stored description serves a later run only for a request with the same
hash, so a change to the product's values, the template, the tone, the locale or the
model describes the product again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchgen.domain.formats.admission import canonical_sha256


def request_sha256(line: Mapping[str, Any]) -> str:
    """SHA-256 of a request line's canonical JSON, its ``custom_id`` left out."""
    return canonical_sha256({k: v for k, v in line.items() if k != "custom_id"})


def changed_since(recorded: Mapping[str, str], planned: Mapping[str, str]) -> str | None:
    """A product a run reused (``recorded``: product -> request hash) whose request is
    not the same in this submit of the run (``planned``), if there is one: the catalog
    changed since the run was first submitted."""
    for product_id, sha256 in recorded.items():
        if planned.get(product_id) != sha256:
            return product_id
    return None

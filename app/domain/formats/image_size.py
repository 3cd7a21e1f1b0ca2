"""The pixel size of an image in a request, from its first bytes (pure, no decoder).

Providers bill an image by its size (see :mod:`batchgen.domain.prompt_extras`). A
``data:`` URL carries the image itself: its header (PNG, GIF, WebP, JPEG) says the
size, read from at most ``HEAD_BYTES`` decoded bytes, so a large image costs little
to measure. An ``http(s)`` URL is not fetched at admission: its size is unknown
(None) and the estimate takes the largest the provider bills.
"""

from __future__ import annotations

import base64
import binascii
import struct

# Enough for a JPEG's frame header behind its usual EXIF/ICC segments.
HEAD_BYTES = 96 * 1024


def data_url_head(url: str) -> bytes | None:
    """The first ``HEAD_BYTES`` bytes of a base64 ``data:`` URL, or None."""
    if not url.startswith("data:"):
        return None
    _, sep, payload = url.partition(",")
    if not sep:
        return None
    chars = HEAD_BYTES // 3 * 4
    try:
        return base64.b64decode(payload[:chars], validate=False)
    except (binascii.Error, ValueError):
        return None


def _jpeg(head: bytes) -> tuple[int, int] | None:
    i = 2
    while i + 9 < len(head):
        if head[i] != 0xFF:
            return None
        marker = head[i + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (length,) = struct.unpack(">H", head[i + 2 : i + 4])
        # Start-of-frame markers (baseline, progressive...), not DHT/JPG/DAC.
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            height, width = struct.unpack(">HH", head[i + 5 : i + 9])
            return width, height
        i += 2 + length
    return None


def image_size(head: bytes) -> tuple[int, int] | None:
    """``(width, height)`` from an image's first bytes, or None when not recognised."""
    if head.startswith(b"\x89PNG\r\n\x1a\n") and len(head) >= 24:
        width, height = struct.unpack(">II", head[16:24])
        return width, height
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        width, height = struct.unpack("<HH", head[6:10])
        return width, height
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP" and len(head) >= 30:
        kind = head[12:16]
        if kind == b"VP8X":
            width = int.from_bytes(head[24:27], "little") + 1
            height = int.from_bytes(head[27:30], "little") + 1
            return width, height
        if kind == b"VP8 ":
            width, height = struct.unpack("<HH", head[26:30])
            return width & 0x3FFF, height & 0x3FFF
        if kind == b"VP8L" and len(head) >= 25:
            bits = int.from_bytes(head[21:25], "little")
            return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
        return None
    if head.startswith(b"\xff\xd8"):
        return _jpeg(head)
    return None


def data_url_size(url: str) -> tuple[int, int] | None:
    """The size of the image in a ``data:`` URL, or None (another URL, not an image)."""
    head = data_url_head(url)
    return image_size(head) if head is not None else None

"""Output files are written whole or not at all, with the mode the umask gives."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchgen.atomic_files import replacing, umask
from batchgen.nightly.output import write_file


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_written_file_has_the_mode_of_the_umask(tmp_path: Path, mask: int, mode: int):
    with _umask(mask):
        assert umask() == mask
        with replacing(tmp_path / "out.jsonl") as fh:
            fh.write("{}\n")
        write_file(tmp_path / "nightly.csv", [{"id": "1", "locale": "en", "description": "d"}])
    for name in ("out.jsonl", "nightly.csv"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path):
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")
    with pytest.raises(RuntimeError), replacing(target) as fh:
        fh.write("new, half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]

"""Files written whole or not at all: a temporary file renamed over the target.

:func:`replacing` is what every output file of the project goes through (results,
nightly outputs and reports). The file gets the mode a new file gets under the
process's umask (``0666 & ~umask``, e.g. 0644), not the 0600 of
:func:`tempfile.mkstemp`, so a results file is as readable as any file its user
creates.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

_PROC_STATUS = Path("/proc/self/status")


def umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux);
    elsewhere set and restored at once."""
    with contextlib.suppress(OSError, ValueError):
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def replacing(path: Path, *, newline: str | None = None) -> Iterator[TextIO]:
    """A text file (UTF-8) that replaces ``path`` when the block ends; if the block
    raises, ``path`` is left as it was and the temporary file is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "w", encoding="utf-8", newline=newline) as fh:
            yield fh
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

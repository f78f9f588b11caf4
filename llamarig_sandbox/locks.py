"""One lock file per thing the sandbox caches: test workers (pytest-xdist), `llamarig sandbox
prepare` beside them and `up` may each fill the same cache at once."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def held(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` (created with its directory) while inside."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        yield

"""Write-then-rename, the one way edgellm writes a file that others read: a reader, or a crash,
never sees half a file. A process killed mid-write leaves its temp file behind (no `finally`
runs); the next write in that folder sweeps such leftovers."""
from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

PARTIAL = ".partial"
STALE_AFTER_S = 600  # untouched this long, a temp file's writer is gone (a live one keeps writing)


@contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """A temp path beside `target` to write to; it replaces `target` when the block succeeds
    and is removed when it fails."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_partials(target.parent)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=PARTIAL)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def sweep_partials(folder: str | Path, older_than_s: float = STALE_AFTER_S) -> int:
    """Remove the temp files of interrupted writes in `folder`; returns how many went."""
    now = time.time()
    try:
        candidates = list(Path(folder).glob(f"*{PARTIAL}"))
    except OSError:
        return 0
    return remove_files(candidates, lambda path: path.is_file() and now - path.stat().st_mtime > older_than_s)


def remove_files(paths: Iterable[Path], doomed: Callable[[Path], bool]) -> int:
    """Remove each of `paths` that `doomed` picks; returns how many went. One another process
    removed first, or a read-only folder, is passed over."""
    removed = 0
    for path in paths:
        try:
            if doomed(path):
                path.unlink()
                removed += 1
        except OSError:
            continue
    return removed

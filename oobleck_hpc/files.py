"""Writing files that readers never see half-written (stdlib only; every module uses these).

    write_atomic(path, b"...")            # bytes or str; temp file + rename
    write_atomic(path, text, durable=True)  # + fsync of the file and its directory (checkpoints)
    write_json(path, {"a": 1})            # the same for one JSON object

The temporary name is unique per process and thread (`.NAME.PID.TID.tmp` beside the target), so
concurrent writers of one path never clobber each other's temporary file: the last rename wins
and every version a reader sees is complete.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


def write_atomic(path: str | os.PathLike[str], data: bytes | str, durable: bool = False) -> None:
    """Replace `path` by `data` in one rename: a reader sees the old file (or none) or the new
    one, never part of it. `durable`: fsync the file before and its directory after the rename,
    so the new version also survives a machine crash (checkpoints, profiles)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_json(path: str | os.PathLike[str], data: Any, durable: bool = False,
               indent: int | None = 1) -> None:
    """`write_atomic` of one JSON document (a trailing newline included)."""
    write_atomic(path, json.dumps(data, indent=indent) + "\n", durable=durable)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Writing files that readers never see half-written (stdlib only; every module uses these).

    write_atomic(path, b"...")              # bytes or str; temp file + rename
    write_atomic(path, text, durable=True)  # + fsync of the file and its directory (checkpoints)
    write_json(path, {"a": 1})              # the same for one JSON object
    with atomic_open(path) as f:            # the same for a file written piece by piece
        f.write(...)

The temporary name (`temp_path`) is unique per process and thread (`.NAME.PID.TID.tmp` beside
the target), so concurrent writers of one path never clobber each other's temporary file: the
last rename wins and every version a reader sees is complete. A writer that must not replace an
existing file (the profile library) writes `temp_path(dest)` itself, `fsync_file`s it and links
it into place (profiling/store.py).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO


def temp_path(path: str | os.PathLike[str]) -> Path:
    """The hidden temporary name beside `path` that this process and thread write first."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


@contextmanager
def atomic_open(path: str | os.PathLike[str], durable: bool = False) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s new content into: on a clean exit it replaces `path` in
    one rename (a reader sees the old file, or none, or the new one, never part of it); on an
    error it is removed and `path` is left as it was. `durable`: fsync the file before and its
    directory after the rename, so the new version also survives a machine crash."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike[str], data: bytes | str, durable: bool = False) -> None:
    """Replace `path` by `data` in one rename (see `atomic_open`; `durable` for checkpoints and
    records that must survive a machine crash)."""
    with atomic_open(path, durable) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def write_json(path: str | os.PathLike[str], data: Any, durable: bool = False,
               indent: int | None = 1) -> None:
    """`write_atomic` of one JSON document (a trailing newline included)."""
    write_atomic(path, json.dumps(data, indent=indent) + "\n", durable=durable)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Make a file's content durable (for a file written by a library that takes only a path)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str], best_effort: bool = False) -> None:
    """Make a directory's entries (a rename, a new file) durable. `best_effort`: ignore a file
    system that does not let a directory be opened or fsynced (the rename is atomic anyway)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        if best_effort:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not best_effort:
            raise
    finally:
        os.close(fd)

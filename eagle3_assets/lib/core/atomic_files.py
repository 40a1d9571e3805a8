"""Files that are either whole or absent: a crash or power loss never leaves half a shard, row
file or measurement behind, and a file's hash tells one version from another."""

import fcntl
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_atomically(path: Path, payload: bytes) -> str:
    """Write `payload` to `path` via a hidden temp file, fsync and rename (the rename made
    durable too); return its sha256. Readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return hashlib.sha256(payload).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(directory: Path) -> dict[str, str]:
    """name -> sha256 of each file in a folder (a drafter: its config and weights)."""
    return {p.name: file_sha256(p) for p in sorted(Path(directory).iterdir()) if p.is_file()}


@contextmanager
def held_alone(built: Path) -> Iterator[None]:
    """One process at a time building `built` (an exclusive flock on the empty `.<name>.lock`
    beside it, released on exit or by the process's death): concurrent builders of one cached
    thing wait for the first, then find it built, instead of building it twice."""
    built.parent.mkdir(parents=True, exist_ok=True)
    with open(built.with_name(f".{built.name}.lock"), "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield

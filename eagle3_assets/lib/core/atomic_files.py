"""Files that are either whole or absent: a crash or power loss never leaves half a shard, row
file or measurement behind, and a file's hash tells one version from another."""

import hashlib
import os
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


def tree_sha256(directory: Path) -> str:
    """One hash of a folder's files, names and bytes (a drafter: its config and weights)."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).iterdir()):
        if path.is_file():
            digest.update(f"{path.name}\0{file_sha256(path)}\0".encode())
    return digest.hexdigest()

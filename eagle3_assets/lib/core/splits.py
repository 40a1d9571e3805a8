"""Splits by id: a sample's side is a stable function of its id alone, so a split holds across
runs, batches, ranks and files."""

import hashlib


def held_out(sample_id: str, fraction: float, salt: str = "") -> bool:
    """Whether `sample_id` falls in the held-out `fraction`. Splits with different `salt`s are
    independent: the inbox's evaluation share does not eat into training's own held-out split."""
    key = f"{salt}:{sample_id}" if salt else sample_id
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64

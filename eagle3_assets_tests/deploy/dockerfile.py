"""Just enough of a Dockerfile parser for the deployment tests (no Docker engine here)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str


def instructions(dockerfile: Path) -> list[Instruction]:
    """Comments dropped, `\\` continuations joined, one entry per instruction."""
    out: list[Instruction] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        pending += (" " if pending else "") + line.rstrip("\\").strip()
        if line.endswith("\\"):
            continue
        keyword, _, args = pending.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
        pending = ""
    return out


def stages(dockerfile: Path) -> dict[str, list[Instruction]]:
    """Each stage's instructions by its name (`FROM x AS name`; the last, unnamed one is the
    default target: ""); the ARGs before the first FROM are the first stage's."""
    found: dict[str, list[Instruction]] = {}
    current: list[Instruction] = []
    for step in instructions(dockerfile):
        if step.keyword == "FROM":
            _, _, name = step.args.partition(" AS ")
            current = found.setdefault(name.strip(), [*current] if not found else [])
        current.append(step)
    return found


def env_pairs(args: str) -> dict[str, str]:
    """ENV k=v k2="v 2" ... (the only ENV form the project uses)."""
    pairs = {}
    for token in shlex.split(args):
        key, sep, value = token.partition("=")
        if not sep:
            raise ValueError(f"ENV in the legacy `ENV key value` form: {args}")
        pairs[key] = value
    return pairs


def copy_sources(args: str) -> tuple[list[str], str]:
    """COPY [--chown=...] src... dst -> (sources, dst)."""
    tokens = [t for t in shlex.split(args) if not re.match(r"--\w+=", t)]
    return tokens[:-1], tokens[-1]

"""Prompts that keep arriving: files a gateway or request logger drops in an inbox folder (or
subfolders), or that new revisions of a hub dataset bring (the folder is then the newest
revision's snapshot; a file it shares unchanged with an earlier one is not new).

Each new file is registered once, in arrival order, into a ledger beside a snapshot of what it
added, so the pool only ever grows at its end (earlier batches never change) and a file that
is later edited, rotated or deleted in the inbox moves nothing:
- a prompt id already in the pool or an earlier file counts as a duplicate, once;
- a share of each file (by prompt id alone, `EVALUATION_SALT`) is held out for evaluation and
  never batched for training;
- a malformed file is recorded with its error (file and line) and skipped; the others go on.
  It is tried again only if its bytes change.
Writers should drop whole files (write elsewhere, then rename): names starting with "." and
suffixes other than JSONL/JSON/Parquet are not read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_assets.lib.core.atomic_files import file_sha256, write_atomically
from eagle3_assets.lib.core.splits import held_out
from eagle3_assets.lib.generation.conversations import (
    Conversation,
    ConversationError,
    load_conversations,
)

SUFFIXES = (".jsonl", ".json", ".parquet")
EVALUATION_SALT = "inbox-evaluation"  # independent of training's own held-out split by id
LEDGER = "ledger.jsonl"


@dataclass(frozen=True)
class InboxFile:
    """One registered file: what it added, or why it was skipped."""

    sequence: int  # arrival order: the ledger's line number
    name: str
    sha256: str
    stat: tuple[int, int]  # (size, mtime_ns) when registered: unchanged files are not hashed
    pool_prompts: int  # the pool file's prompts when it was registered (they come first)
    records: int = 0  # distinct prompts in the file
    added: int = 0  # new prompts batched for training
    held_out: int = 0  # new prompts kept for evaluation
    duplicates: int = 0  # prompt ids already in the pool or an earlier file
    error: str | None = None
    revision: str | None = None  # the hub dataset's commit it was read at

    @property
    def stem(self) -> str:
        return f"{self.sequence:05d}-{Path(self.name).stem}"

    def describe(self) -> str:
        name = f"{self.name}@{self.revision[:12]}" if self.revision else self.name
        if self.error is not None:
            return f"{name}: skipped, {self.error}"
        return (
            f"{name}: {self.records} prompts, {self.added} added for training, "
            f"{self.held_out} held out for evaluation, {self.duplicates} duplicates"
        )


class Inbox:
    """An inbox folder and its state (`state_dir`: the ledger and the snapshots); `revision`:
    the hub dataset commit the folder is a snapshot of."""

    def __init__(
        self, folder: Path, state_dir: Path, heldout_fraction: float, revision: str | None = None
    ) -> None:
        self.folder = Path(folder)
        self.state_dir = Path(state_dir)
        self.heldout_fraction = heldout_fraction
        self.revision = revision

    def held_out(self, prompt_id: str) -> bool:
        """Whether an inbox prompt is kept for evaluation, never batched for training."""
        return held_out(prompt_id, self.heldout_fraction, EVALUATION_SALT)

    def ledger(self) -> list[InboxFile]:
        path = self.state_dir / LEDGER
        if not path.exists():
            return []
        entries = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                entries.append(InboxFile(**json.loads(line)))
            except json.JSONDecodeError:  # cut by a crash mid-append: that file is pending
                continue
        return entries

    def pending(self) -> list[Path]:
        """Files not registered with their current bytes, in name order (a gateway naming
        files by time registers them in arrival order)."""
        if not self.folder.is_dir():
            raise FileNotFoundError(f"EAGLE3_INBOX: expected a folder, found none at {self.folder}")
        if self.state_dir.resolve().is_relative_to(self.folder.resolve()):
            raise ValueError(
                f"EAGLE3_INBOX: expected a folder outside the inbox's own ledger and snapshots "
                f"({self.state_dir}), found {self.folder}, which holds them: they would be read "
                "as new files"
            )
        entries = self.ledger()
        seen = {(entry.name, tuple(entry.stat)) for entry in entries}
        known = {(entry.name, entry.sha256) for entry in entries}
        files = {
            self._name(path): path
            for path in self.folder.rglob("*")
            if path.is_file() and path.suffix in SUFFIXES
        }
        candidates = sorted(
            (name, path)
            for name, path in files.items()
            if not any(part.startswith(".") for part in name.split("/"))
        )
        return [
            path
            for name, path in candidates
            if (name, _stat(path)) not in seen and (name, file_sha256(path)) not in known
        ]

    def register(self, pool_ids: Sequence[str]) -> list[InboxFile]:
        """Register every pending file against the pool file's ids and earlier files'."""
        entries = self.ledger()
        seen = set(pool_ids) | {c.prompt_id for c in self._snapshots(entries, "train")}
        seen |= {c.prompt_id for c in self._snapshots(entries, "evaluation")}
        registered = []
        for path in self.pending():
            entry = self._register(path, len(entries) + len(registered), len(pool_ids), seen)
            registered.append(entry)
        return registered

    def conversations(self, pool_prompts: int) -> list[Conversation]:
        """What the files added for training, in arrival order, to follow a pool file of
        `pool_prompts` prompts: the count they were registered after, or batches would shift."""
        entries = self.ledger()
        if entries and entries[-1].pool_prompts != pool_prompts:
            raise ValueError(
                f"EAGLE3_PROMPTS: expected the {entries[-1].pool_prompts} prompts the inbox's "
                f"files were registered after, found {pool_prompts}: batches past the pool file "
                "would shift. Keep the pool file as it was and drop new prompts in EAGLE3_INBOX"
            )
        return self._snapshots(entries, "train")

    def evaluation_sets(self) -> dict[str, list[Conversation]]:
        """The held-out prompts to score drafters on: the newest file's slice (the traffic a
        new drafter should serve better) and every earlier file's together (so forgetting
        shows), named by the files' ledger stems. At most two sets, however many files came."""
        slices = [entry for entry in self.ledger() if entry.held_out]
        groups = (slices[:-1], slices[-1:])
        return {_set_name(group): self._snapshots(group, "evaluation") for group in groups if group}

    def _name(self, path: Path) -> str:
        return path.relative_to(self.folder).as_posix()

    def _register(self, path: Path, sequence: int, pool_prompts: int, seen: set[str]) -> InboxFile:
        sha, stat, name = file_sha256(path), _stat(path), self._name(path)
        try:
            conversations = load_conversations(path)
        except (ConversationError, OSError, ValueError) as error:
            entry = InboxFile(
                sequence, name, sha, stat, pool_prompts, error=str(error), revision=self.revision
            )
            self._append(entry)
            return entry
        new = [c for c in conversations if c.prompt_id not in seen]
        evaluation = [
            c for c in new if held_out(c.prompt_id, self.heldout_fraction, EVALUATION_SALT)
        ]
        evaluation_ids = {c.prompt_id for c in evaluation}
        train = [c for c in new if c.prompt_id not in evaluation_ids]
        entry = InboxFile(
            sequence,
            name,
            sha,
            stat,
            pool_prompts,
            records=len(conversations),
            added=len(train),
            held_out=len(evaluation),
            duplicates=len(conversations) - len(new),
            revision=self.revision,
        )
        for split, rows in (("train", train), ("evaluation", evaluation)):
            if rows:  # snapshots first: a ledger line always has its files
                target = self._snapshot(entry, split)
                target.parent.mkdir(parents=True, exist_ok=True)
                write_atomically(target, _jsonl(rows))
        self._append(entry)
        seen.update(c.prompt_id for c in new)
        return entry

    def _snapshot(self, entry: InboxFile, split: str) -> Path:
        return self.state_dir / split / f"{entry.stem}.jsonl"

    def _snapshots(self, entries: list[InboxFile], split: str) -> list[Conversation]:
        counts = {"train": "added", "evaluation": "held_out"}
        return [
            conversation
            for entry in entries
            if getattr(entry, counts[split])
            for conversation in load_conversations(self._snapshot(entry, split))
        ]

    def _append(self, entry: InboxFile) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / LEDGER
        # after a crash mid-append the cut line stays alone on its line (ledger() skips it)
        cut = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
        with open(path, "a", encoding="utf-8") as ledger:
            ledger.write(("\n" if cut else "") + json.dumps(asdict(entry)) + "\n")
            ledger.flush()
            os.fsync(ledger.fileno())


def _stat(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_size, info.st_mtime_ns


def _set_name(entries: list[InboxFile]) -> str:
    first, last = entries[0].stem, entries[-1].stem
    return f"inbox {first}" if first == last else f"inbox {first}..{last}"


def _jsonl(conversations: list[Conversation]) -> bytes:
    lines = [json.dumps({"prompt_id": c.prompt_id, "messages": c.messages}) for c in conversations]
    return ("\n".join(lines) + "\n").encode()

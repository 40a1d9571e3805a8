"""The prompt pool: conversations read from local JSONL, JSON or Parquet files, cut into batches.

Two record shapes are accepted: `messages: [{"role", "content"}]` (UltraChat, OpenAI style) and
ShareGPT's `conversations: [{"from", "value"}]`. The target regenerates the final assistant
turn, so what is sent is everything before it. A batch is a slice of the pool in file order:
prompts appended to the file never move an earlier prompt to another batch.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}
BATCH_KEY = re.compile(r"batch-(\d{5,})")


class ConversationError(ValueError):
    """A record that cannot become a prompt; the message names the file and line or row."""


@dataclass(frozen=True)
class Conversation:
    prompt_id: str
    messages: list[dict[str, str]]  # ends after the last user turn: the target answers next


def prompt_id_for(messages: list[dict[str, str]]) -> str:
    """A short content hash, so an id-less record keeps its id however the pool is reordered
    or grown (the miniature world's prompt pool is keyed by it too)."""
    payload = json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(payload).hexdigest()[:12]


def load_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation in `path`, in file order.

    A prompt id seen twice with the same messages is kept once (datasets repeat prompts);
    the same id with different messages is an error, since rows are keyed by prompt id.
    """
    path = Path(path)
    seen: dict[str, tuple[Conversation, str]] = {}
    for where, record in _records(path):
        conversation = _conversation(record, where)
        first = seen.get(conversation.prompt_id)
        if first is None:
            seen[conversation.prompt_id] = (conversation, where)
        elif first[0].messages != conversation.messages:
            raise ConversationError(
                f"{where}: prompt_id {conversation.prompt_id!r} already used by {first[1]} "
                "with different messages"
            )
    if not seen:
        raise ConversationError(
            f"{path}: no conversations; expected JSONL/JSON records or Parquet rows with "
            "`messages` (role/content) or `conversations` (from/value)"
        )
    return [conversation for conversation, _ in seen.values()]


def _records(path: Path) -> Iterator[tuple[str, dict]]:
    """(location for error messages, record) pairs."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # only for Parquet pools: keeps definitions load light

        row = 0
        for batch in pq.ParquetFile(path).iter_batches():
            for record in batch.to_pylist():
                yield f"{path} row {row}", record
                row += 1
        return
    with path.open(encoding="utf-8") as lines:
        first = lines.read(1)
        lines.seek(0)
        if path.suffix == ".json" and first == "[":  # a ShareGPT dump: one JSON array
            for index, record in enumerate(json.load(lines)):
                yield f"{path} item {index}", record
            return
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{number}", json.loads(line)
            except json.JSONDecodeError as error:
                raise ConversationError(f"{path}:{number}: not JSON: {error}") from error


def _conversation(record: dict, where: str) -> Conversation:
    if not isinstance(record, dict):
        raise ConversationError(f"{where}: expected an object, found {type(record).__name__}")
    messages = _messages(record, where)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()  # the turn the target regenerates
    if not any(message["role"] == "user" for message in messages):
        raise ConversationError(f"{where}: no user turn before the final assistant turn")
    own_id = record.get("prompt_id", record.get("id"))
    prompt_id = str(own_id) if own_id not in (None, "") else prompt_id_for(messages)
    return Conversation(prompt_id, messages)


def _messages(record: dict, where: str) -> list[dict[str, str]]:
    if "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        raise ConversationError(f"{where}: neither 'messages' nor 'conversations' present")
    if isinstance(turns, str):  # a Parquet column holding JSON text
        turns = json.loads(turns)
    if not isinstance(turns, list) or not turns:
        raise ConversationError(f"{where}: no turns")
    messages = []
    for index, turn in enumerate(turns):
        role = ROLES.get(str(turn.get(role_key, "")).lower()) if isinstance(turn, dict) else None
        content = turn.get(text_key) if isinstance(turn, dict) else None
        if role is None or not isinstance(content, str):
            raise ConversationError(
                f"{where}: turn {index} needs a known {role_key!r} ({sorted(ROLES)}) "
                f"and a string {text_key!r}, found {turn!r:.200}"
            )
        messages.append({"role": role, "content": content})
    return messages


def num_batches(pool_size: int, batch_size: int) -> int:
    """Batches needed to cover the pool; the last one may be partial (see batch_slice)."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    return -(-pool_size // batch_size)


def batch_slice(
    conversations: list[Conversation], batch_index: int, batch_size: int
) -> list[Conversation]:
    """Batch k = pool items [k*size, (k+1)*size) in file order.

    Full batches never change while the pool only grows at its end; a partial last batch
    gains the new prompts, and re-materializing it generates only those (the store resumes).
    """
    if not 0 <= batch_index < num_batches(len(conversations), batch_size):
        raise IndexError(
            f"batch {batch_index} is outside a pool of {len(conversations)} prompts "
            f"in batches of {batch_size}"
        )
    return conversations[batch_index * batch_size : (batch_index + 1) * batch_size]


def batch_key(batch_index: int) -> str:
    """The partition key: zero-padded, so keys sort in pool order."""
    if batch_index < 0:
        raise ValueError(f"batch index must be >= 0, got {batch_index}")
    return f"batch-{batch_index:05d}"


def parse_batch_key(key: str) -> int:
    """The inverse of batch_key."""
    match = BATCH_KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"not a batch key: {key!r} (expected batch-00000, batch-00001, ...)")
    return int(match.group(1))

"""The topic corpus (pydoc_data.topics) and the prompt pool asked of the miniature targets.

Questions come from the same templates the targets were trained to answer, so the targets
respond with topic-like text and the prompt pool plays the role of real user traffic.
"""

import json
import pydoc_data.topics
from pathlib import Path

from eagle3_assets.lib.generation.conversations import prompt_id_for

QUESTIONS = [
    "Tell me about {subject}.",
    "What does the Python reference say about {subject}?",
    "Explain {subject} in Python.",
    "Give me an overview of {subject}.",
    "Summarize the section on {subject}.",
    "I am learning Python. Can you describe {subject}?",
]
FOLLOW_UPS = [
    "Tell me more.",
    "Go on, what else should I know about {subject}?",
    "Can you continue with more details?",
]
HELDOUT_EVERY = 10  # about 1 prompt in HELDOUT_EVERY goes to the held-out file


def topics(keys: tuple[str, ...] | None = None) -> dict[str, str]:
    """The reference topics every Python ships (79 topics, ~465K characters of English) sorted
    by key, or only those in `keys`."""
    every = pydoc_data.topics.topics
    return {key: every[key] for key in sorted(keys or every)}


def subject(text: str) -> str:
    """The topic's heading as a noun phrase: 'The "if" statement' -> 'the "if" statement'."""
    heading = text.split("\n", 1)[0].strip()
    return "the" + heading[3:] if heading.startswith("The ") else heading


def body(text: str) -> str:
    """The topic text without its heading and the '****' underline below it."""
    return text.split("\n", 2)[2].strip()


def _first_paragraph(text: str, max_chars: int = 300) -> str:
    paragraph = body(text).split("\n\n", 1)[0]
    if len(paragraph) <= max_chars:
        return paragraph
    return paragraph[:max_chars].rsplit(" ", 1)[0]


def user_message(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def candidate_conversations(topic_keys: tuple[str, ...] | None = None) -> list[dict]:
    """Every templated conversation, in topic order: single questions plus one multi-turn
    conversation per topic whose final user turn is a follow-up."""
    conversations = []
    for index, (key, text) in enumerate(topics(topic_keys).items()):
        about = subject(text)
        for template in QUESTIONS:
            conversations.append((key, [user_message(template.format(subject=about))]))
        follow_up = FOLLOW_UPS[index % len(FOLLOW_UPS)].format(subject=about)
        first_question = QUESTIONS[index % len(QUESTIONS)].format(subject=about)
        messages = [
            user_message(first_question),
            {"role": "assistant", "content": _first_paragraph(text)},
            user_message(follow_up),
        ]
        conversations.append((key, messages))

    unique: dict[str, dict] = {}
    for key, messages in conversations:
        pid = prompt_id_for(messages)  # topics sharing a heading ("if", "else") give duplicates
        unique.setdefault(pid, {"prompt_id": pid, "messages": messages, "source": key})
    return list(unique.values())


def write_prompt_pool(
    num_prompts: int, topic_keys: tuple[str, ...] | None, pool_path: Path, heldout_path: Path
) -> tuple[int, int]:
    """Write `num_prompts` conversations (the smallest ids, so the choice is stable) as JSONL,
    split by id hash into the pool and a disjoint held-out file. Returns both counts."""
    candidates = candidate_conversations(topic_keys)
    chosen = _chosen_ids(candidates, num_prompts)
    selected = [c for c in candidates if c["prompt_id"] in chosen]
    heldout = [c for c in selected if int(c["prompt_id"], 16) % HELDOUT_EVERY == 0]
    pool = [c for c in selected if int(c["prompt_id"], 16) % HELDOUT_EVERY != 0]
    for path, rows in ((pool_path, pool), (heldout_path, heldout)):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(pool), len(heldout)


def write_unasked_prompts(num_prompts: int, topic_keys: tuple[str, ...] | None, path: Path) -> int:
    """Write the candidates that `write_prompt_pool(num_prompts, ...)` leaves out, as JSONL:
    prompts in neither the pool nor the held-out file, so no drafter of the world was trained
    on their answers. Returns their count."""
    candidates = candidate_conversations(topic_keys)
    chosen = _chosen_ids(candidates, num_prompts)
    rows = [c for c in candidates if c["prompt_id"] not in chosen]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return len(rows)


def _chosen_ids(candidates: list[dict], num_prompts: int) -> set[str]:
    """The `num_prompts` smallest prompt ids, so that the choice is stable."""
    if num_prompts > len(candidates):
        raise ValueError(f"num_prompts={num_prompts} exceeds the {len(candidates)} candidates")
    return set(sorted(c["prompt_id"] for c in candidates)[:num_prompts])


# The demo's second act: traffic of another kind arrives, questions about Python's data model
# (the built-in types, their methods, the special names that customize objects).
DATA_MODEL_TOPICS = frozenset(
    {
        "bltin-code-objects", "bltin-ellipsis-object", "bltin-null-object",
        "bltin-type-objects", "callable-types", "customization", "dict", "lists",
        "numeric-types", "objects", "sequence-types", "specialattrs", "specialnames",
        "string-methods", "types", "typesfunctions", "typesmapping", "typesmethods",
        "typesmodules", "typesseq", "typesseq-mutable",
    }
)  # fmt: skip


def split_by_kind(
    pool_path: Path, heldout_path: Path, topic_keys: tuple[str, ...] | None
) -> tuple[list[dict], list[dict]]:
    """The pool without data-model questions, and the data-model questions that arrive later:
    the pool's and the unasked ones, by id (the held-out file keeps its own, so the fixed
    evaluation set asks both kinds from the start)."""
    pool = [json.loads(line) for line in pool_path.read_text().splitlines()]
    heldout = {json.loads(line)["prompt_id"] for line in heldout_path.read_text().splitlines()}
    asked = {row["prompt_id"] for row in pool} | heldout
    unasked = [c for c in candidate_conversations(topic_keys) if c["prompt_id"] not in asked]
    arriving = [c for c in pool + unasked if c["source"] in DATA_MODEL_TOPICS]
    first = [row for row in pool if row["source"] not in DATA_MODEL_TOPICS]
    return first, sorted(arriving, key=lambda c: c["prompt_id"])

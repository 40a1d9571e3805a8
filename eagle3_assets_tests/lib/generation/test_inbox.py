"""The inbox: files registered once in arrival order, duplicates counted once, a share of each
held out by id, a malformed file named and skipped, batches that never shift."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_assets.lib.generation.conversations import batch_slice
from eagle3_assets.lib.generation.inbox import LEDGER, Inbox


def record(i: int) -> dict:
    return {"prompt_id": f"p{i:04d}", "messages": [{"role": "user", "content": f"question {i}"}]}


def drop(folder, name: str, ids) -> None:
    (folder / name).write_text("".join(json.dumps(record(i)) + "\n" for i in ids))


@pytest.fixture
def inbox(tmp_path):
    (tmp_path / "inbox").mkdir()
    return Inbox(tmp_path / "inbox", tmp_path / "state", heldout_fraction=0.2)


def test_files_register_once_with_duplicates_counted_once_and_a_share_held_out(inbox):
    pool_ids = [f"p{i:04d}" for i in range(10)]  # the pool file's prompts come first
    drop(inbox.folder, "2026-12-06T08-00.jsonl", range(5, 105))  # p0005..p0009 are in the pool
    frame = pa.Table.from_pylist([record(i) for i in range(95, 205)])  # p0095..p0104 again
    pq.write_table(frame, inbox.folder / "2026-12-06T09-00.parquet")
    (inbox.folder / ".2026-12-06T10-00.jsonl.tmp").write_text("{half a line")  # still writing

    first, second = inbox.register(pool_ids)

    held = {i for i in range(10, 205) if inbox.held_out(f"p{i:04d}")}
    assert (first.records, first.duplicates) == (100, 5)
    assert first.held_out == len(held & set(range(10, 105)))
    assert first.added == 95 - first.held_out
    assert (second.records, second.duplicates) == (110, 10)
    assert second.held_out == len(held & set(range(105, 205)))
    assert 0.1 < len(held) / 195 < 0.3  # the share is the fraction's, by id alone

    trained = [c.prompt_id for c in inbox.conversations(len(pool_ids))]
    assert trained == [f"p{i:04d}" for i in range(10, 205) if i not in held]  # arrival order
    earlier, newest = "inbox 00000-2026-12-06T08-00", "inbox 00001-2026-12-06T09-00"
    evaluation = inbox.evaluation_sets()
    assert list(evaluation) == [earlier, newest]
    assert [c.prompt_id for c in evaluation[newest]] == [
        f"p{i:04d}" for i in range(105, 205) if i in held
    ]
    evaluated = [c.prompt_id for rows in evaluation.values() for c in rows]
    assert sorted(evaluated) == sorted(f"p{i:04d}" for i in held)
    assert not set(evaluated) & set(trained)  # never trained on

    assert inbox.pending() == [] and inbox.register(pool_ids) == []  # once

    drop(inbox.folder, "2026-12-06T11-00.jsonl", range(205, 305))
    inbox.register(pool_ids)
    sets = inbox.evaluation_sets()  # the newest alone, every earlier file together
    both = "inbox 00000-2026-12-06T08-00..00001-2026-12-06T09-00"
    assert list(sets) == [both, "inbox 00002-2026-12-06T11-00"]
    assert sets[both] == evaluation[earlier] + evaluation[newest]


def test_a_malformed_file_is_named_with_its_line_and_skipped_without_blocking(inbox):
    drop(inbox.folder, "a.jsonl", range(0, 20))
    lines = [json.dumps(record(i)) for i in range(20, 30)]
    lines[6] = '{"prompt_id": "broken", "messages": [{"role": "user"'
    (inbox.folder / "b.jsonl").write_text("\n".join(lines) + "\n")
    drop(inbox.folder, "c.jsonl", range(30, 50))

    a, b, c = inbox.register([])

    assert b.error is not None and b.error.startswith(f"{inbox.folder / 'b.jsonl'}:7: not JSON")
    assert b.describe().startswith("b.jsonl: skipped, ")
    assert (b.records, b.added, b.held_out) == (0, 0, 0)
    assert a.added + a.held_out == 20 and c.added + c.held_out == 20
    trained = {x.prompt_id for x in inbox.conversations(0)}
    assert not trained & {f"p{i:04d}" for i in range(20, 30)}
    assert inbox.pending() == []  # recorded: not reported again every tick

    lines[6] = json.dumps(record(26))  # fixed: new bytes, registered after the others
    (inbox.folder / "b.jsonl").write_text("\n".join(lines) + "\n")
    (fixed,) = inbox.register([])
    assert (fixed.sequence, fixed.error, fixed.records, fixed.duplicates) == (3, None, 10, 0)
    assert fixed.added + fixed.held_out == 10


def test_batches_never_shift_as_files_arrive_or_leave(inbox):
    drop(inbox.folder, "a.jsonl", range(0, 40))
    inbox.register([])
    before = inbox.conversations(0)
    first_batch = batch_slice(before, 0, 16)

    drop(inbox.folder, "b.jsonl", range(35, 80))  # overlaps a.jsonl
    (inbox.folder / "a.jsonl").unlink()  # rotated away by the gateway
    (b,) = inbox.register([])
    after = inbox.conversations(0)
    assert b.duplicates == 5
    assert after[: len(before)] == before  # only grown at its end
    assert batch_slice(after, 0, 16) == first_batch


def test_a_pool_file_grown_after_inbox_files_is_refused_naming_both_counts(inbox):
    drop(inbox.folder, "a.jsonl", range(10, 20))
    inbox.register([f"p{i:04d}" for i in range(10)])
    with pytest.raises(ValueError) as refused:
        inbox.conversations(12)
    assert str(refused.value).startswith(
        "EAGLE3_PROMPTS: expected the 10 prompts the inbox's files were registered after, "
        "found 12: batches past the pool file would shift."
    )


def test_a_ledger_line_cut_by_a_crash_leaves_that_file_pending(inbox):
    drop(inbox.folder, "a.jsonl", range(0, 10))
    drop(inbox.folder, "b.jsonl", range(10, 20))
    inbox.register([])
    ledger = inbox.state_dir / LEDGER
    text = ledger.read_text()
    ledger.write_text(text[: len(text) - 20])  # b's line cut mid-append

    assert [path.name for path in inbox.pending()] == ["b.jsonl"]
    (again,) = inbox.register([])
    assert (again.name, again.sequence) == ("b.jsonl", 1)
    assert [e.name for e in inbox.ledger()] == ["a.jsonl", "b.jsonl"]
    assert [c.prompt_id for c in inbox.conversations(0)] == [
        f"p{i:04d}" for i in range(20) if not inbox.held_out(f"p{i:04d}")
    ]


def test_a_missing_inbox_folder_is_named(tmp_path):
    inbox = Inbox(tmp_path / "nowhere", tmp_path / "state", 0.1)
    with pytest.raises(FileNotFoundError, match="EAGLE3_INBOX: expected a folder, found none at"):
        inbox.pending()


@pytest.mark.parametrize("state", ["", "state"])
def test_an_inbox_folder_holding_its_own_ledger_is_refused(tmp_path, state):
    """EAGLE3_INBOX at the data volume's inbox/ (or above it) would read the ledger and the
    snapshots as new files, again at every tick."""
    (tmp_path / "inbox").mkdir()
    drop(tmp_path / "inbox", "a.jsonl", range(10))
    inbox = Inbox(tmp_path / "inbox", tmp_path / "inbox" / state, 0.1)
    with pytest.raises(ValueError, match="EAGLE3_INBOX: expected a folder outside") as refused:
        inbox.register([])
    assert f"found {tmp_path / 'inbox'}, which holds them" in str(refused.value)
    assert inbox.ledger() == []


def test_registered_files_are_hashed_again_only_when_size_or_time_change(inbox, monkeypatch):
    from eagle3_assets.lib.generation import inbox as inbox_module

    drop(inbox.folder, "a.jsonl", range(10))
    inbox.register([])
    hashed = []
    real = inbox_module.file_sha256
    monkeypatch.setattr(inbox_module, "file_sha256", lambda p: hashed.append(p.name) or real(p))
    assert inbox.pending() == [] and hashed == []  # every tick: a stat, no read
    os.utime(inbox.folder / "a.jsonl", ns=(1, 1))  # touched, same bytes
    assert inbox.pending() == [] and hashed == ["a.jsonl"]


def test_new_revisions_of_a_hub_dataset_bring_only_their_new_prompts(tmp_path, monkeypatch):
    """The real huggingface_hub client, offline, on a local hub cache: each revision's files
    are read from its snapshot; a file shared unchanged is not new, a grown file adds only
    its new rows, and a file in a subfolder registers under its path."""
    from eagle3_assets.lib.core.hub_files import dataset_snapshot
    from eagle3_assets.localdev.hub import publish_to_hub_cache

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo, cache, state = tmp_path / "repo", tmp_path / "hub", tmp_path / "state"
    repo.mkdir()
    patterns = ["*.jsonl", "*.json", "*.parquet"]

    def newest() -> Inbox:
        folder, revision = dataset_snapshot("hf://datasets/local/traffic", patterns, str(cache))
        return Inbox(folder, state, 0.2, revision)

    drop(repo, "traffic.jsonl", range(30))
    first_sha = publish_to_hub_cache(repo, cache, "local/traffic", repo_type="dataset")
    (first,) = newest().register([])
    assert (first.name, first.records, first.revision) == ("traffic.jsonl", 30, first_sha)

    drop(repo, "traffic.jsonl", range(50))  # grown by 20 rows
    (repo / "data").mkdir()
    drop(repo / "data", "2026-12-07.jsonl", range(100, 120))
    (repo / "README.md").write_text("a dataset card: not a prompt file\n")
    second_sha = publish_to_hub_cache(repo, cache, "local/traffic", repo_type="dataset")
    inbox = newest()
    assert inbox.revision == second_sha != first_sha
    nested, grown = inbox.register([])  # the dataset card is not a prompt file
    assert (nested.name, nested.records, nested.duplicates) == ("data/2026-12-07.jsonl", 20, 0)
    assert (grown.name, grown.records, grown.duplicates) == ("traffic.jsonl", 50, 30)
    assert {nested.revision, grown.revision} == {second_sha}
    assert grown.describe().startswith(f"traffic.jsonl@{second_sha[:12]}: 50 prompts")
    trained = [c.prompt_id for c in inbox.conversations(0)]
    order = [*range(30), *range(100, 120), *range(30, 50)]  # in arrival order
    assert trained == [f"p{i:04d}" for i in order if not inbox.held_out(f"p{i:04d}")]
    assert newest().register([]) == []  # the same revision again: nothing new

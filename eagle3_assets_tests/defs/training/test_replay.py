"""After a promotion, training learns the new batches and a replay share of the promoted
drafter's, by id; held-out samples stay out of both."""

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_assets.defs.training.assets import training_data
from eagle3_assets.lib.core.splits import held_out
from eagle3_assets.lib.evaluation.promotion import Version
from eagle3_assets.lib.generation.store import FINAL_NAME
from eagle3_assets.lib.hidden_states.shard_reader import trained_on
from eagle3_assets.lib.training.replay import replayed
from eagle3_assets.resources import Storage

# sample ids as generation writes them: the prompt id and a hash of the recipe
BATCHES = {f"batch-0000{b}": [f"b{b}-{i:03d}-1f2e3d" for i in range(200)] for b in range(3)}


@pytest.fixture
def storage(tmp_path):
    storage = Storage(root=str(tmp_path))
    for batch, ids in BATCHES.items():
        folder = storage.path("generations", batch)
        folder.mkdir(parents=True)
        prompts = [i.rsplit("-", 1)[0] for i in ids]
        pq.write_table(pa.table({"sample_id": ids, "prompt_id": prompts}), folder / FINAL_NAME)
    return storage


def promoted(batches: list[str]) -> Version:
    return Version(1, "/promotion/versions/v001", "sha", {"batches": batches}, {})


def test_before_any_promotion_every_batch_is_read_whole(storage):
    assert training_data(list(BATCHES), None, 0.25, storage) == (list(BATCHES), [])


def test_after_a_promotion_new_batches_whole_and_a_replay_share_of_the_learnt(storage):
    usable = list(BATCHES)
    new, exclude = training_data(usable, promoted(usable[:2]), 0.25, storage)
    assert new == ["batch-00002"]
    learnt = BATCHES["batch-00000"] + BATCHES["batch-00001"]
    assert exclude == sorted(i for i in learnt if not replayed(i, 0.25))
    assert 0.15 < 1 - len(exclude) / len(learnt) < 0.35  # about the share, chosen by id

    select = trained_on(0.1, exclude)  # what the run reads, with training's own holdout
    read = {i for ids in BATCHES.values() for i in ids if select(i)}
    heldout = {i for ids in BATCHES.values() for i in ids if held_out(i, 0.1)}
    assert not read & heldout  # held-out samples are never trained on, replayed or new
    assert read == {
        i
        for batch, ids in BATCHES.items()
        for i in ids
        if i not in heldout and (batch == "batch-00002" or replayed(i, 0.25))
    }


def test_nothing_new_since_the_promotion_stops_training_naming_what_it_learnt(storage):
    with pytest.raises(dg.Failure) as stopped:
        training_data(["batch-00000"], promoted(["batch-00000"]), 0.25, storage)
    assert stopped.value.description.startswith(
        "no usable batch is new since promoted v001, which learnt batch-00000: drop new "
        "prompt files in EAGLE3_INBOX"
    )

"""eagle3_drafter with streamed hidden states, through Dagster, on the production path: the
session server's generations, a real vLLM extraction server (extract_hidden_states) feeding
two gloo ranks through a spool of a few samples. The producer is killed with SIGKILL mid-run;
the materialization fails naming it, and the next one resumes from the last checkpoint (on the
extraction server the dead producer left running), trains each sample once per epoch and
stores no hidden states."""

import json
import re
import threading
import time
from pathlib import Path

import dagster as dg
import psutil
import pytest
from safetensors.torch import load_file

from eagle3_assets.definitions import resources_from_env
from eagle3_assets.defs.checkpoint.assets import drafter_checkpoint
from eagle3_assets.defs.generation.assets import synthetic_generations
from eagle3_assets.defs.hidden_states.resources import HiddenStatesRecipe
from eagle3_assets.defs.training.assets import build_eagle3_drafter
from eagle3_assets.defs.training.resources import TrainingRecipe
from eagle3_assets.lib.core.splits import held_out
from eagle3_assets_tests.conftest import vllm_extraction

pytestmark = pytest.mark.vllm

WINDOW_MB = 0.2  # a few samples of the test target in fp8+fp8


def kill_producer_after(data_root: Path, steps: int, killed: list[int]) -> None:
    """SIGKILL the producer once rank 0 has recorded `steps` steps."""
    while True:
        records = list(data_root.glob("drafter/runs/*/consumed/rank-0.jsonl"))
        if records and len(records[0].read_text().splitlines()) >= steps:
            break
        time.sleep(0.05)
    for process in psutil.Process().children(recursive=True):
        if "eagle3_assets.lib.hidden_states.streaming" in " ".join(process.cmdline()):
            process.kill()
            killed.append(process.pid)


def test_streamed_training_survives_a_killed_producer(pipeline_env, serving_python, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data_root = Path(pipeline_env["EAGLE3_DATA_ROOT"])
    resources = resources_from_env(pipeline_env)
    resources["training"] = TrainingRecipe(
        steps=12, lr=1e-2, ttt_length=3, nproc=2, batch_size=2, checkpoint_every=4
    )
    resources["hidden"] = HiddenStatesRecipe(
        mode="streamed",
        stream_window_mb=WINDOW_MB,
        backend="vllm",
        **vllm_extraction(serving_python),
    )
    eagle3_drafter = build_eagle3_drafter("streamed")
    instance = dg.DagsterInstance.ephemeral()
    assert dg.materialize([drafter_checkpoint], resources=resources, instance=instance).success
    instance.add_dynamic_partitions("sample_batches", ["batch-00000"])
    assert dg.materialize(
        [synthetic_generations], partition_key="batch-00000", resources=resources, instance=instance
    ).success

    def train() -> dg.ExecuteInProcessResult:
        return dg.materialize(
            [eagle3_drafter], resources=resources, instance=instance, raise_on_error=False
        )

    killed: list[int] = []
    killer = threading.Thread(target=kill_producer_after, args=(data_root, 3, killed))
    killer.start()
    first = train()
    killer.join()
    assert len(killed) == 1 and not first.success
    logs = "\n".join(str(r.user_message) for r in instance.all_logs(first.run_id))
    assert f"the hidden-states producer (pid {killed[0]}) died with signal 9" in logs

    second = train()
    assert second.success
    logs = [str(r.user_message) for r in instance.all_logs(second.run_id)]
    steps = [int(m.group(1)) for m in (re.match(r"step (\d+)/12: ", s) for s in logs) if m]
    assert steps[-1] == 12 and steps == list(range(steps[0], 13)) and steps[0] in (1, 5, 9)
    assert any(re.search(r"spool [\d.]+ of 0\.2 MB, producer [\d,]+ tokens/s", s) for s in logs)
    (event,) = second.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.materialization.metadata.items()}
    assert meta["hidden_states"] == "streamed" and meta["batches"] == "batch-00000"
    window = int(WINDOW_MB * 2**20)
    assert meta["spool_window_bytes"] == window and 0 < meta["spool_peak_bytes"] <= window
    assert meta["bottleneck"] in ("producer", "trainer")
    assert not (data_root / "hidden_states").exists()  # nothing stored

    run_dir = Path(meta["checkpoint"]).parents[1]
    assert list((run_dir / "stream" / "spool").iterdir()) == []
    trained = sorted(
        i for i in _sample_ids(data_root) if not held_out(i, resources["training"].holdout_fraction)
    )
    per_epoch = len(trained) // 2 * 2  # two ranks; the tail that does not divide is dropped
    consumed = [
        tuple(pair)
        for rank in (0, 1)
        for line in (run_dir / "consumed" / f"rank-{rank}.jsonl").read_text().splitlines()
        for pair in json.loads(line)["samples"]
    ]
    assert len(consumed) == 12 * 2 * 2
    full_epochs = len(consumed) // per_epoch
    for epoch in range(full_epochs):  # each sample at most once per epoch, over both ranks
        ids = [i for e, i in consumed if e == epoch]
        assert len(ids) == len(set(ids)) == per_epoch and set(ids) <= set(trained)
    exported = load_file(Path(meta["export"]) / "model.safetensors")
    config = json.loads((Path(meta["export"]) / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6] and "fc.weight" in exported


def _sample_ids(data_root: Path) -> list[str]:
    import pyarrow.parquet as pq

    table = pq.read_table(data_root / "generations" / "batch-00000" / "generations.parquet")
    return table.column("sample_id").to_pylist()

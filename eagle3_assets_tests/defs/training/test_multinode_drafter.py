"""eagle3_drafter across two "nodes" on 127.0.0.1, no vLLM: Dagster launches node 0 through
Pipes, the test starts node 1 with the command the asset logs, and rank 0 (on node 0) reports
the materialization. The hidden states come from the test world's target-v2 through
transformers (greedy answers, hf extraction), the warm start is an untrained drafter."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)
from transformers import AutoTokenizer

from eagle3_assets.definitions import resources_from_env
from eagle3_assets.defs.hidden_states.assets import CHECKS
from eagle3_assets.defs.training.assets import eagle3_drafter
from eagle3_assets.lib.core.layer_ids import default_aux_layers
from eagle3_assets.lib.hidden_states.extract import (
    ExtractionSettings,
    LayerSelection,
    extract_batch,
)
from eagle3_assets.lib.hidden_states.hf_backend import HFTarget
from eagle3_assets.lib.hidden_states.shard_format import ShardFormat
from eagle3_assets.lib.hidden_states.token_sequences import build_sequences
from eagle3_assets.lib.training.torchrun import torchrun_command
from eagle3_assets.localdev.greedy import greedy_generation_rows
from eagle3_assets.localdev.hub import make_untrained_drafter
from eagle3_assets_tests.conftest import free_port

BATCH = "batch-00000"


def extract(world, data_root: Path) -> None:
    """One batch of hidden states and a warm start, where the asset looks for them."""
    target = world.target_v2
    layers_total = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    layers = LayerSelection(default_aux_layers(layers_total), layers_total, "default")
    rows = greedy_generation_rows(target, world.prompts, 24, 24)
    sequences = build_sequences(rows, AutoTokenizer.from_pretrained(target))
    hidden_size = json.loads((target / "config.json").read_text())["hidden_size"]
    extract_batch(
        sequences,
        data_root / "hidden_states" / BATCH,
        lambda: HFTarget(target, layers.ids, dtype="float32", device="cpu"),
        layers,
        hidden_size,
        ExtractionSettings(ShardFormat("fp8", "fp8")),
        {"target": "target-v2"},
    )
    make_untrained_drafter(target, data_root / "drafter" / "warm_start", 256, seed=0)


def report_checked_batch(instance: dg.DagsterInstance, batch: str) -> None:
    """What an extraction outside Dagster reports: the batch, then its checks against it
    (eagle3_drafter trains only on batches whose every check passed)."""
    key = dg.AssetKey("hidden_states")
    instance.report_runless_asset_event(dg.AssetMaterialization(key, partition=batch))
    (record,) = instance.fetch_materializations(key, limit=1).records
    target = AssetCheckEvaluationTargetMaterializationData(
        storage_id=record.storage_id, run_id=record.run_id, timestamp=record.timestamp
    )
    for name in CHECKS:
        instance.report_runless_asset_event(
            dg.AssetCheckEvaluation(
                key, name, passed=True, target_materialization_data=target, partition=batch
            )
        )


def test_two_nodes_train_and_node_0_reports_through_pipes(test_world, tmp_path):
    data_root = tmp_path / "data"
    extract(test_world, data_root)
    endpoint = f"127.0.0.1:{free_port()}"
    env = {
        "EAGLE3_TARGET_PATH": str(test_world.target_v2),
        "EAGLE3_DATA_ROOT": str(data_root),
        "EAGLE3_TRAIN_STEPS": "3",
        "EAGLE3_TRAIN_BATCH_SIZE": "2",
        "EAGLE3_TTT_LENGTH": "2",
        "EAGLE3_TRAIN_NPROC": "1",
        "EAGLE3_TRAIN_NNODES": "2",
        "EAGLE3_TRAIN_RDZV_ENDPOINT": endpoint,
    }
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("sample_batches", [BATCH])
    report_checked_batch(instance, BATCH)

    node1: list[subprocess.CompletedProcess] = []

    def join_as_node_1() -> None:  # what an operator does on the second host
        deadline = time.monotonic() + 120
        while not (runs := list(data_root.glob("drafter/runs/*/run.json"))):
            assert time.monotonic() < deadline, "the asset never wrote run.json"
            time.sleep(0.2)
        entry = ["-m", "eagle3_assets.training_entry", str(runs[0])]
        command = torchrun_command(entry, 1, 2, endpoint, node_rank=1, python=sys.executable)
        node1.append(subprocess.run(command, capture_output=True, text=True, timeout=300))

    worker = threading.Thread(target=join_as_node_1)
    worker.start()
    result = dg.materialize([eagle3_drafter], resources=resources_from_env(env), instance=instance)
    worker.join(timeout=300)

    assert result.success
    (done,) = node1
    assert done.returncode == 0, done.stdout + done.stderr
    logs = [record.user_message for record in instance.all_logs(result.run_id)]
    assert any(f"waiting for nodes 1..1 at {endpoint}" in m and "--node-rank=1" in m for m in logs)
    assert any("step 3/3: loss" in m for m in logs)  # streamed by rank 0, on node 0
    assert not any("step 3/3" in line for line in done.stdout.splitlines())  # node 1 is silent
    (event,) = result.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.materialization.metadata.items()}
    assert meta["steps"] == 3
    state = json.loads((Path(meta["checkpoint"]) / "state.json").read_text())
    assert len(state["ranks"]) == 2  # one data position per rank: both nodes trained
    assert (Path(meta["export"]) / "model.safetensors").exists()

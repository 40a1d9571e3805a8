"""synthetic_generations through Dagster against the session's real vLLM server."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from eagle3_assets.definitions import resources_from_env
from eagle3_assets.defs.generation.assets import synthetic_generations
from eagle3_assets.lib.serving.vllm_probe import fetch_metrics

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[3]


def requests_served(base_url: str) -> float:
    """vLLM's own count of finished requests: what the server saw, not what we think we sent."""
    return sum(fetch_metrics(base_url)["vllm:request_success_total"].values())


def wait_idle(base_url: str, timeout_s: float = 60.0) -> None:
    """Let the killed run's last in-flight request finish (or abort) before counting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = fetch_metrics(base_url)
        busy = sum(metrics["vllm:num_requests_running"].values())
        busy += sum(metrics["vllm:num_requests_waiting"].values())
        if busy == 0:
            return
        time.sleep(0.2)
    raise AssertionError("vLLM still busy with the killed run's requests")


def batch_ids(env: dict[str, str], key: str) -> list[str]:
    resources = resources_from_env(env)
    return [c.prompt_id for c in resources["prompt_pool"].batch(key, resources["storage"])]


def materialize(instance, env: dict[str, str], key: str) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        [synthetic_generations],
        partition_key=key,
        instance=instance,
        resources=resources_from_env(env),
        raise_on_error=False,
    )


def test_a_batch_end_to_end(pipeline_env, dagster_home):
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions("sample_batches", ["batch-00000"])
        result = materialize(instance, pipeline_env, "batch-00000")
    assert result.success
    (event,) = result.get_asset_materialization_events()
    meta = {k: v.value for k, v in event.materialization.metadata.items()}
    table = pq.read_table(meta["path"])
    expected = batch_ids(pipeline_env, "batch-00000")
    assert len(expected) == 16
    assert sorted(table.column("prompt_id").to_pylist()) == sorted(expected)
    assert all(r.strip() for r in table.column("response").to_pylist())
    assert set(table.column("model").to_pylist()) == {"target-v2"}
    assert all(ids for ids in table.column("token_ids").to_pylist())  # return_token_ids honoured
    assert meta["samples"] == 16 and meta["requested"] == 16 and meta["resumed"] == 0
    # the usage vLLM reported is the token ids it returned, row by row and in the metadata
    rows = table.to_pylist()
    assert [r["completion_tokens"] for r in rows] == [len(r["token_ids"]) for r in rows]
    assert [r["prompt_tokens"] for r in rows] == [len(r["prompt_token_ids"]) for r in rows]
    assert meta["completion_tokens"] == sum(len(r["token_ids"]) for r in rows)
    assert sum(meta["finish_reasons"].values()) == 16
    checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
    assert checks["one_row_per_prompt"].passed
    assert checks["one_row_per_prompt"].metadata["rows"].value == 16


def test_kill_minus_9_mid_batch_then_resume(pipeline_env, dagster_home, vllm_target):
    key = "batch-00001"
    env = {**os.environ, **pipeline_env, "EAGLE3_CONCURRENCY": "1"}  # slow enough to kill
    batch_dir = Path(pipeline_env["EAGLE3_DATA_ROOT"]) / "generations" / key
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions("sample_batches", [key])
    dagster = Path(sys.executable).parent / "dagster"
    process = subprocess.Popen(
        [str(dagster), "asset", "materialize", "-m", "eagle3_assets.definitions",
         "--select", "synthetic_generations", "--partition", key],
        cwd=REPO, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while not list((batch_dir / "parts").glob("*.parquet")):
        assert process.poll() is None, "the run ended before anything persisted"
        assert time.monotonic() < deadline, "no part file in time"
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (batch_dir / "generations.parquet").exists()  # never a partial final file
    persisted = {
        row for part in (batch_dir / "parts").glob("*.parquet")
        for row in pq.read_table(part).column("prompt_id").to_pylist()
    }  # fmt: skip
    assert 0 < len(persisted) < 16

    wait_idle(vllm_target.base_url)
    before = requests_served(vllm_target.base_url)
    # What resumes is on disk, not in the instance: a fresh one (the killed run, started
    # outside any daemon, still holds its `vllm` slot in the other; deploy/
    # test_crash_recovery.py is where monitoring and retries free a killed run's).
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("sample_batches", [key])
        result = materialize(instance, pipeline_env, key)
    sent_again = requests_served(vllm_target.base_url) - before
    assert result.success
    table = pq.read_table(batch_dir / "generations.parquet")
    assert sorted(table.column("prompt_id").to_pylist()) == sorted(batch_ids(pipeline_env, key))
    assert sent_again == 16 - len(persisted) < 16  # only what was missing
    (event,) = result.get_asset_materialization_events()
    assert event.materialization.metadata["resumed"].value == len(persisted)

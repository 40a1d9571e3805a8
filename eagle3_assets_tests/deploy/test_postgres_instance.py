"""The documented Postgres instance (deploy/dagster-postgres.yaml) against a real PostgreSQL
server: what a deployment keeps in it (runs, event logs, schedule state and ticks, dynamic
partitions) is still there, value for value, after the webserver restarts."""

from __future__ import annotations

import time
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.scheduler.instigation import InstigatorType, TickData, TickStatus

from eagle3_assets_tests.conftest import REPO, free_port
from eagle3_assets_tests.deploy.helpers import pipeline_env, project_defs, write_pool
from eagle3_assets_tests.deploy.postgres import (
    PG_CONFIG,
    Postgres,
    running_postgres,
    use_postgres_instance,
)
from eagle3_assets_tests.openai_stub import OpenAIStub
from eagle3_assets_tests.webserver import Webserver, running_webserver

REPOSITORY = {"repositoryLocationName": "eagle3_assets", "repositoryName": "__repository__"}

SNAPSHOT = """
query Snapshot($runId: ID!, $schedule: ScheduleSelector!) {
  instance { info }
  runsOrError { ... on Runs { results { runId jobName status tags { key value } } } }
  logsForRun(runId: $runId) { ... on EventConnection { events {
    __typename ... on MessageEvent { message stepKey }
  } } }
  assetOrError(assetKey: {path: ["synthetic_generations"]}) { ... on Asset {
    assetMaterializations { runId partition
      metadataEntries { label ... on IntMetadataEntry { intValue } } }
  } }
  assetNodeOrError(assetKey: {path: ["synthetic_generations"]}) {
    ... on AssetNode { partitionKeys }
  }
  scheduleOrError(scheduleSelector: $schedule) { ... on Schedule {
    id scheduleState { status ticks(limit: 10) { status skipReason timestamp } }
  } }
}
"""

ADD_PARTITION = """
mutation Add($repo: RepositorySelector!, $key: String!) {
  addDynamicPartition(repositorySelector: $repo, partitionsDefName: "sample_batches",
                      partitionKey: $key) { __typename }
}
"""

STOP_SCHEDULE = """
mutation Stop($id: String!) {
  stopRunningSchedule(id: $id) { __typename ... on ScheduleStateResult {
    scheduleState { status } } }
}
"""


def test_config_matches_the_default_instance_except_storage() -> None:
    """The Postgres variant differs only in where it stores: pools, run monitoring and run
    retries cannot drift between a laptop and a deployment."""
    default = yaml.safe_load((REPO / "dagster.yaml").read_text())
    postgres = yaml.safe_load(PG_CONFIG.read_text())
    assert default["storage"]["custom"]["class"] == "SqliteStorage"  # the default stays SQLite
    assert {k: v for k, v in default.items() if k != "storage"} == {
        k: v for k, v in postgres.items() if k != "storage"
    }
    secrets = postgres["storage"]["custom"]["config"]["postgres_db"]
    del secrets["scheme"]  # the driver, not a secret
    assert all(set(value) == {"env"} for value in secrets.values())  # no literal credentials


@pytest.fixture(scope="module")
def postgres() -> Postgres:
    with running_postgres() as server:
        yield server


def snapshot(server: Webserver, run_id: str) -> dict:
    schedule = {**REPOSITORY, "scheduleName": "batch_backfill_schedule"}
    return server.graphql(SNAPSHOT, {"runId": run_id, "schedule": schedule})


def test_state_survives_a_webserver_restart(
    postgres: Postgres, dagster_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = time.monotonic()
    home = dagster_home
    use_postgres_instance(home, postgres, monkeypatch)

    with OpenAIStub() as stub:
        env = pipeline_env(
            stub.base_url, write_pool(tmp_path / "pool.jsonl", 8), tmp_path / "data", 4
        )
        defs = project_defs(monkeypatch, env)
        with dg.DagsterInstance.get() as instance:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            instance.add_dynamic_partitions("sample_batches", ["batch-00000"])
            result = defs.resolve_job_def("generate_batch").execute_in_process(
                instance=instance, partition_key="batch-00000"
            )
            assert result.success
            run_id = result.run_id
    assert stub.answered == 4

    port = free_port()
    log = tmp_path / "webserver.log"
    server_env = {**env, **postgres.env()}
    with running_webserver(home, server_env, port, log) as server:
        first_start = time.monotonic() - started
        repo = {**REPOSITORY}
        added = server.graphql(ADD_PARTITION, {"repo": repo, "key": "batch-00001"})
        assert added["addDynamicPartition"]["__typename"] == "AddDynamicPartitionSuccess"
        schedule_id = snapshot(server, run_id)["scheduleOrError"]["id"]
        stopped = server.graphql(STOP_SCHEDULE, {"id": schedule_id})
        assert stopped["stopRunningSchedule"]["scheduleState"]["status"] == "STOPPED"
        with dg.DagsterInstance.get() as instance:  # a tick as the scheduler daemon writes it
            (state,) = [
                s for s in instance.all_instigator_state()
                if s.name == "batch_backfill_schedule"
            ]  # fmt: skip
            instance.create_tick(
                TickData(
                    instigator_origin_id=state.instigator_origin_id,
                    instigator_name=state.name,
                    instigator_type=InstigatorType.SCHEDULE,
                    status=TickStatus.SKIPPED,
                    timestamp=1_700_000_000.0,
                    selector_id=state.selector_id,
                    skip_reason="vllm_server is not observed ready",
                )
            )
        before = snapshot(server, run_id)

    with running_webserver(home, server_env, port, log) as server:  # same port, fresh process
        after = snapshot(server, run_id)
    total = time.monotonic() - started
    print(f"postgres restart test: first webserver ready at {first_start:.1f}s, total {total:.1f}s")

    info = after.pop("instance")["info"]  # the instance's config; its key order varies
    before.pop("instance")
    assert after == before
    assert "PostgresRunStorage" in info and postgres.password not in info
    (run,) = after["runsOrError"]["results"]
    assert (run["runId"], run["jobName"], run["status"]) == (run_id, "generate_batch", "SUCCESS")
    assert {"key": "dagster/partition", "value": "batch-00000"} in run["tags"]
    events = after["logsForRun"]["events"]
    kinds = [e["__typename"] for e in events]
    assert kinds.count("MaterializationEvent") == 1 and "RunSuccessEvent" in kinds
    messages = [e.get("message") or "" for e in events]
    assert any(m.startswith("batch-00000: 4 prompts from ") for m in messages)
    (materialization,) = after["assetOrError"]["assetMaterializations"]
    assert (materialization["runId"], materialization["partition"]) == (run_id, "batch-00000")
    metadata = {e["label"]: e.get("intValue") for e in materialization["metadataEntries"]}
    assert metadata["samples"] == 4 and metadata["requested"] == 4
    assert after["assetNodeOrError"]["partitionKeys"] == ["batch-00000", "batch-00001"]
    state = after["scheduleOrError"]["scheduleState"]
    assert state["status"] == "STOPPED"  # its default is RUNNING: the stored state won
    assert state["ticks"] == [
        {"status": "SKIPPED", "skipReason": "vllm_server is not observed ready",
         "timestamp": 1_700_000_000.0}
    ]  # fmt: skip
    with postgres.connect() as conn, conn.cursor() as cursor:  # and it is Postgres that has them
        cursor.execute("SELECT run_id FROM runs")
        assert cursor.fetchall() == [(run_id,)]
        cursor.execute("SELECT partition FROM dynamic_partitions ORDER BY partition")
        assert cursor.fetchall() == [("batch-00000",), ("batch-00001",)]

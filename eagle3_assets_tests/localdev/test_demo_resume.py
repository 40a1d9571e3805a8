"""`make demo` run again after a kill -9 follows the server that answers now: the 'ready'
stored before the kill and the killed server's launch run are history; a failed launch run
that will be retried is followed into its retry, and only a failure for good ends the demo.

A real instance (the project's dagster.yaml, so Dagster's run retries tag the failures) and
a server that answers vLLM's probe endpoints; runs and observations written as the daemon
would write them."""

from __future__ import annotations

import time

import dagster as dg
import pytest
from dagster._core.events import JobFailureData, RunFailureReason
from dagster._core.storage.tags import PARENT_RUN_ID_TAG, ROOT_RUN_ID_TAG, WILL_RETRY_TAG

from eagle3_assets.localdev.demo import LAUNCH_JOB, SENSOR_NAME, attempts, follow_launch
from eagle3_assets_tests.fault_server import FaultServer

OLD_START, NEW_START = 1_700_000_000, 1_700_000_600


@pytest.fixture
def instance(dagster_home):
    with dg.DagsterInstance.get() as instance:
        yield instance


@pytest.fixture
def server():
    with FaultServer() as server:
        server.behaviour.start_time = float(NEW_START)
        yield server


def observe(instance: dg.DagsterInstance, url: str, state: str, start: int) -> None:
    """What the readiness sensor records (sensors.py's _observation, the fields read here)."""
    metadata = {"state": state, "base_url": url, "detail": f"{state} at start {start}"}
    if state == "ready":
        metadata |= {"max_model_len": 512, "vllm_version": "0.0.fault"}
        metadata["instance_id"] = f"{url}@{start}"
    instance.report_runless_asset_event(dg.AssetObservation("vllm_server", metadata=metadata))


def launch_run(
    instance: dg.DagsterInstance,
    server_instance: str,
    parent: dg.DagsterRun | None = None,
    status: dg.DagsterRunStatus = dg.DagsterRunStatus.STARTED,
) -> dg.DagsterRun:
    """A launch run the sensor requested for one server start (or the retry of `parent`)."""
    tags = {"dagster/sensor_name": SENSOR_NAME, "eagle3/server_instances": server_instance}
    lineage = {}
    if parent is not None:
        root = parent.root_run_id or parent.run_id
        tags |= {PARENT_RUN_ID_TAG: parent.run_id, ROOT_RUN_ID_TAG: root}
        lineage = {"parent_run_id": parent.run_id, "root_run_id": root}
    return instance.add_run(dg.DagsterRun(job_name=LAUNCH_JOB, status=status, tags=tags, **lineage))


def fail(instance: dg.DagsterInstance, run: dg.DagsterRun) -> dg.DagsterRun:
    """The run's worker died: marked failed as run monitoring does; run retries tag it."""
    failure = JobFailureData(error=None, failure_reason=RunFailureReason.RUN_WORKER_RESTART)
    instance.report_run_failed(run, "run worker died", failure)
    return instance.get_run_by_id(run.run_id)


def test_a_restarted_demo_follows_the_current_server_and_the_retry(instance, server):
    url = server.base_url
    # before the kill: the old server was ready and its launch run died with everything else
    observe(instance, url, "ready", OLD_START)
    old_run = fail(instance, launch_run(instance, f"{url}@{OLD_START}"))
    time.sleep(0.01)
    since = time.time()  # the demo starts again, the new server not yet observed
    said: list[str] = []
    with pytest.raises(TimeoutError):  # nothing of the current server to follow yet
        follow_launch(instance, time.monotonic(), 3, said.append, since, url)
    assert said == []  # neither the stale 'ready' nor the old server's failed run

    # the new server seen loading, then ready; its launch run's worker dies; the retry
    observe(instance, url, "loading", NEW_START)
    observe(instance, url, "ready", NEW_START)
    current = fail(instance, launch_run(instance, f"{url}@{NEW_START}"))
    assert current.tags[WILL_RETRY_TAG] == "true"
    retry = launch_run(instance, f"{url}@{NEW_START}", current, dg.DagsterRunStatus.SUCCESS)
    followed = follow_launch(instance, time.monotonic(), 30, said.append, since, url)

    assert followed.run_id == retry.run_id and followed.status == dg.DagsterRunStatus.SUCCESS
    narration = [line.split("s ", 1)[1] for line in said]  # without the clock
    assert narration == [
        f"vllm_server observed: loading (loading at start {NEW_START})",
        "vllm_server observed: ready (max_model_len 512, vLLM 0.0.fault)",
        f"launch run {current.run_id[:8]}: FAILURE (a retry follows)",
        f"launch run {retry.run_id[:8]}: SUCCESS",
    ]
    assert not any(old_run.run_id[:8] in line for line in said)


def test_a_retry_that_fails_too_has_failed_for_good(instance, server):
    url = server.base_url
    since = time.time()
    observe(instance, url, "ready", NEW_START)
    first = fail(instance, launch_run(instance, f"{url}@{NEW_START}"))
    # failed, the retry not created yet: still waiting, not a failure for good
    assert [run.run_id for run in attempts(instance, first)] == [first.run_id]
    said: list[str] = []
    with pytest.raises(TimeoutError):
        follow_launch(instance, time.monotonic(), 3, said.append, since, url)
    assert said[-1].endswith(f"launch run {first.run_id[:8]}: FAILURE (a retry follows)")
    second = fail(instance, launch_run(instance, f"{url}@{NEW_START}", parent=first))
    assert second.tags[WILL_RETRY_TAG] == "true"
    retry = fail(instance, launch_run(instance, f"{url}@{NEW_START}", parent=second))
    assert retry.tags[WILL_RETRY_TAG] == "false"  # max_retries: 2
    followed = follow_launch(instance, time.monotonic(), 30, said.append, since, url)

    assert followed.run_id == retry.run_id and followed.status == dg.DagsterRunStatus.FAILURE
    assert said[-1].endswith(f"launch run {retry.run_id[:8]}: FAILURE")

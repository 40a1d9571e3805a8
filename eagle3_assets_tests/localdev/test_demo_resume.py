"""`make demo` run again after a kill -9 follows the server that answers now: the 'ready'
stored before the kill and the killed server's launch run are history; a failed launch run
that will be retried is followed into its retry, and only a failure for good ends the demo.

A real instance (the project's dagster.yaml, so Dagster's run retries tag the failures) and
a server that answers vLLM's probe endpoints; runs and observations written as the daemon
would write them."""

from __future__ import annotations

import dataclasses
import time

import dagster as dg
import pytest
from dagster._core.events import JobFailureData, RunFailureReason
from dagster._core.storage.tags import PARENT_RUN_ID_TAG, ROOT_RUN_ID_TAG, WILL_RETRY_TAG

from eagle3_assets.lib.serving.vllm_launcher import (
    VLLMLaunchSpec,
    group_alive,
    launched_spec,
    read_pid,
    start,
    stop,
    terminate_group,
)
from eagle3_assets.localdev.demo import (
    LAUNCH_JOB,
    SENSOR_NAME,
    Narrator,
    StoryStopped,
    attempts,
    follow_launch,
    restart_if_dead,
)
from eagle3_assets_tests.conftest import free_port
from eagle3_assets_tests.fault_server import FaultServer
from eagle3_assets_tests.lib.serving.test_vllm_launcher import OBEYS_TERM, fake_venv

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


def test_a_step_whose_retries_are_spent_stops_the_story_with_its_run_and_error(instance):
    """kill -9 of drafter_evaluation+eagle3_drafter three times: the third failure is final,
    and the demo says so instead of waiting for an evaluation that nothing asks for."""
    since = time.time()
    narrator = Narrator(instance, time.monotonic(), since, lambda line: None)
    selection = frozenset({dg.AssetKey("drafter_evaluation"), dg.AssetKey("eagle3_drafter")})

    def attempt(parent: dg.DagsterRun | None = None) -> dg.DagsterRun:
        run = dg.DagsterRun(job_name="__ASSET_JOB", asset_selection=selection)
        if parent is not None:
            root = parent.root_run_id or parent.run_id
            run = run._replace(
                parent_run_id=parent.run_id,
                root_run_id=root,
                tags={PARENT_RUN_ID_TAG: parent.run_id, ROOT_RUN_ID_TAG: root},
            )
        return fail(instance, instance.add_run(run._replace(status=dg.DagsterRunStatus.STARTED)))

    first = attempt()
    with pytest.raises(TimeoutError):  # a retry is coming: still waiting
        narrator.until(lambda: None, "evaluation of candidate 1", timeout_s=3)
    last = attempt(attempt(first))
    assert last.tags[WILL_RETRY_TAG] == "false"
    with pytest.raises(StoryStopped) as stopped:
        narrator.until(lambda: None, "evaluation of candidate 1", timeout_s=30)
    (step,) = stopped.value.steps
    assert (step.run_id, step.label, step.error) == (
        last.run_id,
        "drafter_evaluation+eagle3_drafter",
        "run worker died",
    )
    assert step.tell().startswith(
        f"drafter_evaluation+eagle3_drafter failed for good in run {last.run_id[:8]} (run "
        f"worker died); its log: `make ui` -> Runs -> {last.run_id[:8]}. Fix the cause, then "
        "`make demo` again"
    )


def test_the_server_waited_on_is_started_again_as_last_launched_when_it_dies(tmp_path):
    """vLLM's engine killed, its API server gone seconds later: the demo starts it again,
    with what it was last launched with (a rollout's drafter), not the plain spec."""
    plain = VLLMLaunchSpec(
        model="m", python=fake_venv(tmp_path, OBEYS_TERM), run_dir=tmp_path / "r", port=free_port()
    )
    rolled_out = dataclasses.replace(plain, speculative_config={"model": "drafter-v002"})
    said: list[str] = []
    died = start(rolled_out)
    try:
        restart_if_dead(plain, said.append)
        assert said == [] and read_pid(plain.pid_file) == died  # alive: left alone
        terminate_group(died, grace_s=5.0)  # its pid file stays: died, not stopped
        restart_if_dead(plain, said.append)
        again = read_pid(plain.pid_file)
        assert again != died and group_alive(again)
        assert launched_spec(plain.run_dir) == rolled_out
        assert said == [
            f"the vLLM server it waited on (pid {died}) exited: started it again as last "
            f"launched (pid {again}); log: {plain.log_file}"
        ]
    finally:
        stop(plain.run_dir, grace_s=5.0)

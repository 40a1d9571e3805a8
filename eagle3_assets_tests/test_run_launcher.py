"""MonitoredRunLauncher's verdict on a STARTED run's worker, on the project's instance, with
real processes standing in for run workers: alive, killed, or its pid taken by another."""

import json
import logging
import subprocess
import sys
import time

import dagster as dg
import pytest
from dagster._core.events import DagsterEvent, DagsterEventType, EngineEventData
from dagster._core.launcher import WorkerStatus
from dagster._core.storage.tags import GRPC_INFO_TAG

from eagle3_assets.run_launcher import MonitoredRunLauncher
from eagle3_assets_tests.conftest import free_port

LOCAL_SERVER = {GRPC_INFO_TAG: json.dumps({"host": "localhost", "port": free_port()})}


def started_run(
    instance: dg.DagsterInstance, tags: dict[str, str], pid: int | None, at: float | None = None
) -> dg.DagsterRun:
    """A STARTED run as the daemon's launcher leaves it: the code server's tag, and the event
    its gRPC server writes once the worker is up (at `at`, default now)."""
    run = instance.add_run(
        dg.DagsterRun(job_name="generate_batch", status=dg.DagsterRunStatus.STARTED, tags=tags)
    )
    if pid is not None:
        message = f"Started process for run (pid: {pid})."
        event = DagsterEvent(
            event_type_value=DagsterEventType.ENGINE_EVENT.value,
            job_name=run.job_name,
            message=message,
            event_specific_data=EngineEventData.in_process(pid),
        )
        entry = dg.EventLogEntry(
            error_info=None,
            level=logging.INFO,
            user_message=message,
            run_id=run.run_id,
            timestamp=time.time() if at is None else at,
            dagster_event=event,
        )
        instance.store_event(entry)
    return run


@pytest.fixture
def instance(dagster_home) -> dg.DagsterInstance:
    with dg.DagsterInstance.get() as instance:
        assert isinstance(instance.run_launcher, MonitoredRunLauncher)  # what dagster.yaml says
        yield instance


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_a_live_worker_runs_and_a_killed_one_failed(instance) -> None:
    worker = sleeper()
    try:
        run = started_run(instance, LOCAL_SERVER, worker.pid)
        alive = instance.run_launcher.check_run_worker_health(run)
        assert alive.status == WorkerStatus.RUNNING, alive
    finally:
        worker.kill()
        worker.wait()
    dead = instance.run_launcher.check_run_worker_health(run)
    assert dead.status == WorkerStatus.FAILED
    assert f"its run worker (pid {worker.pid} on this host" in dead.msg
    assert "the retry resumes from there" in dead.msg


def test_a_pid_taken_by_a_later_process_is_not_the_worker(instance) -> None:
    """A dead worker's pid reused by a process started after the worker reported it."""
    later = sleeper()
    try:
        run = started_run(instance, LOCAL_SERVER, later.pid, at=time.time() - 60)
        result = instance.run_launcher.check_run_worker_health(run)
        assert result.status == WorkerStatus.FAILED
        assert f"pid {later.pid} on this host" in result.msg
    finally:
        later.kill()
        later.wait()


def test_runs_not_launched_through_a_code_server_are_left_alone(instance) -> None:
    """`dagster job execute` and in-process runs carry no code server: never failed by us."""
    run = started_run(instance, {}, pid=None)
    assert instance.run_launcher.check_run_worker_health(run).status == WorkerStatus.RUNNING


def test_a_remote_worker_is_asked_of_its_code_server(instance) -> None:
    """On another host the pid means nothing here: the code server is asked; unreachable is
    'cannot tell', which must not fail a run that may be alive."""
    remote = {GRPC_INFO_TAG: json.dumps({"host": "gpu-node-7.invalid", "port": 4000})}
    run = started_run(instance, remote, pid=4242)
    result = instance.run_launcher.check_run_worker_health(run)
    assert result.status == WorkerStatus.RUNNING
    assert "code server at gpu-node-7.invalid:4000 unreachable" in result.msg

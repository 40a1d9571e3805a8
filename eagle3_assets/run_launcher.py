"""Dagster's default run launcher, made checkable by run monitoring.

Dagster's DefaultRunLauncher cannot tell the monitoring daemon whether a run's worker is
alive, so a worker killed together with its code server (kill -9 of the whole tree, an OOM
kill, a reboot) left its run STARTED forever, holding its pool slots. This launcher answers
that question, and the monitoring daemon then marks the run failed, frees its slots, and run
retries resume it from its saved progress. Configured in dagster.yaml (`run_launcher`).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from dagster import DagsterEventType, DagsterInstance, DagsterRun, DefaultRunLauncher
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus
from dagster._core.storage.tags import GRPC_INFO_TAG

# What Dagster's gRPC server writes once the run worker process is up (dagster/_grpc/impl.py).
WORKER_STARTED = "Started process for run (pid: "
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", socket.gethostname()}


class MonitoredRunLauncher(DefaultRunLauncher):
    """Runs start in the code server, as with DefaultRunLauncher; a STARTED run's worker is
    found alive or gone, on this host by its pid, elsewhere by asking its code server."""

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        if GRPC_INFO_TAG not in run.tags:  # not launched by us (`dagster job execute`, tests)
            return CheckRunHealthResult(WorkerStatus.RUNNING, "not launched by this launcher")
        server = json.loads(run.tags[GRPC_INFO_TAG])
        where = server.get("socket") or f"{server.get('host')}:{server.get('port')}"
        worker = worker_started(self._instance, run.run_id)
        if worker is not None and ("socket" in server or server.get("host") in LOCAL_HOSTS):
            pid, reported_at = worker
            started = process_start_time(pid)
            # The worker reported its pid after it started: a later start is a reused pid.
            if started is not None and started <= reported_at + 1.0:
                return CheckRunHealthResult(WorkerStatus.RUNNING, f"worker pid {pid} is alive")
            return CheckRunHealthResult(
                WorkerStatus.FAILED,
                f"its run worker (pid {pid} on this host, started by the code server at "
                f"{where}) is gone: killed (kill -9, OOM) or its machine restarted. Every asset "
                "keeps its progress on disk; the retry resumes from there.",
            )
        return self._ask_code_server(run.run_id, server, where)

    def _ask_code_server(self, run_id: str, server: dict, where: str) -> CheckRunHealthResult:
        """A worker on another host: its code server knows whether it still runs it."""
        from dagster._grpc.client import DagsterGrpcClient
        from dagster._grpc.types import CanCancelExecutionRequest, CanCancelExecutionResult
        from dagster_shared.serdes import deserialize_value

        client = DagsterGrpcClient(
            port=server.get("port"),
            socket=server.get("socket"),
            host=server.get("host", "localhost"),
            use_ssl=bool(server.get("use_ssl", False)),
        )
        try:
            reply = client.can_cancel_execution(CanCancelExecutionRequest(run_id=run_id), 10)
        except Exception as error:  # unreachable: cannot tell, so do not fail a live run
            return CheckRunHealthResult(
                WorkerStatus.RUNNING, f"code server at {where} unreachable ({error}); unknown"
            )
        if deserialize_value(reply, CanCancelExecutionResult).can_cancel:
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"{where} runs it")
        return CheckRunHealthResult(
            WorkerStatus.FAILED,
            f"the code server at {where} no longer runs its worker (the worker or the server "
            "was killed or restarted). Every asset keeps its progress on disk; the retry "
            "resumes from there.",
        )


def worker_started(instance: DagsterInstance, run_id: str) -> tuple[int, float] | None:
    """(pid, time reported) of the run's worker, from the engine event its server wrote."""
    for record in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT):
        if record.message.startswith(WORKER_STARTED):
            pid = record.dagster_event.engine_event_data.metadata["pid"].value
            return int(pid), record.timestamp
    return None


def process_start_time(pid: int) -> float | None:
    """When process `pid` started (epoch seconds), or None when there is no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    if fields[0] == "Z":  # exited, not yet reaped
        return None
    boot = next(
        float(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime ")
    )
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")

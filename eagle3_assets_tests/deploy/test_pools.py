"""The `vllm` pool protects the serving replicas: two batch runs launched together never have
requests in flight at the server at the same time when the pool limit is 1 (and do with a
limit of 2, so the measurement can see overlap). Real instance (the project's dagster.yaml,
SQLite), limits set with the CLI the Makefile uses, runs on the multiprocess executor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import dagster as dg
import pytest
from aiohttp import web
from dagster._core.events import JobFailureData, RunFailureReason
from dagster._core.storage.tags import RUN_FAILURE_REASON_TAG, WILL_RETRY_TAG

from eagle3_assets_tests.conftest import REPO
from eagle3_assets_tests.deploy.helpers import pipeline_env, write_pool
from eagle3_assets_tests.openai_stub import OpenAIStub

BATCH_SIZE = 6
DAGSTER = Path(sys.executable).parent / "dagster"


class RunTrackingStub(OpenAIStub):
    """Counts, at every request, how many distinct batches (one per run) have requests in
    flight; prompt `q<i>` belongs to batch i // BATCH_SIZE."""

    def __init__(self) -> None:
        super().__init__()
        self.active: Counter[int] = Counter()
        self.max_batches_in_flight = 0
        self.windows: dict[int, list[float]] = {}  # batch -> [first request, last answer]

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()  # aiohttp caches the body: the parent reads it again
        batch = int(payload["messages"][-1]["content"][1:]) // BATCH_SIZE
        self.active[batch] += 1
        self.windows.setdefault(batch, [time.monotonic(), 0.0])
        self.max_batches_in_flight = max(
            self.max_batches_in_flight, sum(1 for n in self.active.values() if n)
        )
        try:
            return await super()._chat(request)
        finally:
            self.active[batch] -= 1
            self.windows[batch][1] = time.monotonic()


def set_pool(pool: str, limit: int) -> None:
    """What `make` does: `dagster instance concurrency set` on the instance in DAGSTER_HOME."""
    subprocess.run(
        [str(DAGSTER), "instance", "concurrency", "set", pool, str(limit)],
        check=True,
        capture_output=True,
    )


def run_two_batches(instance: dg.DagsterInstance, log: Path) -> list[dg.DagsterRun]:
    """Launch batch-00000 and batch-00001 at the same moment, each its own run process on the
    multiprocess executor (`dagster job execute`: one process per run, as the run launcher
    gives them; two runs in one process deadlock in logging setup)."""
    processes = []
    with open(log, "ab") as out:
        for key in ("batch-00000", "batch-00001"):
            tags = json.dumps({"dagster/partition": key})
            argv = [str(DAGSTER), "job", "execute", "-m", "eagle3_assets.definitions",
                    "-a", "defs", "-j", "generate_batch", "--tags", tags]  # fmt: skip
            process = subprocess.Popen(
                argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            processes.append(process)
    try:
        for process in processes:
            process.wait(timeout=240)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    runs = instance.get_runs(filters=dg.RunsFilter(job_name="generate_batch"))
    return sorted(runs, key=lambda run: run.tags["dagster/partition"])


@pytest.mark.parametrize(("limit", "expected"), [(1, 1), (2, 2)])
def test_vllm_pool_limits_batch_runs_at_the_server(
    limit: int,
    expected: int,
    dagster_home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_pool("vllm", limit)
    set_pool("gpu", 1)
    pool = write_pool(tmp_path / "pool.jsonl", 2 * BATCH_SIZE)
    with RunTrackingStub() as stub:
        stub.faults.latency_s = 1.5  # 6 prompts, 2 at a time: ~4.5 s of requests per run
        for name, value in pipeline_env(stub.base_url, pool, tmp_path / "data", BATCH_SIZE).items():
            monkeypatch.setenv(name, value)  # the step processes inherit them
        with dg.DagsterInstance.get() as instance:
            assert instance.event_log_storage.get_concurrency_info("vllm").slot_count == limit
            instance.add_dynamic_partitions("sample_batches", ["batch-00000", "batch-00001"])
            started = time.monotonic()
            runs = run_two_batches(instance, tmp_path / "runs.log")
            elapsed = time.monotonic() - started
            assert [run.status for run in runs] == [dg.DagsterRunStatus.SUCCESS] * 2, (
                tmp_path / "runs.log"
            ).read_text()[-3000:]
            info = instance.event_log_storage.get_concurrency_info("vllm")
            assert info.active_slot_count == 0  # both runs gave their slot back
    (first, second) = sorted(stub.windows.values())
    overlap = first[1] - second[0]
    print(
        f"vllm pool limit {limit}: max runs in flight at the server "
        f"{stub.max_batches_in_flight}, request windows overlap {overlap:+.1f}s, "
        f"two runs took {elapsed:.1f}s"
    )
    assert stub.answered == 2 * BATCH_SIZE
    assert stub.max_batches_in_flight == expected
    assert (overlap > 0) == (expected == 2)


def test_run_retries_and_monitoring_apply_as_configured(dagster_home: Path) -> None:
    """dagster.yaml's run_retries, as the instance applies them when a run fails: a run whose
    worker died or whose step failed is marked for TWO retries (every asset resumes from its
    saved progress), the second retry is not retried again; run monitoring frees the slots
    of ended runs after 15 s. (That monitoring finds dead workers: test_crash_recovery.py.)"""
    with dg.DagsterInstance.get() as instance:
        assert instance.run_monitoring_enabled
        assert instance.run_monitoring_settings["free_slots_after_run_end_seconds"] == 15

        def fail(reason: RunFailureReason, retry_of: str | None = None) -> dict[str, str]:
            lineage = {"root_run_id": retry_of, "parent_run_id": retry_of} if retry_of else {}
            tags = {f"dagster/{k}": v for k, v in lineage.items()}  # how run groups are found
            run = instance.add_run(
                dg.DagsterRun(
                    job_name="generate_batch",
                    status=dg.DagsterRunStatus.STARTED,
                    tags=tags,
                    **lineage,
                )
            )
            failure = JobFailureData(error=None, failure_reason=reason)
            instance.report_run_failed(run, "run failed", failure)
            return dict(instance.get_run_by_id(run.run_id).tags)

        crashed = fail(RunFailureReason.RUN_WORKER_RESTART)
        step_failed = fail(RunFailureReason.STEP_FAILURE)
        first = instance.get_runs(limit=1)[0].run_id
        retry_failed = fail(RunFailureReason.STEP_FAILURE, retry_of=first)
        second_retry_failed = fail(RunFailureReason.STEP_FAILURE, retry_of=first)
    assert crashed[RUN_FAILURE_REASON_TAG] == "RUN_WORKER_RESTART"
    assert (crashed[WILL_RETRY_TAG], step_failed[WILL_RETRY_TAG]) == ("true", "true")
    assert retry_failed[WILL_RETRY_TAG] == "true"
    assert second_retry_failed[WILL_RETRY_TAG] == "false"  # max_retries: 2

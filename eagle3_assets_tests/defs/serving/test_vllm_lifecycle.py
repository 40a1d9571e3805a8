"""One real vLLM (CPU build) server through its whole life, watched by the readiness sensor:
loading; ready, with ONE launch run through the real daemon in which the drafter download and
the first batch run side by side; its engine killed: dead; started again: ONE new launch;
stopped: dead, and no process left behind."""

import dataclasses
import os
import signal
import time
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.defs.serving.resources import VLLMServer
from eagle3_assets.defs.serving.sensors import vllm_readiness_sensor
from eagle3_assets.lib.serving.vllm_launcher import (
    group_members,
    log_tail,
    start,
    stop,
    wait_ready,
)
from eagle3_assets.lib.serving.vllm_probe import Probe, probe
from eagle3_assets.localdev.demo import follow_launch
from eagle3_assets.localdev.miniature import SERVED_TARGET_NAME, miniature_env, miniature_server
from eagle3_assets.localdev.processes import running_daemon
from eagle3_assets_tests.conftest import free_port

pytestmark = pytest.mark.vllm


def step_spans(instance: dg.DagsterInstance, run_id: str) -> dict[str, dict[str, float]]:
    """step key -> {event type: timestamp}, from the run's event log."""
    spans: dict[str, dict[str, float]] = {}
    for record in instance.all_logs(run_id):
        event = record.dagster_event
        if event and event.step_key:
            spans.setdefault(event.step_key, {})[event.event_type_value] = record.timestamp
    return spans


def test_sensor_follows_a_real_vllm_server(
    test_world, test_hub, serving_python, dagster_home, tmp_path
):
    spec = miniature_server(
        test_world.target_v2, tmp_path / "vllm", free_port(), SERVED_TARGET_NAME
    )
    spec = dataclasses.replace(spec, python=serving_python)
    vllm = VLLMServer(base_urls=[spec.base_url], served_model_name=SERVED_TARGET_NAME)
    cursor = None

    def tick(instance) -> dg.SensorResult:
        nonlocal cursor
        context = dg.build_sensor_context(
            instance=instance, cursor=cursor, resources={"vllm": vllm}
        )
        result = vllm_readiness_sensor(context)
        cursor = result.cursor
        return result

    pgid = start(spec)
    try:
        with dg.instance_for_test() as scratch:
            loading = tick(scratch)
            assert [e.metadata["state"].value for e in loading.asset_events] == ["loading"]
            assert loading.run_requests == []

            wait_ready(spec, timeout_s=600)
            ready = tick(scratch)
            (observation,) = ready.asset_events
            meta = {k: v.value for k, v in observation.metadata.items()}
            assert meta["state"] == "ready"
            assert meta["max_model_len"] == 1024
            assert meta["vllm_version"] == "0.32.0"
            assert meta["instance_id"].startswith(f"{spec.base_url}@")
            (request,) = ready.run_requests
            assert request.partition_key == "batch-00000"
            (registration,) = ready.dynamic_partitions_requests
            assert list(registration.partition_keys) == ["batch-00000"]
            again = tick(scratch)
            assert again.run_requests == [] and again.asset_events == []

        # The same server through Dagster's real daemon: the observation lands in the event
        # log, and the launch run downloads the drafter and generates the first batch at once.
        env = miniature_env(
            test_world, test_hub, spec.base_url, tmp_path / "data", SERVED_TARGET_NAME
        )
        since = time.time()
        with (
            running_daemon(dagster_home, env, tmp_path / "daemon.log"),
            dg.DagsterInstance.get() as instance,
        ):
            run = follow_launch(
                instance, time.monotonic(), 300, print, since=since, base_url=spec.base_url
            )
            log = (tmp_path / "daemon.log").read_text()
            assert run.status == dg.DagsterRunStatus.SUCCESS, log
            assert run.tags["dagster/partition"] == "batch-00000"
            spans = step_spans(instance, run.run_id)
            recorded = instance.fetch_observations(dg.AssetKey("vllm_server"), limit=10)
            first_batch = instance.fetch_materializations(
                dg.AssetRecordsFilter(
                    asset_key=dg.AssetKey("synthetic_generations"), asset_partitions=["batch-00000"]
                ),
                limit=10,
            ).records
            checkpoint = instance.get_latest_materialization_event(
                dg.AssetKey("drafter_checkpoint")
            )
        assert [r.asset_observation.metadata["state"].value for r in recorded.records] == ["ready"]
        # batch-00000 came from the launch run, once (new_batches_sensor may start batch-00001)
        assert [record.run_id for record in first_batch] == [run.run_id]
        assert checkpoint.run_id == run.run_id
        # Side by side: each step's process was launched before the other step finished. (The
        # offline copy of a tiny drafter takes half a second, shorter than a step process's
        # start-up, so its STEP_START..STEP_SUCCESS rarely meets the batch's; at scale the
        # download takes many minutes and the intervals overlap for most of it.)
        download, batch = spans["drafter_checkpoint"], spans["synthetic_generations"]
        assert download["STEP_WORKER_STARTING"] < batch["STEP_SUCCESS"], spans
        assert batch["STEP_WORKER_STARTING"] < download["STEP_SUCCESS"], spans

        # The engine dies (kill -9 of the engine core only, the API server left alive): vLLM
        # 0.32's API server still answers 200 for a moment, then /health 503 for a few
        # seconds, then exits by itself. Whichever the next tick meets, the server is dead.
        with dg.instance_for_test() as scratch:
            assert tick(scratch).asset_events == []  # still the ready server of the first part
            (engine,) = [p for p in group_members(pgid) if b"EngineCore" in cmdline(p)]
            os.kill(engine, signal.SIGKILL)
            seen = wait_unhealthy(spec.base_url)
            print(f"after the engine's kill: {seen}")
            dead = tick(scratch)
            (observation,) = dead.asset_events
            assert observation.metadata["state"].value == "dead", observation.metadata
            assert dead.run_requests == []
            assert wait_until_gone(pgid) == [], log_tail(spec)  # the API server exited too
            assert tick(scratch).asset_events == []  # dead, then still dead: nothing new

            # Started again: loading is not ready; ready is ONE new launch, once.
            pgid = start(spec)
            wait_ready(spec, timeout_s=600)
            back = tick(scratch)
            assert [e.metadata["state"].value for e in back.asset_events] == ["ready"]
            (relaunch,) = back.run_requests
            assert relaunch.run_key != request.run_key
            assert (
                relaunch.tags["eagle3/server_instances"] != request.tags["eagle3/server_instances"]
            )
            again = tick(scratch)
            assert again.run_requests == [] and again.asset_events == []
    finally:
        stop(spec.run_dir, grace_s=30)

    assert group_members(pgid) == []  # API server, engine core and workers: all gone
    with dg.instance_for_test() as scratch:
        dead = tick(scratch)
    (observation,) = dead.asset_events
    assert observation.metadata["state"].value == "dead"
    assert "after it was ready" in observation.metadata["detail"].value
    assert dead.run_requests == []


def cmdline(pid: int) -> bytes:
    """A process's argv (vLLM retitles its engine process `VLLM::EngineCore`)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def wait_unhealthy(base_url: str, timeout_s: float = 60.0) -> Probe:
    """The first probe that is not healthy (or the last one, after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    seen = probe(base_url)
    while seen.healthy and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = probe(base_url)
    return seen


def wait_until_gone(pgid: int, timeout_s: float = 60.0) -> list[int]:
    """The group's live members once empty, or as they are after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return group_members(pgid)

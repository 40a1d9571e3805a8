"""kill -9 of everything Dagster runs (daemon, code server, run workers, their step processes
and torchrun), three times: during a generation run, an extraction run and training; then of
the evaluating run's worker alone while its vLLM is up. After each tree kill the daemon is
started again, and nothing else is done by hand: run monitoring must find the dead run, fail
it and free its pool slots, and run retries must resume it. The outputs must equal an
uninterrupted run's, and no vLLM may be left behind.

Real parts: the session's vLLM (CPU build), the project's dagster.yaml (its run launcher,
monitoring and retries), the daemon's own code server and run workers, torchrun, and the
evaluation's own vLLM servers.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import time
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from eagle3_assets.definitions import resources_from_env
from eagle3_assets.defs.hidden_states.assets import hidden_states
from eagle3_assets.lib.serving.vllm_launcher import group_members, read_pid, stop
from eagle3_assets.lib.serving.vllm_probe import probe
from eagle3_assets.lib.training.train_drafter import RunConfig, train
from eagle3_assets.localdev.processes import running_daemon
from eagle3_assets.run_launcher import worker_started
from eagle3_assets_tests.conftest import SMALL_DRAFTER, free_port
from eagle3_assets_tests.deploy.helpers import descendants, wait_for

# A hang guard, not a speed bound: a whole pipeline, four kills and their retries.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BATCH_SIZE = 16
BATCHES = ("batch-00000", "batch-00001")
STEP_EVENTS = {
    dg.DagsterEventType.STEP_START,
    dg.DagsterEventType.STEP_SUCCESS,
    dg.DagsterEventType.STEP_FAILURE,
}
ACTIVE = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def kill_tree(root: int) -> list[int]:
    """SIGKILL the whole tree at once, as the OOM killer or a reboot would: no clean-up runs."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # stopped first: nothing forks meanwhile
        pids = descendants(root)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    return pids


def running_step(instance: dg.DagsterInstance, step: str) -> dg.DagsterRun | None:
    """A first attempt executing `step` now, while no retry is queued or running: a kill never
    hits a retry (dagster.yaml allows one per run)."""
    active = instance.get_runs(filters=dg.RunsFilter(statuses=ACTIVE))
    if any("dagster/parent_run_id" in run.tags for run in active):
        return None
    for run in active:
        steps = instance.all_logs(run.run_id, of_type=STEP_EVENTS)
        seen = {e.dagster_event.event_type for e in steps if e.step_key == step}
        if seen == {dg.DagsterEventType.STEP_START}:
            return run
    return None


def test_pipeline_survives_kill_minus_9_at_every_stage(
    pipeline_env, dagster_home, test_world, tmp_path
) -> None:
    data = Path(pipeline_env["EAGLE3_DATA_ROOT"])
    prompts = tmp_path / "prompts.jsonl"
    lines = (test_world.root / "prompts.jsonl").read_text().splitlines()
    prompts.write_text("\n".join(lines[: BATCH_SIZE * len(BATCHES)]) + "\n")
    env = {
        **pipeline_env,
        **SMALL_DRAFTER,
        "EAGLE3_PROMPTS": str(prompts),
        "EAGLE3_BATCH_SIZE": str(BATCH_SIZE),
        "EAGLE3_CONCURRENCY": "1",  # one request at a time: a generation run long enough to kill
        "EAGLE3_TRAIN_CHECKPOINT_EVERY": "10",
        "EAGLE3_AUTOMATION": "1",
        "EAGLE3_BACKFILL_CRON": "* * * * *",
        "EAGLE3_EVAL_PORT": str(free_port()),
    }
    steps = int(env["EAGLE3_TRAIN_STEPS"])
    servers = data / "evaluation" / "vllm"  # one run dir per contender
    eval_url = f"http://127.0.0.1:{env['EAGLE3_EVAL_PORT']}"
    log = tmp_path / "daemon.log"

    def generating(instance):
        """A batch run with answers saved but the batch not finished."""
        run = running_step(instance, "synthetic_generations")
        batch = run and data / "generations" / run.tags["dagster/partition"]
        if batch and list(batch.glob("parts/*.parquet")):
            return not (batch / "generations.parquet").exists() and run

    def extracting(instance):
        return running_step(instance, "hidden_states")

    def training(instance):
        run = running_step(instance, "eagle3_drafter")
        return run and list(data.glob("drafter/runs/*/checkpoints/latest")) and run

    kills = []
    try:
        with dg.DagsterInstance.get() as instance:
            for name, in_progress in (
                ("generation", generating),
                ("extraction", extracting),
                ("training", training),
            ):
                with running_daemon(dagster_home, env, log) as daemon:
                    run = wait_for(
                        functools.partial(in_progress, instance), 600, f"{name} run", log
                    )
                    killed_at = time.time()
                    killed = kill_tree(daemon.pid)
                kills.append(
                    {
                        "phase": name,
                        "run_id": run.run_id,
                        # a job's run names its batch; automation's runs, a range of one
                        "partition": run.tags.get("dagster/partition")
                        or run.tags.get("dagster/asset_partition_range_start"),
                        "at": killed_at,
                        "pids": killed,
                    }
                )
                assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED

            # Last, only the worker of the run evaluating (its code server survives, and fails
            # the run itself) while the evaluation's first vLLM is up: that server outlives it.
            with running_daemon(dagster_home, env, log):
                run, orphan = wait_for(
                    functools.partial(evaluating, instance, servers / "without-drafter", eval_url),
                    900,
                    "evaluation server up",
                    log,
                )
                worker, _ = worker_started(instance, run.run_id)
                steps_below = [p for p in descendants(worker)[1:] if os.getpgid(p) != orphan]
                for pid in [worker, *steps_below]:
                    os.kill(pid, signal.SIGKILL)
                evaluation_killed = {"run_id": run.run_id, "at": time.time(), "orphan": orphan}
                kills.append(
                    {"phase": "evaluation worker", "pids": [worker, *steps_below]}
                    | evaluation_killed
                )
                evaluation = wait_for(
                    functools.partial(latest_finished, instance, "drafter_evaluation"),
                    900,
                    "drafter_evaluation materialization",
                    log,
                )
            drafter = instance.get_latest_materialization_event(dg.AssetKey("eagle3_drafter"))
            timings = [recovery(instance, kill) for kill in kills]
            evaluated = instance.get_run_by_id(evaluation.run_id)
            retry_messages = [r.user_message for r in instance.all_logs(evaluated.run_id)]
    finally:
        for run_dir in servers.glob("*"):
            stop(run_dir)
    print(json.dumps(timings, indent=1))
    (tmp_path / "recovery.json").write_text(json.dumps(timings, indent=1))

    # Every dead run was failed by monitoring, saying why, and retried; the retries of the
    # generation and extraction runs succeeded, the training's retry made the drafter.
    for timing in timings[:3]:
        assert "its run worker (pid" in timing["failure"], timing
    assert [t["retry_status"] for t in timings[:2]] == ["SUCCESS", "SUCCESS"], timings
    assert drafter.run_id == timings[2]["retry_run_id"]
    # The evaluation's retry reused the server the killed attempt left, and nothing is left.
    assert evaluated.tags["dagster/parent_run_id"] == evaluation_killed["run_id"]
    assert evaluated.status == dg.DagsterRunStatus.SUCCESS
    orphan, baseline = evaluation_killed["orphan"], servers / "without-drafter"
    reused = f"reusing the vLLM server (pid {orphan}) a previous attempt left running in {baseline}"
    assert retry_messages.count(reused) == 1, retry_messages
    assert group_members(orphan) == []
    assert processes_under(servers) == []
    meta = {k: v.value for k, v in evaluation.asset_materialization.metadata.items()}
    rows = {row.data["server"]: row.data for row in meta["comparison"].records}
    assert sorted(rows) == ["finetuned", "warm start", "without drafter"]
    assert rows["finetuned"]["mean acceptance length"] == meta["mean_acceptance_length"]
    assert rows["without drafter"]["mean acceptance length"] == 1.0  # nothing drafted
    # Generations: one row per prompt, no duplicates, in both batches.
    resources = resources_from_env(env)
    pool, storage = resources["prompt_pool"], resources["storage"]
    for key in BATCHES:
        table = pq.read_table(data / "generations" / key / "generations.parquet")
        assert sorted(table.column("prompt_id").to_pylist()) == sorted(
            c.prompt_id for c in pool.batch(key, storage)
        )
    # Hidden states (the hf backend is deterministic): byte-identical to an uninterrupted run.
    killed_batch = kills[1]["partition"]
    reference = extract_uninterrupted(env, data, tmp_path / "reference", killed_batch)
    for shard in sorted((data / "hidden_states" / killed_batch).glob("*.safetensors")):
        assert shard.read_bytes() == (reference / shard.name).read_bytes(), shard.name
    # Training: exactly the configured steps, the same losses as without the kill.
    meta = {k: v.value for k, v in drafter.asset_materialization.metadata.items()}
    assert meta["steps"] == steps
    assert len(meta["loss_curve"]) == steps
    (run_file,) = data.glob("drafter/runs/*/run.json")
    config = json.loads(run_file.read_text()) | {"out_dir": str(tmp_path / "uninterrupted")}
    uninterrupted = train(RunConfig(**config), report=lambda metrics: None)
    assert [round(m["loss"], 4) for m in uninterrupted.history] == meta["loss_curve"]


def latest_finished(instance: dg.DagsterInstance, asset: str) -> dg.EventLogEntry | None:
    """`asset`'s latest materialization, once the run that made it has finished."""
    entry = instance.get_latest_materialization_event(dg.AssetKey(asset))
    return entry if entry and instance.get_run_by_id(entry.run_id).is_finished else None


def evaluating(
    instance: dg.DagsterInstance, run_dir: Path, url: str
) -> tuple[dg.DagsterRun, int] | None:
    """The run executing drafter_evaluation while its vLLM from `run_dir` answers at `url`,
    and that server's pid."""
    active = instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
    for run in active:
        steps = instance.all_logs(run.run_id, of_type=STEP_EVENTS)
        seen = {e.dagster_event.event_type for e in steps if e.step_key == "drafter_evaluation"}
        server = read_pid(run_dir / "server.pid")
        if seen == {dg.DagsterEventType.STEP_START} and server and probe(url).healthy:
            return run, server
    return None


def processes_under(directory: Path) -> list[int]:
    """Live processes working in `directory` (vLLM runs in its run dir, its engine too)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # gone, a zombie, or not ours to read
            if Path(os.readlink(proc / "cwd")).is_relative_to(directory):
                found.append(int(proc.name))
    return found


def recovery(instance: dg.DagsterInstance, kill: dict) -> dict:
    """Seconds from the kill to the dead run marked failed, and to its retry running."""
    run = instance.get_run_record_by_id(kill["run_id"])
    failure = instance.all_logs(kill["run_id"], of_type=dg.DagsterEventType.RUN_FAILURE)[-1]
    (retry,) = instance.get_runs(
        filters=dg.RunsFilter(tags={"dagster/parent_run_id": kill["run_id"]})
    )
    retry_record = instance.get_run_record_by_id(retry.run_id)
    return {
        "phase": kill["phase"],
        "processes_killed": len(kill["pids"]),
        "marked_failed_after_s": round(run.end_time - kill["at"], 1),
        "retry_started_after_s": round(retry_record.start_time - kill["at"], 1),
        "failure": failure.message,
        "retry_status": retry.status.value,
        "retry_run_id": retry.run_id,
    }


def extract_uninterrupted(env: dict[str, str], data: Path, root: Path, key: str) -> Path:
    """hidden_states[key] materialized once more, never interrupted, from the same generations,
    into another data root (on the test's instance: it holds the generations' checks)."""
    for part in ("generations/" + key, "drafter/warm_start"):
        (root / part).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(data / part, root / part)
    with dg.DagsterInstance.get() as instance:
        result = dg.materialize(
            [hidden_states],
            partition_key=key,
            instance=instance,
            resources=resources_from_env({**env, "EAGLE3_DATA_ROOT": str(root)}),
        )
    assert result.success
    return root / "hidden_states" / key

"""Serving follows promotion, on a real vLLM replica started by the launcher: `served_drafter`
restarts it with the promoted drafter; a kill -9 of the run's worker mid-restart leaves a
server that the daemon's retry waits for (never none serving); a drafter that cannot load leaves the
last good one serving; the maintenance window asks for a rollout only when something new was
promoted.

Server starts: the plain replica, the promoted drafter's (the killed run's, reused by its
retry), the promoted drafter's after the single-node chain, the broken drafter's (it fails)
and the last good one's again.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from eagle3_assets.definitions import defs
from eagle3_assets.lib.checkpoint.drafter_io import export_for_vllm
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.evaluation.promotion import Registry
from eagle3_assets.lib.serving.rollout import GOOD
from eagle3_assets.lib.serving.vllm_launcher import group_alive, read_pid, start, stop, wait_ready
from eagle3_assets.lib.serving.vllm_probe import probe
from eagle3_assets.localdev.hub import train_world_drafter
from eagle3_assets.localdev.miniature import SERVED_TARGET_NAME, miniature_server
from eagle3_assets.localdev.processes import running_daemon
from eagle3_assets.run_launcher import worker_started
from eagle3_assets_tests.conftest import REPO, free_port
from eagle3_assets_tests.deploy.helpers import descendants, wait_for

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def world(test_world, serving_python, tmp_path_factory):
    """A plain replica started by the launcher, an empty instance and data volume, and the
    settings that point the code location at them."""
    root = tmp_path_factory.mktemp("serving")
    spec = miniature_server(test_world.target_v2, root / "replica", free_port(), SERVED_TARGET_NAME)
    spec = dataclasses.replace(spec, python=serving_python)
    start(spec)
    home = root / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    env = {
        "DAGSTER_HOME": str(home),
        "EAGLE3_DATA_ROOT": str(root / "data"),
        "EAGLE3_SERVING_RUN_DIRS": str(spec.run_dir),
        "EAGLE3_VLLM_URLS": spec.base_url,
        "EAGLE3_TARGET_MODEL": SERVED_TARGET_NAME,
        "EAGLE3_TARGET_PATH": str(test_world.target_v2),
        "EAGLE3_HELDOUT_PROMPTS": str(test_world.heldout_prompts),
        "EAGLE3_EVAL_MAX_TOKENS": "32",
    }
    try:
        wait_ready(spec, timeout_s=600)
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            yield spec, env, root
    finally:
        stop(spec.run_dir, grace_s=30)


def promote(root: Path, drafter: Path, scores: dict) -> None:
    """A candidate promoted in the registry (promotion itself is tested on its own)."""
    registry = Registry(root / "data" / "promotion")
    current = registry.current()
    incumbent = current.name if current else "warm start"
    registry.judge(drafter, {"batches": []}, scores, incumbent, {"held-out": 1.0}, 0.0)


def materialize(env: dict) -> subprocess.Popen:
    """`dagster asset materialize` as a user runs it, in its own process group."""
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster"), "asset", "materialize", "--select",
         "served_drafter", "-m", "eagle3_assets.definitions"],
        env={**os.environ, **env},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )  # fmt: skip


def launched(spec) -> dict:
    return json.loads((spec.run_dir / "launch.json").read_text())


def metadata(key: str) -> dict:
    with dg.DagsterInstance.get() as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey(key))
        return {k: v.value for k, v in event.asset_materialization.metadata.items()}


@pytest.fixture(scope="module")
def drafters(test_world, tmp_path_factory):
    scratch = tmp_path_factory.mktemp("drafters")
    target = TargetShape.from_config(test_world.target_v2)
    trained = export_for_vllm(train_world_drafter(test_world, 256), scratch / "trained", target)
    broken = shutil.copytree(trained, scratch / "broken")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": 96}))
    return {"trained": trained, "broken": broken}


def test_a_rollout_whose_worker_is_killed_mid_restart_recovers_by_itself(world, drafters, tmp_path):
    """The daemon runs the maintenance window; its rollout's worker is SIGKILLed once the new
    server is launched. Run monitoring fails the run and frees its pool slot, run retries
    launch the retry, and the retry waits for the server the killed run left loading."""
    spec, env, root = world
    plain_pid = launched(spec)["pid"]
    assert launched(spec)["spec"]["speculative_config"] is None
    promote(root, drafters["trained"], {"held-out": 2.0})
    version = root / "data" / "promotion" / "versions" / "v001"
    log = tmp_path / "daemon.log"
    daemon_env = {
        **env,
        "EAGLE3_MAINTENANCE_CRON": "* * * * *",  # the window: every minute
        # the readiness sensor must not start the pipeline on this replica
        "EAGLE3_VLLM_URLS": f"http://127.0.0.1:{free_port()}",
    }

    def restarting(instance):
        runs = instance.get_runs(dg.RunsFilter(job_name="serve_promoted_drafter"))
        worker = runs and worker_started(instance, runs[0].run_id)
        return worker and launched(spec)["pid"] != plain_pid and (runs[0], worker[0])

    def retried(instance):
        event = instance.get_latest_materialization_event(dg.AssetKey("served_drafter"))
        return event and instance.get_run_by_id(event.run_id)

    with (
        dg.DagsterInstance.get() as instance,
        running_daemon(Path(env["DAGSTER_HOME"]), daemon_env, log),
    ):
        killed, worker = wait_for(lambda: restarting(instance), 300, "a rollout", log)
        server = launched(spec)["pid"]
        for pid in descendants(worker):  # the worker and its steps, not the server's group
            if os.getpgid(pid) != server:
                os.kill(pid, signal.SIGKILL)
        retry = wait_for(lambda: retried(instance), 600, "served_drafter", log)
        assert retry.tags["dagster/parent_run_id"] == killed.run_id
        assert instance.get_run_by_id(killed.run_id).status == dg.DagsterRunStatus.FAILURE
        messages = [r.user_message for r in instance.all_logs(retry.run_id)]

    assert not group_alive(plain_pid)
    assert any(f"reusing the vLLM server (pid {server})" in m for m in messages), messages
    assert read_pid(spec.pid_file) == server  # waited for, not restarted
    meta = metadata("served_drafter")
    assert (meta["drafter"], meta["path"]) == ("promoted v001", str(version))
    (row,) = meta["replicas"].splitlines()[2:]
    assert row.startswith(f"| {spec.base_url} | {meta['mean_acceptance_length']:.3f} | ")
    assert int(row.split("|")[3]) >= 1  # drafts counted in its /metrics
    good = json.loads((spec.run_dir / GOOD).read_text())
    assert good["speculative_config"]["model"] == str(version)


def test_on_a_serving_node_training_gets_the_gpus_and_a_failure_gives_them_back(world):
    """retrain_on_serving_node stops the replica; the sensor then asks for training, which
    fails here (no batch to learn from); the failure sensor asks for serving again, and the
    replica serves the promoted drafter as before."""
    spec, env, root = world
    definitions = defs()
    sensors = {sensor.name: sensor for sensor in definitions.sensors}

    def after(sensor: str, result) -> dg.RunRequest:
        event = result.get_run_success_event() if result.success else result.get_run_failure_event()
        context = dg.build_run_status_sensor_context(
            sensor_name=sensor, dagster_instance=instance, dagster_run=result.dagster_run,
            dagster_event=event,
        )  # fmt: skip
        if not result.success:
            context = context.for_run_failure()
        return sensors[sensor](context)

    with dg.DagsterInstance.get() as instance:
        stop = definitions.resolve_job_def("retrain_on_serving_node")
        stopped = stop.execute_in_process(instance=instance)
        assert stopped.success
        assert not group_alive(launched(spec)["pid"]) and not probe(spec.base_url).healthy

        train = after("train_once_serving_stopped", stopped)
        assert train.run_key == stopped.run_id
        job = definitions.resolve_job_def("train_evaluate_promote")
        trained = job.execute_in_process(instance=instance, raise_on_error=False)
        assert not trained.success
        assert trained.dagster_run.tags["dagster/max_retries"] == "0"  # GPUs back, not retried
        serve = after("serve_again_after_a_failure", trained)
        assert serve.run_key == trained.run_id

    run = materialize(env)  # what the requested serve_promoted_drafter run does
    output, _ = run.communicate(timeout=900)
    assert run.returncode == 0, output
    assert probe(spec.base_url).healthy
    version = root / "data" / "promotion" / "versions" / "v001"
    assert launched(spec)["spec"]["speculative_config"]["model"] == str(version)


def test_the_maintenance_window_asks_only_for_a_newly_promoted_drafter(world, drafters):
    _, _, root = world
    definitions = defs()
    repository = definitions.get_repository_def()
    schedule = repository.get_schedule_def("serving_maintenance_schedule")

    def tick():
        with (
            dg.DagsterInstance.get() as instance,
            dg.build_schedule_context(
                instance=instance, repository_def=repository, resources=definitions.resources
            ) as context,
        ):
            return schedule.evaluate_tick(context)

    assert tick().skip_message == "promoted v001 serves already"
    promote(root, drafters["broken"], {"held-out": 3.0})
    (request,) = tick().run_requests
    assert request.run_key == "serve-promoted v002"


def test_a_drafter_that_cannot_load_leaves_the_last_good_one_serving(world, drafters):
    spec, env, root = world
    assert Registry(root / "data" / "promotion").current().name == "promoted v002"  # broken
    run = materialize(env)
    output, _ = run.communicate(timeout=900)
    assert run.returncode != 0
    last_good = root / "data" / "promotion" / "versions" / "v001"
    assert f"did not serve drafter {root / 'data' / 'promotion' / 'versions' / 'v002'}" in output, (
        output
    )
    assert f"It serves its last good drafter again ({last_good})" in output
    assert launched(spec)["spec"]["speculative_config"]["model"] == str(last_good)
    seen = probe(spec.base_url)
    assert seen.healthy and SERVED_TARGET_NAME in seen.model_ids
    assert metadata("served_drafter")["drafter"] == "promoted v001"  # no new materialization

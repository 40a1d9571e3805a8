"""`make demo`: the miniature world through Dagster's real daemon path.

Builds the world, starts vLLM on the newer target (it plays Kimi-K2.5), starts the Dagster
daemon, and follows what a user would watch in the UI: the readiness sensor observing the
server load and become ready, then the launch run it requests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from eagle3_assets.lib.vllm_launcher import (
    LaunchError,
    VLLMLaunchSpec,
    log_tail,
    start,
    terminate_group,
)
from eagle3_assets.lib.vllm_probe import probe
from eagle3_assets.localdev.hub import LOCAL_DRAFTER_REPO, publish_local_drafter
from eagle3_assets.localdev.world import build_world

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SERVED_TARGET_NAME = "target-v2"
LAUNCH_JOB = "launch"
SENSOR_NAME = "vllm_readiness_sensor"


def miniature_server(model_dir: Path, run_dir: Path, port: int, served_model_name: str):
    """The vLLM settings that suit the CPU build and a tiny target."""
    return VLLMLaunchSpec(
        model=str(model_dir),
        python=Path(
            os.environ.get("EAGLE3_SERVING_PYTHON", PROJECT_ROOT / ".venv-vllm/bin/python")
        ),
        run_dir=run_dir,
        port=port,
        served_model_name=served_model_name,
        max_model_len=1024,
        enforce_eager=True,  # skips torch.compile: a minute less on 2 cores
        cpu_kvcache_gib=1,
    )


def miniature_env(
    world_root: Path, hub_cache: Path, base_url: str, data_root: Path, served_model_name: str
) -> dict[str, str]:
    """The EAGLE3_* settings (see resources_from_env) that point the pipeline at a world."""
    return {
        "EAGLE3_VLLM_URLS": base_url,
        "EAGLE3_TARGET_MODEL": served_model_name,
        "EAGLE3_TARGET_PATH": str(world_root / "target-v2"),
        "EAGLE3_PROMPTS": str(world_root / "prompts.jsonl"),
        "EAGLE3_DATA_ROOT": str(data_root),
        "EAGLE3_DRAFTER_REPO": LOCAL_DRAFTER_REPO,
        "EAGLE3_HF_CACHE": str(hub_cache),
        "HF_HUB_OFFLINE": "1",  # the miniature world never reaches a hub
        "EAGLE3_BATCH_SIZE": "16",
        "EAGLE3_MAX_TOKENS": "96",
        "EAGLE3_CONCURRENCY": "16",
    }


@contextlib.contextmanager
def running_daemon(dagster_home: Path, env: dict[str, str], log_file: Path) -> Iterator[int]:
    """`dagster-daemon run` in its own process group, stopped as a whole on exit."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    daemon = Path(sys.executable).parent / "dagster-daemon"
    with open(log_file, "ab") as log:
        process = subprocess.Popen(
            [str(daemon), "run", "-w", str(PROJECT_ROOT / "workspace.yaml")],
            cwd=PROJECT_ROOT,
            env={**os.environ, **env, "DAGSTER_HOME": str(dagster_home)},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield process.pid
    finally:
        terminate_group(process.pid, grace_s=20.0, first=signal.SIGINT)


def launch_runs(instance, instance_ids: str | None = None) -> list:
    """The launch runs the readiness sensor requested (for one server start, if given)."""
    import dagster as dg

    tags = {"dagster/sensor_name": SENSOR_NAME}
    if instance_ids:
        tags["eagle3/server_instances"] = instance_ids
    return instance.get_runs(filters=dg.RunsFilter(job_name=LAUNCH_JOB, tags=tags))


def latest_observation(instance):
    import dagster as dg

    records = instance.fetch_observations(dg.AssetKey("vllm_server"), limit=1).records
    return records[0].asset_observation if records else None


def follow_launch(instance, started: float, timeout_s: float, say) -> object:
    """Narrate observations, then the launch run of the server start seen ready; return it."""

    seen_observation, seen_status, server_instance = None, None, None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        observation = latest_observation(instance)
        if observation is not None and observation != seen_observation:
            seen_observation = observation
            meta = {k: v.value for k, v in observation.metadata.items()}
            if meta["state"] == "ready":
                server_instance = meta["instance_id"]
                extra = f"max_model_len {meta['max_model_len']}, vLLM {meta['vllm_version']}"
            else:
                extra = meta["detail"]
            say(
                f"+{time.monotonic() - started:4.0f}s vllm_server observed: {meta['state']} "
                f"({extra})"
            )
        runs = launch_runs(instance, server_instance) if server_instance else []
        if runs:
            run = runs[0]
            if run.status != seen_status:
                seen_status = run.status
                say(
                    f"+{time.monotonic() - started:4.0f}s launch run {run.run_id[:8]}: "
                    f"{run.status.value}"
                )
            if run.is_finished:
                return run
        time.sleep(2)
    raise TimeoutError(f"no finished launch run after {timeout_s:.0f}s")


def main() -> int:
    import dagster as dg

    data = Path(os.environ.get("EAGLE3_DATA", PROJECT_ROOT / "data"))
    dagster_home = Path(os.environ.get("DAGSTER_HOME", PROJECT_ROOT / ".dagster_home"))
    port = int(os.environ.get("EAGLE3_DEMO_PORT", "8000"))

    def say(message: str) -> None:
        print(f"[demo] {message}", flush=True)

    started = time.monotonic()
    world = build_world(data / "world", "demo", log=say)
    hub = world.root / "hub"
    say("the world's warm-start drafter: EAGLE-3 trained on target-v1 (built once)")
    sha = publish_local_drafter(world, hub, draft_vocab_size=1024)
    say(f"local hub: {LOCAL_DRAFTER_REPO}@{sha[:12]} (the drafter for target-v1) in {hub}")
    spec = miniature_server(world.target_v2, data / "vllm", port, SERVED_TARGET_NAME)
    current = probe(spec.base_url)
    if current.healthy and SERVED_TARGET_NAME in current.model_ids:
        say(f"vLLM already serves {SERVED_TARGET_NAME} at {spec.base_url}: reusing it")
    else:
        try:
            pid = start(spec)
        except LaunchError as error:
            say(f"cannot start vLLM: {error}")
            return 1
        say(
            f"vLLM starting (pid {pid}) at {spec.base_url}, serving {world.target_v2.name} as "
            f"{SERVED_TARGET_NAME}; log: {spec.log_file}"
        )

    env = miniature_env(world.root, hub, spec.base_url, data, SERVED_TARGET_NAME)
    env |= {"EAGLE3_BATCH_SIZE": "50", "EAGLE3_MAX_TOKENS": "128"}
    with running_daemon(dagster_home, env, data / "dagster-daemon.log"):
        say(
            f"dagster daemon running (DAGSTER_HOME={dagster_home}); the readiness sensor "
            "ticks every 10 s"
        )
        with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
            try:
                run = follow_launch(instance, started, timeout_s=900, say=say)
            except TimeoutError as error:
                say(f"{error}; vLLM log tail:\n{log_tail(spec)}")
                return 1
            if run.status != dg.DagsterRunStatus.SUCCESS:
                say(f"launch run {run.run_id} ended {run.status.value}: see `make ui`")
                return 1
            for key in ("drafter_checkpoint", "synthetic_generations"):
                event = instance.get_latest_materialization_event(dg.AssetKey(key))
                meta = {k: v.value for k, v in event.asset_materialization.metadata.items()}
                say(f"{key}: " + ", ".join(f"{k}={meta[k]}" for k in SUMMARY[key]))
    say(
        f"done in {time.monotonic() - started:.0f}s. vLLM keeps running at {spec.base_url} "
        "(`make stop` stops it); explore with `make ui` -> http://127.0.0.1:3000 "
        "(Assets -> vllm_server -> Events; Runs -> launch)"
    )
    return 0


SUMMARY = {
    "drafter_checkpoint": ("repo_id", "revision", "parameters", "aux_layer_ids_vllm"),
    "synthetic_generations": ("samples", "completion_tokens", "output_tokens_per_s", "seconds"),
}


if __name__ == "__main__":
    sys.exit(main())

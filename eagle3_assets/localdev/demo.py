"""`make demo`: the whole story on a miniature world, through Dagster's real daemon path.

Builds the world (by default the Kimi one: DeepSeek-V3 targets, a remote-code tokenizer, a
thinking template; `--world llama` for the Llama one), starts vLLM on the newer target (it
plays Kimi-K2.5), starts the Dagster
daemon, and follows what a user would watch in the UI: the readiness sensor observing the
server load and become ready; the launch run it requests (the drafter download beside the
first batch); the other batches; each batch's hidden states; the finetuning once every batch
is extracted; the evaluation of warm start vs finetuned drafter in vLLM. Stopped halfway
(Ctrl-C), it resumes when run again: every asset keeps its progress on disk, and the daemon
retries the runs the stop interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from eagle3_assets.lib.serving.vllm_launcher import (
    LaunchError,
    log_tail,
    read_pid,
    start,
)
from eagle3_assets.lib.serving.vllm_probe import probe
from eagle3_assets.localdev.hub import LOCAL_DRAFTER_REPO, publish_local_drafter
from eagle3_assets.localdev.miniature import (
    PROJECT_ROOT,
    SERVED_TARGET_NAME,
    miniature_env,
    miniature_server,
)
from eagle3_assets.localdev.processes import running_daemon
from eagle3_assets.localdev.world import build_world

DEMO_WORLDS = {"kimi": "kimi-demo", "llama": "demo"}  # `make demo WORLD=llama`: the Llama one
LAUNCH_JOB = "launch"
SENSOR_NAME = "vllm_readiness_sensor"


def launch_runs(instance, instance_ids: str | None = None) -> list:
    """The launch runs the readiness sensor requested (for one server start, if given)."""
    import dagster as dg

    tags = {"dagster/sensor_name": SENSOR_NAME}
    if instance_ids:
        tags["eagle3/server_instances"] = instance_ids
    return instance.get_runs(filters=dg.RunsFilter(job_name=LAUNCH_JOB, tags=tags))


def observations_since(instance, since: float, after_id: int = 0) -> list:
    """vllm_server observation records made at or after `since` (epoch seconds) and stored
    after `after_id`, oldest first: one stored before this demo started describes a server
    that may be gone (a kill -9 leaves the last 'ready' behind)."""
    import dagster as dg

    records = instance.fetch_observations(dg.AssetKey("vllm_server"), limit=20).records
    return [r for r in reversed(records) if r.timestamp >= since and r.storage_id > after_id]


def attempts(instance, run) -> list:
    """`run` and its retries, in order: a failed run that will be retried is followed into its
    retry (tagged with its parent's id) once the daemon has created it."""
    import dagster as dg
    from dagster._core.storage.tags import PARENT_RUN_ID_TAG

    chain = [run]
    while will_retry(chain[-1]):
        retries = instance.get_runs(
            filters=dg.RunsFilter(tags={PARENT_RUN_ID_TAG: chain[-1].run_id}), limit=1
        )
        if not retries:
            break
        chain.append(retries[0])
    return chain


def will_retry(run) -> bool:
    """A failed run that Dagster's run retries will start again."""
    import dagster as dg
    from dagster._core.storage.tags import WILL_RETRY_TAG

    return run.status == dg.DagsterRunStatus.FAILURE and run.tags.get(WILL_RETRY_TAG) == "true"


def follow_launch(
    instance, started: float, timeout_s: float, say, since: float, base_url: str
) -> object:
    """Narrate the observations made since `since`, then the launch run of the server that
    answers at `base_url` now (an older start's runs are history) and its retries; return the
    attempt that succeeded, or the one that failed for good."""
    last_observation, seen_status = 0, {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for record in observations_since(instance, since, last_observation):
            last_observation = record.storage_id
            meta = {k: v.value for k, v in record.asset_observation.metadata.items()}
            if meta["state"] == "ready":
                extra = f"max_model_len {meta['max_model_len']}, vLLM {meta['vllm_version']}"
            else:
                extra = meta["detail"]
            say(
                f"+{time.monotonic() - started:4.0f}s vllm_server observed: {meta['state']} "
                f"({extra})"
            )
        server = probe(base_url)
        runs = launch_runs(instance, server.instance_id) if server.instance_id else []
        if runs:
            chain = attempts(instance, runs[-1])  # the sensor's request for this server start
            for run in chain:
                if seen_status.get(run.run_id) != run.status:
                    seen_status[run.run_id] = run.status
                    retry = " (a retry follows)" if will_retry(run) else ""
                    say(
                        f"+{time.monotonic() - started:4.0f}s launch run {run.run_id[:8]}: "
                        f"{run.status.value}{retry}"
                    )
            if chain[-1].is_finished and not will_retry(chain[-1]):
                return chain[-1]
        time.sleep(2)
    raise TimeoutError(f"no finished launch run after {timeout_s:.0f}s")


# The miniature's recipe: greedy answers (evaluation is greedy too), the automation on, the
# backfill schedule every minute instead of every 15, a short finetuning at a warm-start lr.
DEMO_SETTINGS = {
    "EAGLE3_BATCH_SIZE": "50",
    "EAGLE3_MAX_TOKENS": "128",
    "EAGLE3_TEMPERATURE": "0",
    "EAGLE3_AUTOMATION": "1",
    "EAGLE3_BACKFILL_CRON": "* * * * *",
    "EAGLE3_TRAIN_STEPS": "200",
    "EAGLE3_TRAIN_LR": "1e-3",
    "EAGLE3_HOLDOUT_FRACTION": "0.05",
}

# What the narration prints of each materialization.
SUMMARY = {
    "drafter_checkpoint": ("repo_id", "parameters", "aux_layer_ids_vllm"),
    "synthetic_generations": ("samples", "completion_tokens", "output_tokens_per_s"),
    "hidden_states": ("samples", "tokens", "size", "tokens_per_s"),
    "eagle3_drafter": ("steps", "final_loss", "final_accuracy_by_position", "seconds"),
    "drafter_evaluation": (
        "mean_acceptance_length_warm_start",
        "mean_acceptance_length",
        "speedup",
    ),
}


def run_label(run) -> str:
    """What a run does, in the UI's words: its job, or its assets, and its batch."""
    assets = sorted(k.to_user_string() for k in run.asset_selection or [])
    what = run.job_name if run.job_name != "__ASSET_JOB" else "+".join(assets)
    # one partition: a job's tag; a backfill's run (automation requests backfills): a range
    partition = run.tags.get("dagster/partition") or run.tags.get(
        "dagster/asset_partition_range_start"
    )
    return f"{what}[{partition}]" if partition else what


def follow_pipeline(instance, started: float, since: float, timeout_s: float, say):
    """Narrate runs and materializations after `since` until drafter_evaluation is
    materialized; return that materialization's record."""
    import datetime

    import dagster as dg

    statuses: dict[str, object] = {}
    cursors: dict[str, str | None] = dict.fromkeys(SUMMARY)
    after = datetime.datetime.fromtimestamp(since, tz=datetime.UTC)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        clock = f"+{time.monotonic() - started:4.0f}s"
        for run in reversed(instance.get_runs(filters=dg.RunsFilter(created_after=after))):
            if statuses.get(run.run_id) != run.status:
                statuses[run.run_id] = run.status
                say(f"{clock} run {run.run_id[:8]} {run_label(run)}: {run.status.value}")
        for key, fields in SUMMARY.items():
            found = instance.fetch_materializations(
                dg.AssetKey(key), limit=100, cursor=cursors[key], ascending=True
            )
            cursors[key] = found.cursor
            for record in found.records:
                if record.timestamp < since:
                    continue
                materialization = record.asset_materialization
                meta = {k: v.value for k, v in materialization.metadata.items()}
                partition = f"[{materialization.partition}]" if materialization.partition else ""
                say(
                    f"{clock} {key}{partition}: "
                    + ", ".join(f"{f}={meta[f]}" for f in fields if f in meta)
                )
                if key == "drafter_evaluation":
                    return record
        time.sleep(2)
    raise TimeoutError(f"no drafter_evaluation after {timeout_s:.0f}s")


def outcome(instance, record, say) -> int:
    """The before/after table, the check's verdict, and where to look."""
    import dagster as dg

    from eagle3_assets.lib.evaluation.evaluate import comparison_table

    meta = {k: v.value for k, v in record.asset_materialization.metadata.items()}
    checks = instance.all_logs(record.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
    verdicts = [c.dagster_event.event_specific_data for c in checks]
    table = comparison_table([row.data for row in meta["comparison"].records])
    print("\n" + table + "\n", flush=True)
    say(f"serve it: {meta['serve_with']}")
    for check in verdicts:
        say(f"check {check.check_name}: {'passed' if check.passed else 'FAILED'}")
    say(
        "look in the web UI: `make ui` -> http://127.0.0.1:3000 ; Assets -> Lineage for the "
        "graph; drafter_evaluation -> the table, the per-position chart and the training-time "
        "accuracy; eagle3_drafter -> the loss curves; Runs -> any run's log"
    )
    return 0 if verdicts and all(c.passed for c in verdicts) else 1


def claim_data(data: Path, size: str) -> str | None:
    """Mark `data` as holding the story of world `size`; the story of another world there
    (its generations, shards and Dagster history) is refused, not mixed in: its name is
    returned."""
    marker = data / "demo-world"
    if marker.exists() and marker.read_text().strip() != size:
        return marker.read_text().strip()
    data.mkdir(parents=True, exist_ok=True)
    marker.write_text(size + "\n")
    return None


def main(argv: list[str] | None = None) -> int:
    import dagster as dg

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", choices=DEMO_WORLDS, default="kimi")
    args = parser.parse_args(argv)
    data = Path(os.environ.get("EAGLE3_DATA", PROJECT_ROOT / "data"))
    dagster_home = Path(os.environ.get("DAGSTER_HOME", PROJECT_ROOT / ".dagster_home"))
    port = int(os.environ.get("EAGLE3_DEMO_PORT", "8000"))

    def say(message: str) -> None:
        print(f"[demo] {message}", flush=True)

    started, since = time.monotonic(), time.time()
    size = DEMO_WORLDS[args.world]
    other = claim_data(data, size)
    if other is not None:
        say(f"{data} holds the story of world {other!r}, not {size!r}: `make clean` first")
        return 1
    world = build_world(data / "world", size, log=say)
    hub = world.root / "hub"
    say("the world's warm-start drafter: EAGLE-3 trained on target-v1 (built once)")
    sha = publish_local_drafter(world, hub, draft_vocab_size=1024)
    say(f"local hub: {LOCAL_DRAFTER_REPO}@{sha[:12]} (the drafter for target-v1) in {hub}")
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        done = complete(instance)
        if done is not None:
            say("the story is complete already (`make clean` starts it over):")
            return outcome(instance, done, say)

    spec = miniature_server(
        world.target_v2, data / "vllm", port, SERVED_TARGET_NAME, world.spec.trust_remote_code
    )
    current = probe(spec.base_url)
    if current.healthy and SERVED_TARGET_NAME in current.model_ids:
        say(f"vLLM already serves {SERVED_TARGET_NAME} at {spec.base_url}: reusing it")
    else:
        before = read_pid(spec.pid_file)
        try:
            pid = start(spec)  # the server a previous demo started, if it is still loading
        except LaunchError as error:
            say(f"cannot start vLLM: {error}")
            return 1
        if pid == before:
            say(
                f"waiting for the vLLM server it started before (pid {pid}) to finish loading; "
                f"log: {spec.log_file}"
            )
        else:
            say(
                f"vLLM starting (pid {pid}) at {spec.base_url}, serving {world.target_v2.name} "
                f"as {SERVED_TARGET_NAME}; log: {spec.log_file}"
            )

    env = miniature_env(world, hub, spec.base_url, data, SERVED_TARGET_NAME) | DEMO_SETTINGS
    with running_daemon(dagster_home, env, data / "dagster-daemon.log"):
        say(
            f"dagster daemon running (DAGSTER_HOME={dagster_home}); the readiness sensor "
            "ticks every 10 s"
        )
        with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
            try:
                run = follow_launch(
                    instance, started, timeout_s=900, say=say, since=since, base_url=spec.base_url
                )
                if run.status != dg.DagsterRunStatus.SUCCESS:  # and no retry is coming
                    say(f"launch run {run.run_id} ended {run.status.value}: see `make ui`")
                    return 1
                record = follow_pipeline(instance, started, since, timeout_s=3600, say=say)
            except TimeoutError as error:
                say(f"{error}; vLLM log tail:\n{log_tail(spec)}")
                return 1
            say(f"done in {time.monotonic() - started:.0f}s")
            status = outcome(instance, record, say)
    say(f"vLLM keeps running at {spec.base_url} (`make stop` stops it)")
    return status


def complete(instance):
    """drafter_evaluation's latest record if it evaluated the latest drafter, else None."""
    import dagster as dg

    def latest(key: str):
        records = instance.fetch_materializations(dg.AssetKey(key), limit=1).records
        return records[0] if records else None

    evaluation, drafter = latest("drafter_evaluation"), latest("eagle3_drafter")
    if evaluation and drafter and evaluation.storage_id > drafter.storage_id:
        return evaluation
    return None


if __name__ == "__main__":
    sys.exit(main())

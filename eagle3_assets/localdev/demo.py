"""`make demo`: the whole story on a miniature world, through Dagster's real daemon path.

Builds the world (by default the Kimi one: DeepSeek-V3 targets, a remote-code tokenizer, a
thinking template; `--world llama` for the Llama one), starts vLLM on the newer target (it
plays Kimi-K2.5), starts the Dagster daemon, and follows what a user would watch in the UI,
in three acts.
1. The readiness sensor observes the server load and become ready; the launch run it requests
   (the drafter download beside the first batch); the other batches; each batch's hidden
   states; the finetuning once every batch is extracted; the evaluation of warm start vs
   finetuned drafter in vLLM; its promotion, and serving restarted with it.
2. A file of another kind of prompt (questions about Python's data model, which the pool never
   asked) arrives in the inbox: its batches, a retraining from the promoted drafter, its
   evaluation, its promotion, and the served acceptance on that kind of prompt, before and
   after.
3. More of that traffic arrives while training is set to a few steps: the poor candidate is
   refused and serving keeps the better drafter.
Stopped anywhere (Ctrl-C), it resumes when run again: every asset keeps its progress on disk,
the daemon retries the runs the stop interrupted, and each act goes on from what is done.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from eagle3_assets.lib.core.atomic_files import write_atomically
from eagle3_assets.lib.evaluation.promotion import Decision, Registry
from eagle3_assets.lib.serving.rollout import drafter_of, last_good
from eagle3_assets.lib.serving.vllm_launcher import (
    LaunchError,
    VLLMLaunchSpec,
    group_alive,
    launched_spec,
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
from eagle3_assets.localdev.prompts import DATA_MODEL_TOPICS, split_by_kind
from eagle3_assets.localdev.world import World, build_world
from eagle3_assets.partitions import request_failed_steps_again

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
    instance,
    started: float,
    timeout_s: float,
    say,
    since: float,
    base_url: str,
    keep_serving: Callable[[], None] = lambda: None,
) -> object:
    """Narrate the observations made since `since`, then the launch run of the server that
    answers at `base_url` now (an older start's runs are history) and its retries; return the
    attempt that succeeded, or the one that failed for good. `keep_serving` runs at each
    poll: the server waited on may die meanwhile."""
    last_observation, seen_status = 0, {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        keep_serving()
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
# backfill schedule and the maintenance window every minute instead of every 15 and nightly,
# a short finetuning at a warm-start lr.
DEMO_SETTINGS = {
    "EAGLE3_BATCH_SIZE": "40",
    "EAGLE3_MAX_TOKENS": "128",
    "EAGLE3_TEMPERATURE": "0",
    "EAGLE3_AUTOMATION": "1",
    "EAGLE3_BACKFILL_CRON": "* * * * *",
    "EAGLE3_MAINTENANCE_CRON": "* * * * *",
    "EAGLE3_TRAIN_STEPS": "200",
    "EAGLE3_TRAIN_LR": "1e-3",
    "EAGLE3_HOLDOUT_FRACTION": "0.05",
}
POOR_CANDIDATE = {"EAGLE3_TRAIN_STEPS": "3"}  # the third act: a deliberately poor candidate

# What the narration prints of each materialization.
SUMMARY = {
    "drafter_checkpoint": ("repo_id", "parameters", "aux_layer_ids_vllm"),
    "synthetic_generations": ("samples", "completion_tokens", "output_tokens_per_s"),
    "hidden_states": ("samples", "tokens", "size", "tokens_per_s"),
    "eagle3_drafter": ("steps", "warm_start_version", "new_batches", "final_loss", "seconds"),
    "drafter_evaluation": (
        "incumbent",
        "mean_acceptance_length_warm_start",
        "mean_acceptance_length",
        "speedup",
    ),
    "promoted_drafter": ("verdict", "serving", "reason"),
    "served_drafter": ("drafter", "mean_acceptance_length"),
}

T = TypeVar("T")


def run_label(run) -> str:
    """What a run does, in the UI's words: its job, or its assets, and its batch."""
    assets = sorted(k.to_user_string() for k in run.asset_selection or [])
    what = run.job_name if run.job_name != "__ASSET_JOB" else "+".join(assets)
    # one partition: a job's tag; a backfill's run (automation requests backfills): a range
    partition = run.tags.get("dagster/partition") or run.tags.get(
        "dagster/asset_partition_range_start"
    )
    return f"{what}[{partition}]" if partition else what


@dataclass(frozen=True)
class FailedStep:
    """A step of the story whose latest run failed and will not be retried."""

    run_id: str
    label: str  # run_label's
    error: str  # the last line of its last error

    def __str__(self) -> str:
        return f"{self.label} failed for good in run {self.run_id[:8]} ({self.error})"

    def tell(self) -> str:
        return (
            f"{self}; its log: `make ui` -> Runs -> {self.run_id[:8]}. Fix the cause, then "
            "`make demo` again: it asks for this step once more and the story goes on from "
            "the saved progress"
        )


class StoryStopped(Exception):
    def __init__(self, steps: list[FailedStep]) -> None:
        super().__init__("; ".join(step.tell() for step in steps))
        self.steps = steps


def last_error(instance, run_id: str) -> str:
    """The innermost cause of the run's last step failure, or its run failure's message (a
    worker that died has no step failure)."""
    import dagster as dg

    types = {dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.RUN_FAILURE}
    for entry in reversed(instance.all_logs(run_id, of_type=types)):
        error = getattr(entry.dagster_event.event_specific_data, "error", None)
        while error is not None and error.cause is not None:
            error = error.cause
        text = (error.message if error is not None else entry.message or "").strip()
        if text:
            return text.splitlines()[-1]
    return "no error recorded"


def failed_for_good(instance, ended_after: float = 0.0) -> list[FailedStep]:
    """The steps whose latest run (by run_label) failed, will not be retried, ended after
    `ended_after` (epoch seconds) and left an asset of its selection unmaterialized since it
    was created (no later run of another label made it)."""
    import dagster as dg
    from dagster._core.storage.tags import PARTITION_NAME_TAG

    latest: dict[str, object] = {}
    for record in instance.get_run_records(limit=100):  # newest first
        latest.setdefault(run_label(record.dagster_run), record)
    failed = []
    for label, record in latest.items():
        run = record.dagster_run
        ended = record.end_time or 0.0
        if run.status != dg.DagsterRunStatus.FAILURE or will_retry(run) or ended <= ended_after:
            continue
        partition = run.tags.get(PARTITION_NAME_TAG)
        made = [
            dg.AssetRecordsFilter(
                key,
                asset_partitions=[partition] if partition else None,
                after_timestamp=record.create_timestamp.timestamp(),
            )
            for key in run.asset_selection or ()
        ]
        if not all(instance.fetch_materializations(m, limit=1).records for m in made):
            failed.append(FailedStep(run.run_id, label, last_error(instance, run.run_id)))
    return failed


def ask_again_for_failed_steps(instance, say) -> None:
    """`make demo` again is the user's request to go on: each step that failed for good is
    asked for once more, by the automation that asked for it first."""
    if failed := failed_for_good(instance):
        sensors = ", ".join(request_failed_steps_again(instance))
        for step in failed:
            say(f"{step}: asking for it once more ({sensors} start afresh)")


class Narrator:
    """Prints the runs and materializations made since the demo started, as the UI lists
    them, while waiting for the story's next step."""

    def __init__(self, instance, started: float, since: float, say) -> None:
        import datetime

        self.instance, self.started, self.since, self.say = instance, started, since, say
        self.after = datetime.datetime.fromtimestamp(since, tz=datetime.UTC)
        self.statuses: dict[str, object] = {}
        self.cursors: dict[str, str | None] = dict.fromkeys(SUMMARY)

    def until(self, step: Callable[[], T | None], what: str, timeout_s: float = 3600) -> T:
        """Narrate until `step()` returns something (the story's next step is done); a step
        that failed for good meanwhile stops the story (nothing would ask for it again)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.narrate()
            if (done := step()) is not None:
                return done
            if failed := failed_for_good(self.instance, ended_after=self.since):
                raise StoryStopped(failed)
            time.sleep(2)
        raise TimeoutError(f"no {what} after {timeout_s:.0f}s")

    def narrate(self) -> None:
        import dagster as dg

        clock = f"+{time.monotonic() - self.started:4.0f}s"
        for run in reversed(
            self.instance.get_runs(filters=dg.RunsFilter(created_after=self.after))
        ):
            if self.statuses.get(run.run_id) != run.status:
                self.statuses[run.run_id] = run.status
                self.say(f"{clock} run {run.run_id[:8]} {run_label(run)}: {run.status.value}")
        for key, fields in SUMMARY.items():
            found = self.instance.fetch_materializations(
                dg.AssetKey(key), limit=100, cursor=self.cursors[key], ascending=True
            )
            self.cursors[key] = found.cursor
            for record in found.records:
                if record.timestamp < self.since:
                    continue
                materialization = record.asset_materialization
                meta = {k: v.value for k, v in materialization.metadata.items()}
                partition = f"[{materialization.partition}]" if materialization.partition else ""
                self.say(
                    f"{clock} {key}{partition}: "
                    + ", ".join(f"{f}={meta[f]}" for f in fields if f in meta)
                )


def evaluated(instance, after: float = 0.0):
    """drafter_evaluation's latest record once its run is over, if it evaluated the latest
    drafter and that drafter was trained after `after` (epoch seconds); else None."""
    import dagster as dg

    def latest(key: str):
        records = instance.fetch_materializations(dg.AssetKey(key), limit=1).records
        return records[0] if records else None

    evaluation, drafter = latest("drafter_evaluation"), latest("eagle3_drafter")
    if not (evaluation and drafter and drafter.timestamp > after):
        return None
    if evaluation.storage_id < drafter.storage_id or not (
        instance.get_run_by_id(evaluation.run_id).is_finished  # its check is recorded
    ):
        return None
    return evaluation


def outcome(instance, record, say) -> int:
    """The evaluation's table and its check's verdict."""
    import dagster as dg

    from eagle3_assets.lib.evaluation.evaluate import comparison_table

    meta = {k: v.value for k, v in record.asset_materialization.metadata.items()}
    checks = instance.all_logs(record.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
    verdicts = [c.dagster_event.event_specific_data for c in checks]
    table = comparison_table([row.data for row in meta["comparison"].records])
    print("\n" + table + "\n", flush=True)
    for check in verdicts:
        say(f"check {check.check_name}: {'passed' if check.passed else 'FAILED'}")
    return 0 if verdicts and all(c.passed for c in verdicts) else 1


@dataclass(frozen=True)
class Traffic:
    """The story's prompts: the first act's pool (every kind but one), then two files of the
    kind it never asked (questions about Python's data model) that the second and third acts
    drop in the inbox."""

    pool: Path
    arrivals: tuple[Path, Path]
    inbox: Path
    of_the_new_kind: list[list[dict]]  # the fixed held-out set's data-model questions

    def dropped(self, arrival: Path) -> bool:
        return (self.inbox / arrival.name).exists()

    def arrived(self, arrival: Path) -> float:
        """When `arrival` was dropped (epoch seconds): a drafter trained since learnt it."""
        return (self.inbox / arrival.name).stat().st_mtime

    def drop(self, arrival: Path) -> None:
        """As a gateway does: written beside, then renamed in (never read half written)."""
        write_atomically(self.inbox / arrival.name, arrival.read_bytes())


def write_traffic(world: World, folder: Path, inbox: Path) -> Traffic:
    """The world's prompts split by kind, three quarters of the new kind in the first file.
    Written again with the same bytes on every start: the pool must never change once the
    inbox counted it."""
    pool, arriving = split_by_kind(world.prompts, world.heldout_prompts, world.spec.topic_keys())
    cut = len(arriving) * 3 // 4
    files = {
        "pool.jsonl": pool,
        "data-model-1.jsonl": arriving[:cut],
        "data-model-2.jsonl": arriving[cut:],
    }
    folder.mkdir(parents=True, exist_ok=True)
    inbox.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        payload = "".join(json.dumps(row) + "\n" for row in rows).encode()
        if not (folder / name).exists() or (folder / name).read_bytes() != payload:
            write_atomically(folder / name, payload)
    heldout = [json.loads(line) for line in world.heldout_prompts.read_text().splitlines()]
    return Traffic(
        pool=folder / "pool.jsonl",
        arrivals=(folder / "data-model-1.jsonl", folder / "data-model-2.jsonl"),
        inbox=inbox,
        of_the_new_kind=[r["messages"] for r in heldout if r["source"] in DATA_MODEL_TOPICS],
    )


class Story:
    """Where the story stands, read from the volume: the promotion registry's decisions, the
    drafter serving confirmed (the replica's good.json) and the served acceptance measured on
    the new kind of prompt, per drafter (`demo-served.json`)."""

    def __init__(self, data: Path, run_dir: Path) -> None:
        self.registry = Registry(data / "promotion")
        self.run_dir = run_dir
        self.measured = data / "demo-served.json"

    def decision(self, number: int) -> Decision | None:
        decisions = self.registry.decisions()
        return decisions[number - 1] if len(decisions) >= number else None

    def served_drafter(self) -> str | None:
        """The path of the drafter the replica last served well."""
        good = last_good(self.run_dir)
        return drafter_of(good) if good else None

    def serving(self) -> str:
        """The name of the drafter the replica last served well (for the narration)."""
        drafter = self.served_drafter()
        names = {v.path: v.name for v in self.registry.versions()}
        return names.get(drafter, drafter or "no drafter")

    def serves_promoted(self) -> str | None:
        """Polled every 2 s: two small reads, not every version's record."""
        current = self.registry.current()
        return current.name if current and self.served_drafter() == current.path else None

    def served_acceptance(self) -> dict[str, float]:
        return json.loads(self.measured.read_text()) if self.measured.exists() else {}

    def record(self, drafter: str, acceptance: float) -> None:
        write_atomically(
            self.measured, json.dumps(self.served_acceptance() | {drafter: acceptance}).encode()
        )


def measure_served(
    story: Story, spec: VLLMLaunchSpec, traffic: Traffic, env: dict[str, str], say
) -> None:
    """The serving replica's acceptance on the held-out data-model questions, from /metrics
    (nothing else uses the replica meanwhile: every batch is generated), answered as the
    rollout's confirmation and the evaluation answer: the daemon's `env` recipes."""
    from eagle3_assets.definitions import resources_from_env
    from eagle3_assets.lib.evaluation.acceptance import measure_acceptance

    drafter = story.serving()
    if drafter not in story.served_acceptance():
        resources = resources_from_env(env)
        served = measure_acceptance(
            spec.base_url,
            SERVED_TARGET_NAME,
            traffic.of_the_new_kind,
            max_tokens=resources["evaluation"].max_tokens,
            chat_template_kwargs=resources["generation"].config().chat_template_kwargs,
        )
        story.record(drafter, round(served.mean_length, 3))
    acceptance = story.served_acceptance()[drafter]
    say(
        f"served by {drafter}: mean acceptance length {acceptance:.3f} on the "
        f"{len(traffic.of_the_new_kind)} held-out questions about Python's data model"
    )


def judged(story: Story, number: int, after: float, narrator: Narrator, say) -> Decision | None:
    """The decision on candidate `number` (trained after `after`, epoch seconds), once its
    evaluation's table and the verdict are told; None if it failed its evaluation check
    (nothing to judge)."""
    if (decision := story.decision(number)) is None:
        record = narrator.until(
            lambda: evaluated(narrator.instance, after), f"evaluation of candidate {number}"
        )
        if outcome(narrator.instance, record, say):
            say("the candidate failed its evaluation check: see drafter_evaluation in the UI")
            return None
        decision = narrator.until(lambda: story.decision(number), f"decision on {number}")
    say(f"candidate {number} {'promoted' if decision.promoted else 'refused'}: {decision.reason}")
    return decision


def rolled_out(story: Story, narrator: Narrator, say) -> None:
    served = narrator.until(story.serves_promoted, "rollout of the promoted drafter")
    say(f"the maintenance window restarted serving with {served}")


def first_act(story: Story, narrator: Narrator, say) -> int:
    decision = judged(story, 1, 0.0, narrator, say)
    if decision is None or not decision.promoted:
        return 1
    rolled_out(story, narrator, say)
    return 0


def second_act(
    story: Story,
    narrator: Narrator,
    spec: VLLMLaunchSpec,
    traffic: Traffic,
    env: dict[str, str],
    say,
) -> int:
    arrival = traffic.arrivals[0]
    if not traffic.dropped(arrival):
        measure_served(story, spec, traffic, env, say)
        rows = len(arrival.read_text().splitlines())
        say(f"ACT 2: {arrival.name} arrives in the inbox: {rows} questions about Python's data "
            "model, a kind the pool never asked")  # fmt: skip
        traffic.drop(arrival)
    decision = judged(story, 2, traffic.arrived(arrival), narrator, say)
    if decision is None or not decision.promoted:
        return 1
    rolled_out(story, narrator, say)
    measure_served(story, spec, traffic, env, say)
    return 0


def third_act(story: Story, narrator: Narrator, traffic: Traffic, say) -> int:
    arrival = traffic.arrivals[1]
    if not traffic.dropped(arrival):
        rows = len(arrival.read_text().splitlines())
        say(f"ACT 3: EAGLE3_TRAIN_STEPS={POOR_CANDIDATE['EAGLE3_TRAIN_STEPS']} (a deliberately "
            f"poor candidate), and {arrival.name} arrives: {rows} more such questions")  # fmt: skip
        traffic.drop(arrival)
    decision = judged(story, 3, traffic.arrived(arrival), narrator, say)
    if decision is None or decision.promoted:  # the poor candidate must be refused
        return 1
    say(f"serving keeps {story.serving()}")
    return 0


def epilogue(story: Story, say) -> int:
    """The candidates judged, what serves, and the served acceptance on the new kind."""
    decisions = story.registry.decisions()
    for number, decision in enumerate(decisions, 1):
        scores = ", ".join(f"{s} {v:.3f}" for s, v in decision.candidate_acceptance.items())
        verdict = "promoted" if decision.promoted else "refused"
        say(f"candidate {number} ({scores}) vs {decision.incumbent}: {verdict}")
    served = story.served_acceptance()
    say(f"serving: {story.serving()}; served acceptance on the held-out data-model questions: "
        + ", ".join(f"{d} {a:.3f}" for d, a in served.items()))  # fmt: skip
    say(
        "look in the web UI: `make ui` -> http://127.0.0.1:3000 ; Assets -> Lineage for the "
        "graph; drafter_evaluation -> the table per prompt set; promoted_drafter -> the "
        "history chart and the check's reasons; eagle3_drafter -> the loss curves; Runs -> any "
        "run's log"
    )
    verdicts = [d.promoted for d in decisions]
    measured = list(served.values())
    rose = len(measured) == 2 and measured[1] > measured[0]
    return 0 if verdicts == [True, True, False] and rose else 1


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


def last_launched(spec: VLLMLaunchSpec) -> VLLMLaunchSpec:
    """The server of `spec`'s run dir as it was last started (with the drafter a rollout
    gave it), or `spec` if it never was."""
    return launched_spec(spec.run_dir) if (spec.run_dir / "launch.json").exists() else spec


def serving_spec(world: World, data: Path, port: int) -> VLLMLaunchSpec:
    """The replica as it was last started, or plain."""
    return last_launched(
        miniature_server(
            world.target_v2, data / "vllm", port, SERVED_TARGET_NAME, world.spec.trust_remote_code
        )
    )


def ensure_serving(spec: VLLMLaunchSpec, say) -> bool:
    current = probe(spec.base_url)
    if current.healthy and SERVED_TARGET_NAME in current.model_ids:
        say(f"vLLM already serves {SERVED_TARGET_NAME} at {spec.base_url}: reusing it")
        return True
    before = read_pid(spec.pid_file)
    try:
        pid = start(spec)  # the server a previous demo started, if it is still loading
    except LaunchError as error:
        say(f"cannot start vLLM: {error}")
        return False
    if pid == before:
        say(
            f"waiting for the vLLM server it started before (pid {pid}) to finish loading; "
            f"log: {spec.log_file}"
        )
    else:
        say(
            f"vLLM starting (pid {pid}) at {spec.base_url}, serving {Path(spec.model).name} as "
            f"{SERVED_TARGET_NAME}; log: {spec.log_file}"
        )
    return True


def restart_if_dead(spec: VLLMLaunchSpec, say) -> None:
    """The server the demo started, started again as last launched (a rollout's drafter
    included) if its process group died: a kill -9 of vLLM's engine ends its API server
    seconds later, and no launch run can come without a server."""
    pid = read_pid(spec.pid_file)
    if pid is None or group_alive(pid):  # not ours, or alive
        return
    last = last_launched(spec)
    new = start(last)
    say(f"the vLLM server it waited on (pid {pid}) exited: started it again as last launched "
        f"(pid {new}); log: {last.log_file}")  # fmt: skip


def wait_idle(instance, timeout_s: float = 600) -> None:
    """Until no run is queued or in flight (a daemon stopped now interrupts nothing)."""
    import dagster as dg

    busy = [
        dg.DagsterRunStatus.QUEUED,
        dg.DagsterRunStatus.NOT_STARTED,
        dg.DagsterRunStatus.STARTING,
        dg.DagsterRunStatus.STARTED,
    ]
    deadline = time.monotonic() + timeout_s
    while instance.get_runs_count(dg.RunsFilter(statuses=busy)) and time.monotonic() < deadline:
        time.sleep(2)


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
    traffic = write_traffic(world, data / "traffic", data / "incoming")
    spec = serving_spec(world, data, port)
    story = Story(data, spec.run_dir)
    if story.decision(3) is not None:
        say("the story is complete already (`make clean` starts it over):")
        return epilogue(story, say)
    if not ensure_serving(spec, say):
        return 1

    env = miniature_env(world, hub, spec.base_url, data, SERVED_TARGET_NAME) | DEMO_SETTINGS
    env |= {
        "EAGLE3_PROMPTS": str(traffic.pool),
        "EAGLE3_INBOX": str(traffic.inbox),
        "EAGLE3_SERVING_RUN_DIRS": str(spec.run_dir),
    }
    daemon_log = data / "dagster-daemon.log"
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        narrator = Narrator(instance, started, since, say)
        ask_again_for_failed_steps(instance, say)
        try:
            if not traffic.dropped(traffic.arrivals[1]):  # the third act runs its own recipe
                with running_daemon(dagster_home, env, daemon_log):
                    say(f"dagster daemon running (DAGSTER_HOME={dagster_home}); the readiness "
                        "sensor ticks every 10 s")  # fmt: skip
                    run = follow_launch(
                        instance,
                        started,
                        900,
                        say,
                        since,
                        spec.base_url,
                        keep_serving=lambda: restart_if_dead(spec, say),
                    )
                    if run.status != dg.DagsterRunStatus.SUCCESS:  # and no retry is coming
                        say(f"launch run {run.run_id} ended {run.status.value}: see `make ui`")
                        return 1
                    status = first_act(story, narrator, say) or second_act(
                        story, narrator, spec, traffic, env, say
                    )
                    if status:
                        return status
                    wait_idle(instance)
            with running_daemon(dagster_home, env | POOR_CANDIDATE, daemon_log):
                if third_act(story, narrator, traffic, say):
                    return 1
                wait_idle(instance)
        except TimeoutError as error:
            say(f"{error}; vLLM log tail:\n{log_tail(spec)}")
            return 1
        except StoryStopped as stopped:
            for step in stopped.steps:
                say(step.tell())
            return 1
        except LaunchError as error:
            say(f"cannot start vLLM again: {error}")
            return 1
    say(f"done in {time.monotonic() - started:.0f}s")
    status = epilogue(story, say)
    say(f"vLLM keeps running at {spec.base_url} (`make stop` stops it)")
    return status


if __name__ == "__main__":
    sys.exit(main())

"""A step of the story that failed for good (its run retries spent) is named with its run and
its error, and `make demo` again asks for it once more through the automation that asked
first, after which the story goes on. A real daemon on the project's dagster.yaml (its run
retries) runs a small code location whose step, under the project's automation condition,
fails while a file exists."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from dagster._core.scheduler.instigation import InstigatorType, TickStatus

from eagle3_assets.localdev.demo import ask_again_for_failed_steps, failed_for_good, will_retry
from eagle3_assets.localdev.processes import running_daemon
from eagle3_assets_tests.deploy.helpers import wait_for
from eagle3_assets_tests.localdev.failing_location import upstream

CODE = ("-m", "eagle3_assets_tests.localdev.failing_location")
ERROR = "the step's own error"


def step_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    """The runs of `step`, oldest first."""
    runs = instance.get_runs(filters=dg.RunsFilter(job_name="__ASSET_JOB"))
    return [r for r in reversed(runs) if dg.AssetKey("step") in (r.asset_selection or ())]


def finished(instance: dg.DagsterInstance, count: int):
    """The runs of `step` once there are `count` and the last has finished, not to be retried."""
    runs = step_runs(instance)
    done = len(runs) == count and runs[-1].is_finished and not will_retry(runs[-1])
    return runs if done else None


def ticks_after(instance: dg.DagsterInstance, ended: float, count: int) -> bool:
    """Whether the automation sensor finished `count` ticks after `ended` (epoch seconds)."""
    states = [
        s
        for s in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
        if s.name == "step_automation"
    ]
    if not states:  # stored at its first tick
        return False
    (state,) = states
    ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=count)
    return len(ticks) == count and all(
        t.status != TickStatus.STARTED and t.timestamp > ended for t in ticks
    )


def test_a_step_failed_for_good_is_named_and_asked_for_again_by_the_next_start(
    dagster_home: Path, tmp_path: Path
) -> None:
    failure = tmp_path / "failure"
    env = {"EAGLE3_TEST_FAILURE_FILE": str(failure)}
    log = tmp_path / "daemon.log"
    said: list[str] = []
    with dg.DagsterInstance.get() as instance:
        with running_daemon(dagster_home, env, log, CODE):
            # after the sensor's first tick: an update before it is no update to the sensor
            wait_for(lambda: ticks_after(instance, 0.0, 1), 120, "the sensor's first tick", log)
            dg.materialize([upstream], instance=instance)
            (first,) = wait_for(lambda: finished(instance, 1), 300, "the step's first run", log)
            assert first.status == dg.DagsterRunStatus.SUCCESS
            # a tick that sees the step's materialization first: one that saw it with the
            # next update together would take the update as handled by it
            ended = instance.get_run_record_by_id(first.run_id).end_time
            wait_for(lambda: ticks_after(instance, ended, 1), 120, "a tick after the run", log)
            failure.write_text(ERROR)  # from now on the step fails, every attempt
            dg.materialize([upstream], instance=instance)
            runs = wait_for(lambda: finished(instance, 4), 600, "three failed attempts", log)
            assert [r.status for r in runs[1:]] == [dg.DagsterRunStatus.FAILURE] * 3
            ended = instance.get_run_record_by_id(runs[-1].run_id).end_time
            wait_for(lambda: ticks_after(instance, ended, 3), 120, "three more ticks", log)
            assert len(step_runs(instance)) == 4  # nothing asks for it again by itself

        (failed,) = failed_for_good(instance)
        assert (failed.run_id, failed.label) == (runs[-1].run_id, "step")
        assert failed.error == f"RuntimeError: {ERROR}"
        failure.unlink()  # the user fixed the cause
        ask_again_for_failed_steps(instance, said.append)
        assert said == [
            f"step failed for good in run {failed.run_id[:8]} (RuntimeError: {ERROR}): asking "
            "for it once more (step_automation start afresh)"
        ]

        with running_daemon(dagster_home, env, log, CODE):
            runs = wait_for(lambda: finished(instance, 5), 300, "the step asked again", log)
            assert runs[-1].status == dg.DagsterRunStatus.SUCCESS
            assert runs[-1].tags.get("dagster/sensor_name") == "step_automation"
            ended = instance.get_run_record_by_id(runs[-1].run_id).end_time
            wait_for(lambda: ticks_after(instance, ended, 3), 120, "three more ticks", log)
            assert len(step_runs(instance)) == 5  # once more, not again and again
        assert failed_for_good(instance) == []

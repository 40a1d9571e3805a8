"""The whole story on the test-size world, through a real Dagster instance: the sensors' ticks
evaluated against it as the daemon would (readiness -> launch run -> further batches ->
hidden states -> training -> evaluation), each requested run executed, ending with a drafter
evaluated in real vLLM, and promoted. Then a broken export (the right weights told the wrong
layers) must fail the evaluation's blocking check and is refused, not better; a candidate worse
on every set is refused too.

Servers: the session's plain vLLM serves generation; drafter_evaluation starts its own, one at
a time (without drafter, warm start, finetuned, then the broken one).
"""

import json
import os
import shutil
from pathlib import Path

import dagster as dg
import pytest
from safetensors.torch import load_file

from eagle3_assets.definitions import defs
from eagle3_assets.lib.checkpoint.drafter_io import read_drafter, write_vllm_drafter
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.evaluation.evaluate import comparison_table
from eagle3_assets.localdev.miniature import SERVED_TARGET_NAME, miniature_env
from eagle3_assets_tests.conftest import SMALL_DRAFTER, free_port

pytestmark = pytest.mark.vllm

BATCH_SIZE = 16


def apply(instance: dg.DagsterInstance, result: dg.SensorResult) -> None:
    """What the daemon does with a tick's result besides launching runs."""
    for event in result.asset_events or []:
        instance.report_runless_asset_event(event)
    for request in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))


def tick(definitions: dg.Definitions, instance, name: str, cursor=None) -> dg.SensorResult:
    sensor = definitions.resolve_sensor_def(name)
    context = dg.build_sensor_context(
        instance=instance, cursor=cursor, definitions=definitions, resources=definitions.resources
    )
    result = sensor(context)
    apply(instance, result)
    return result


def execute(definitions: dg.Definitions, instance, job: str, request: dg.RunRequest):
    result = definitions.resolve_job_def(job).execute_in_process(
        instance=instance,
        partition_key=request.partition_key,
        tags=request.tags,
        asset_selection=request.asset_selection,
        raise_on_error=False,
    )
    assert result.success, f"{job} {request.partition_key} failed"
    return result


def materialize(definitions: dg.Definitions, instance, key: str, partition: str | None = None):
    job = definitions.resolve_implicit_global_asset_job_def()
    return job.execute_in_process(
        instance=instance,
        asset_selection=[dg.AssetKey(key)],
        partition_key=partition,
        raise_on_error=False,
    )


def metadata(instance, key: str) -> dict:
    event = instance.get_latest_materialization_event(dg.AssetKey(key))
    return {k: v.value for k, v in event.asset_materialization.metadata.items()}


@pytest.fixture(scope="module")
def story(test_world, test_hub, vllm_target, serving_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("story")
    extra = root / "extra.jsonl"  # "any JSONL of conversations": the pool's unbatched tail
    pool = test_world.prompts.read_text().splitlines()
    extra.write_text("\n".join(pool[len(pool) // BATCH_SIZE * BATCH_SIZE :]) + "\n")
    env = miniature_env(
        test_world, test_hub, vllm_target.base_url, root / "data", SERVED_TARGET_NAME
    )
    env |= SMALL_DRAFTER | {
        "EAGLE3_BATCH_SIZE": str(BATCH_SIZE),
        "EAGLE3_SERVING_PYTHON": str(serving_python),
        "EAGLE3_EVAL_PORT": str(free_port()),
        "EAGLE3_EVAL_PROMPT_SETS": f"extra={extra}",
    }
    with pytest.MonkeyPatch.context() as patch, dg.instance_for_test() as instance:
        for name, value in env.items():
            patch.setenv(name, value)
        yield defs(), instance


@pytest.fixture(scope="module")
def evaluated(story):
    """The story, run once for the module; the launch, batch and automation requests seen."""
    definitions, instance = story
    seen: dict[str, list] = {}
    # the automation sensor runs from the start, as in the daemon: its first evaluation only
    # sets the cursor that later updates are judged against
    cursor = dg.evaluate_automation_conditions(defs=definitions, instance=instance).cursor

    # readiness: the session server is up, so the first tick sees it ready and asks for the
    # launch run (checkpoint download beside the first batch)
    readiness = tick(definitions, instance, "vllm_readiness_sensor")
    seen["observed"] = [e.metadata["state"].value for e in readiness.asset_events]
    (launch,) = readiness.run_requests
    seen["launch"] = launch.partition_key
    execute(definitions, instance, "launch", launch)

    # the rest of the pool's full batches, registered and run because the server is ready
    batches = tick(definitions, instance, "new_batches_sensor")
    seen["new_batches"] = [r.partition_key for r in batches.run_requests]
    for request in batches.run_requests:
        execute(definitions, instance, "generate_batch", request)

    # drafter_automation, evaluated until it asks for nothing more
    seen["automation"], seen["runs"] = [], {}
    while True:
        result = dg.evaluate_automation_conditions(
            defs=definitions, instance=instance, cursor=cursor
        )
        cursor = result.cursor
        if not result.total_requested:
            break
        for key in ("hidden_states", "eagle3_drafter", "drafter_evaluation", "promoted_drafter"):
            for partition in sorted(result.get_requested_partitions(dg.AssetKey(key))):
                seen["automation"].append((key, partition))
                run = materialize(definitions, instance, key, partition)
                assert run.success, f"{key} {partition} failed"
                seen["runs"][key] = run
    return seen


def test_sensors_drive_the_graph_to_an_evaluated_drafter(evaluated, story, test_world):
    _, instance = story
    pool_size = len(test_world.prompts.read_text().splitlines())
    batches = [f"batch-{i:05d}" for i in range(pool_size // BATCH_SIZE)]
    assert evaluated["observed"] == ["ready"]
    assert evaluated["launch"] == batches[0]
    assert evaluated["new_batches"] == batches[1:]
    # every batch extracted, then ONE training once none is missing, then ONE evaluation,
    # then the candidate judged
    assert evaluated["automation"] == [
        *[("hidden_states", b) for b in batches],
        ("eagle3_drafter", None),
        ("drafter_evaluation", None),
        ("promoted_drafter", None),
    ]
    training = metadata(instance, "eagle3_drafter")
    assert training["steps"] == 60
    run = json.loads((Path(training["export"]).parent / "run.json").read_text())
    assert len(run["batch_dirs"]) == len(batches)


def test_the_finetuned_drafter_beats_the_warm_start_in_vllm(evaluated, story, test_world):
    _, instance = story
    meta = metadata(instance, "drafter_evaluation")
    rows = [record.data for record in meta["comparison"].records]
    print(comparison_table(rows))  # shown by `pytest -rP`
    finetuned, warm = meta["mean_acceptance_length"], meta["mean_acceptance_length_warm_start"]
    assert finetuned > warm + 0.1, (finetuned, warm)
    # the table: both prompt sets, three servers each, numbers from /metrics
    by = {(row["prompt set"], row["server"]): row for row in rows}
    servers = ["without drafter", "warm start", "finetuned"]
    assert [row["server"] for row in rows if row["prompt set"] == "held-out"] == servers
    assert sorted(by) == sorted((s, server) for s in ("extra", "held-out") for server in servers)
    plain, before, after = (by[("held-out", server)] for server in servers)
    # the headline numbers are the held-out rows', and agree with one another
    assert after["mean acceptance length"] == finetuned
    assert before["mean acceptance length"] == warm
    assert after["per position"] == ", ".join(f"{p:.3f}" for p in meta["per_position"])
    assert len(meta["per_position"]) == 3  # one rate per speculative token
    assert finetuned == pytest.approx(1 + sum(meta["per_position"]), abs=0.002)  # 1 + acc/drafts
    assert after["acceptance rate"] == pytest.approx(meta["acceptance_rate"], abs=6e-4)
    assert after["output tokens/s"] == meta["output_tokens_per_s"]
    ratio = meta["output_tokens_per_s"] / plain["output tokens/s"]
    assert meta["speedup"] == pytest.approx(ratio, rel=2e-3)
    assert after["speedup"] == pytest.approx(meta["speedup"], abs=0.0055)  # 2 vs 3 digits
    assert (plain["acceptance rate"], plain["per position"], plain["speedup"]) == (None, "", 1.0)
    assert meta["heldout_prompts"] == len(test_world.heldout_prompts.read_text().splitlines())
    assert {row["prompts"] for row in rows if row["prompt set"] == "held-out"} == {
        meta["heldout_prompts"]
    }
    assert meta["per_position_acceptance"].startswith("![per-position acceptance")
    assert "| finetuned | " in meta["training_time_accuracy"]
    assert "not acceptance" in meta["training_time_accuracy"]
    config = json.dumps({"method": "eagle3", "model": meta["export"], "num_speculative_tokens": 3})
    assert meta["serve_with"] == (
        f"vllm serve {test_world.target_v2} --speculative-config '{config}'"
    )
    (check,) = evaluated["runs"]["drafter_evaluation"].get_asset_check_evaluations()
    assert check.check_name == "beats_warm_start" and check.passed
    assert check.metadata["served_aux_layers"].value == [3, 5, 6]


def test_the_finetuned_drafter_is_promoted_over_the_warm_start(evaluated, story, test_world):
    definitions, instance = story
    evaluation = metadata(instance, "drafter_evaluation")
    acceptance = evaluation["acceptance_by_set"]
    assert evaluation["incumbent"] == "warm start"
    assert sorted(acceptance) == ["finetuned", "warm start"]
    assert acceptance["finetuned"]["held-out"] == evaluation["mean_acceptance_length"]

    run = evaluated["runs"]["promoted_drafter"]  # what promotion_automation asked for
    assert run.success
    (check,) = run.get_asset_check_evaluations()
    assert (check.check_name, check.passed) == ("candidate_beats_promoted", True)
    assert check.description == "beats warm start on every set"
    meta = metadata(instance, "promoted_drafter")
    assert (meta["serving"], meta["versions"], meta["verdict"]) == ("promoted v001", 1, "promoted")
    version = Path(meta["path"])
    assert version.name == "v001"
    export = Path(evaluation["export"])
    assert (version / "model.safetensors").read_bytes() == (
        export / "model.safetensors"
    ).read_bytes()
    finetuned = acceptance["finetuned"]
    row = ", ".join(f"{s} {finetuned[s]:.3f}" for s in finetuned)
    assert meta["history"].splitlines()[-1] == f"| 1 | {row} | warm start | promoted | v001 |"
    lineage = json.loads((version.parent / "v001.json").read_text())["lineage"]
    assert lineage["batches"] == metadata(instance, "eagle3_drafter")["batches"].split(", ")
    assert lineage["warm_start"] == "hub warm start"

    # the next training warm-starts from v001 and needs batches it has not learnt
    again = materialize(definitions, instance, "eagle3_drafter")
    assert not again.success
    (failure,) = [e for e in again.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "no usable batch is new since promoted v001" in str(failure.event_specific_data)


def test_a_drafter_reading_the_wrong_layers_fails_the_check(evaluated, story, test_world):
    definitions, instance = story
    export = Path(metadata(instance, "eagle3_drafter")["export"])
    good = read_drafter(export, TargetShape.from_config(test_world.target_v2))
    assert good.aux_layer_ids.vllm == (3, 5, 6)
    tensors = load_file(export / "model.safetensors")
    write_vllm_drafter(export, good.config, tensors, (1, 3, 6))  # same weights, wrong layers

    run = materialize(definitions, instance, "drafter_evaluation")
    (evaluation,) = run.get_asset_check_evaluations()
    assert not evaluation.passed
    # vLLM's own log line is the evidence: it fed the drafter the wrong layers. (On this tiny
    # target the residual streams of nearby layers are alike, so acceptance hardly drops; on
    # a big one it collapses. The check does not wait for that to show.)
    assert evaluation.metadata["served_aux_layers"].value == [1, 3, 6]
    assert evaluation.metadata["trained_aux_layers"].value == [3, 5, 6]
    assert "fix eagle_aux_hidden_state_layer_ids" in evaluation.description
    assert not run.success, "a failed blocking check fails the run"
    logs = [r.user_message for r in instance.all_logs(run.run_id)]
    # the plain, warm-start and promoted servers were measured before (v001 is a copy of the
    # finetuned drafter measured then): only the broken one started
    assert sum("starting vLLM" in m for m in logs) == 1, logs


def test_a_worse_candidate_is_refused_and_the_promoted_drafter_stays(evaluated, story):
    definitions, instance = story
    evaluation = metadata(instance, "drafter_evaluation")  # the broken drafter's evaluation
    assert evaluation["incumbent"] == "promoted v001"
    acceptance = evaluation["acceptance_by_set"]
    print(acceptance)  # shown by `pytest -rP`

    run = materialize(definitions, instance, "promoted_drafter")
    (check,) = run.get_asset_check_evaluations()
    assert not check.passed and not run.success
    candidate, incumbent = acceptance["finetuned"], acceptance["promoted v001"]
    short = [s for s in incumbent if candidate[s] < incumbent[s] * 1.02]
    assert short  # the broken drafter gains nothing over the one it was copied from
    assert check.description.split("; ") == [
        f"{s}: {candidate[s]:.3f} vs promoted v001 {incumbent[s]:.3f} (needs >= "
        f"{incumbent[s] * 1.02:.3f}, margin 2%)"
        for s in short
    ]
    meta = metadata(instance, "promoted_drafter")
    assert (meta["serving"], meta["versions"], meta["verdict"]) == ("promoted v001", 1, "refused")
    assert meta["history"].splitlines()[-1].endswith("| promoted v001 | refused | v001 |")


def test_a_measurably_worse_candidate_is_refused_on_every_set(evaluated, story):
    """A candidate that is the warm start again (a training that never moved it): served in
    vLLM (the warm start's own measurements, keyed by bytes: no server starts), it falls
    short of v001 on every set, and v001 keeps serving."""
    definitions, instance = story
    export = Path(metadata(instance, "eagle3_drafter")["export"])
    warm_start = Path(os.environ["EAGLE3_DATA_ROOT"], "evaluation", "warm_start")
    for path in warm_start.iterdir():
        shutil.copyfile(path, export / path.name)

    materialize(definitions, instance, "drafter_evaluation")
    acceptance = metadata(instance, "drafter_evaluation")["acceptance_by_set"]
    candidate, incumbent = acceptance["finetuned"], acceptance["promoted v001"]
    assert candidate == acceptance["warm start"]
    run = materialize(definitions, instance, "promoted_drafter")
    (check,) = run.get_asset_check_evaluations()
    assert not check.passed
    assert check.description.split("; ") == [
        f"{s}: {candidate[s]:.3f} vs promoted v001 {incumbent[s]:.3f} (needs >= "
        f"{incumbent[s] * 1.02:.3f}, margin 2%)"
        for s in incumbent
    ]
    assert all(candidate[s] < incumbent[s] for s in incumbent)  # worse, not only not better
    assert metadata(instance, "promoted_drafter")["serving"] == "promoted v001"

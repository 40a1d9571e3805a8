"""Serving follows promotion: the replicas restarted with the promoted drafter, one at a time,
by hand or in a maintenance window."""

from pathlib import Path

import dagster as dg

from eagle3_assets.defs.evaluation.resources import EvaluationRecipe
from eagle3_assets.defs.generation.resources import GenerationRecipe
from eagle3_assets.defs.serving.resources import ServingReplicas, VLLMServer
from eagle3_assets.lib.evaluation.promotion import Registry
from eagle3_assets.resources import Storage

CONFIRM_PROMPTS = 4  # held-out prompts each restarted replica answers before the next one


@dg.asset(
    deps=[dg.AssetKey("promoted_drafter")],
    group_name="serving",
    kinds={"vllm"},
    pool="vllm",  # never while a batch is generating on the servers
)
def served_drafter(
    context: dg.AssetExecutionContext,
    serving: ServingReplicas,
    vllm: VLLMServer,
    evaluation: EvaluationRecipe,
    generation: GenerationRecipe,
    storage: Storage,
) -> dg.MaterializeResult:
    """Every serving replica restarted with the promoted drafter (the hub warm start before any
    promotion), one at a time so that the others serve: each must be ready, serve the model
    and draft (its /metrics counts drafts on a few held-out prompts) before the next restarts.
    One that does not serves its last good drafter again and the run fails; run again after
    a crash, it waits for a server the crashed run left loading instead of restarting it."""
    from eagle3_assets.lib.evaluation.acceptance import measure_acceptance
    from eagle3_assets.lib.serving.rollout import RolloutError, roll_out

    if not serving.run_dirs:
        raise dg.Failure(
            "EAGLE3_SERVING_RUN_DIRS: expected the launcher run dirs of the serving replicas, "
            "found none (serving is started and restarted outside Dagster)"
        )
    promoted = Registry(storage.path("promotion")).current()
    drafter = Path(promoted.path) if promoted else storage.path("evaluation", "warm_start")
    name = promoted.name if promoted else "warm start"
    if not (drafter / "config.json").exists():
        raise dg.Failure(f"no drafter to serve at {drafter}: materialize drafter_evaluation")
    prompts = next(iter(evaluation.conversations().values()))[:CONFIRM_PROMPTS]
    template_kwargs = generation.config().chat_template_kwargs

    def confirm(spec) -> dict:
        served = measure_acceptance(
            spec.base_url,
            spec.served_model_name or spec.model,
            prompts,
            evaluation.max_tokens,
            api_key=vllm.api_key,
            chat_template_kwargs=template_kwargs,
        )
        if not served.drafts:
            raise RuntimeError(f"its /metrics counted no drafts on {len(prompts)} prompts")
        return {"mean_acceptance_length": round(served.mean_length, 3), "drafts": served.drafts}

    context.log.info(f"serving {name} ({drafter}) from {len(serving.run_dirs)} replica(s)")
    try:
        replicas = roll_out(
            [Path(d) for d in serving.run_dirs],
            drafter,
            evaluation.num_speculative_tokens,
            confirm,
            evaluation.load_timeout_s,
            log=context.log.info,
        )
    except RolloutError as error:
        raise dg.Failure(str(error)) from None
    rows = [
        f"| {r.base_url} | {r.confirmation['mean_acceptance_length']:.3f} | "
        f"{int(r.confirmation['drafts'])} |"
        for r in replicas
    ]
    table = ["| replica | mean acceptance length | drafts |", "| --- | --- | --- |", *rows]
    return dg.MaterializeResult(
        metadata={
            "drafter": name,
            "path": dg.MetadataValue.path(str(drafter)),
            "replicas": dg.MetadataValue.md("\n".join(table)),
            "mean_acceptance_length": replicas[0].confirmation["mean_acceptance_length"],
        }
    )


serve_promoted_job = dg.define_asset_job(
    "serve_promoted_drafter",
    selection=dg.AssetSelection.assets("served_drafter"),
    description="Every serving replica restarted, one at a time, with the promoted drafter.",
)


# On one node, serving's GPUs are training's: a failed step must hand them back to serving,
# never retry training while serving restarts (the runs of this chain are not retried).
NO_RETRIES = {"dagster/max_retries": "0"}


@dg.op(
    description="Stops every serving replica (EAGLE3_SERVING_RUN_DIRS): its GPUs go to training."
)
def stop_serving(context: dg.OpExecutionContext, serving: ServingReplicas) -> None:
    from eagle3_assets.lib.serving.vllm_launcher import stop

    if not serving.run_dirs:
        raise dg.Failure(
            "EAGLE3_SERVING_RUN_DIRS: expected the launcher run dirs of the serving replicas, "
            "found none: nothing to stop"
        )
    for run_dir in serving.run_dirs:
        stopped = stop(Path(run_dir))
        context.log.info(f"{run_dir}: {'stopped' if stopped else 'was not running'}")


@dg.job(
    name="retrain_on_serving_node",
    tags=NO_RETRIES,
    description="On a node whose GPUs serving holds: serving stopped, then the drafter trained, "
    "evaluated and judged (train_evaluate_promote), then serving restarted with the promoted "
    "drafter, or with the last good one if anything failed (serve_promoted_drafter).",
)
def retrain_on_serving_node():
    stop_serving()


train_evaluate_promote_job = dg.define_asset_job(
    "train_evaluate_promote",
    selection=dg.AssetSelection.assets("eagle3_drafter", "drafter_evaluation", "promoted_drafter"),
    description="The drafter trained, evaluated in vLLM and judged for promotion.",
    tags=NO_RETRIES,
)


def once_succeeded(name: str, after, then, description: str) -> dg.SensorDefinition:
    """A sensor that runs job `then` once a run of job `after` succeeded."""

    @dg.run_status_sensor(
        name=name,
        run_status=dg.DagsterRunStatus.SUCCESS,
        monitored_jobs=[after],
        request_job=then,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=description,
    )
    def sensor(context: dg.RunStatusSensorContext):
        return dg.RunRequest(run_key=context.dagster_run.run_id)

    return sensor


train_once_serving_stopped = once_succeeded(
    "train_once_serving_stopped",
    retrain_on_serving_node,
    train_evaluate_promote_job,
    "Serving stopped: train, evaluate and judge on the freed GPUs.",
)
serve_again_once_promoted = once_succeeded(
    "serve_again_once_promoted",
    train_evaluate_promote_job,
    serve_promoted_job,
    "Trained and judged: serve the promoted drafter again.",
)


@dg.run_failure_sensor(
    monitored_jobs=[retrain_on_serving_node, train_evaluate_promote_job],
    request_job=serve_promoted_job,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Stopping, training, evaluation or judging failed: serve the last good drafter "
    "again.",
)
def serve_again_after_a_failure(context: dg.RunFailureSensorContext):
    return dg.RunRequest(run_key=context.dagster_run.run_id)


def maintenance_schedule(cron: str) -> dg.ScheduleDefinition:
    """Restarts serving with a newly promoted drafter on `cron` (EAGLE3_MAINTENANCE_CRON)."""

    @dg.schedule(
        name="serving_maintenance_schedule",
        job=serve_promoted_job,
        cron_schedule=cron,
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="In the maintenance window: serve a drafter promoted since the last rollout.",
    )
    def schedule(context: dg.ScheduleEvaluationContext, serving: ServingReplicas, storage: Storage):
        if not serving.run_dirs:
            return dg.SkipReason("EAGLE3_SERVING_RUN_DIRS is unset: serving is managed outside")
        promoted = Registry(storage.path("promotion")).current()
        if promoted is None:
            return dg.SkipReason("no drafter promoted yet")
        event = context.instance.get_latest_materialization_event(dg.AssetKey("served_drafter"))
        served = event and event.asset_materialization.metadata["drafter"].value
        if served == promoted.name:
            return dg.SkipReason(f"{promoted.name} serves already")
        return dg.RunRequest(run_key=f"serve-{promoted.name}")

    return schedule

"""The promoted drafter: what serving should use, replaced only by a measurably better one."""

from pathlib import Path

import dagster as dg

from eagle3_assets.defs.evaluation.assets import FINETUNED, WARM_START, drafter_evaluation
from eagle3_assets.defs.evaluation.resources import EvaluationRecipe
from eagle3_assets.lib.evaluation.promotion import Registry, history_chart
from eagle3_assets.partitions import eager_on_checked_inputs
from eagle3_assets.resources import Storage, TargetModel

BEATS_PROMOTED = "candidate_beats_promoted"


@dg.asset(
    deps=[drafter_evaluation],
    group_name="evaluation",
    kinds={"vllm"},
    # judged once the candidate's evaluation passed its check (promotion_automation)
    automation_condition=eager_on_checked_inputs(),
    check_specs=[
        dg.AssetCheckSpec(
            BEATS_PROMOTED,
            asset="promoted_drafter",
            blocking=True,
            description="The evaluated candidate beats the promoted drafter (the hub warm start "
            "before any promotion) on every prompt set by EAGLE3_PROMOTION_MARGIN; if not, it "
            "is refused and the promoted drafter keeps serving.",
        )
    ],
)
def promoted_drafter(
    context: dg.AssetExecutionContext,
    evaluation: EvaluationRecipe,
    storage: Storage,
    target: TargetModel,
) -> dg.MaterializeResult:
    """The last evaluated candidate judged against the drafter it must beat, both measured in
    vLLM in the same evaluation on every prompt set (the fixed held-out sets and the inbox's
    newest and earlier slices). Promoted, it becomes the next version (kept with its lineage)
    and the next training's warm start; refused, the promoted drafter stays, and the check
    says why, set by set."""
    from eagle3_assets.lib.serving.vllm_launcher import serve_line

    event = context.instance.get_latest_materialization_event(dg.AssetKey("drafter_evaluation"))
    if event is None or "acceptance_by_set" not in event.asset_materialization.metadata:
        raise dg.Failure("no evaluated candidate: materialize drafter_evaluation first")
    meta = {k: v.value for k, v in event.asset_materialization.metadata.items()}
    acceptance, incumbent, lineage = meta["acceptance_by_set"], meta["incumbent"], meta["lineage"]
    registry = Registry(storage.path("promotion"))
    decision = registry.judge(
        Path(lineage["export"]),
        lineage,
        acceptance[FINETUNED],
        incumbent,
        acceptance[incumbent],
        evaluation.promotion_margin,
    )
    log = context.log.info if decision.promoted else context.log.warning
    log(f"candidate {'promoted' if decision.promoted else 'refused'}: {decision.reason}")
    current = registry.current()
    serving = Path(current.path) if current else storage.path("evaluation", "warm_start")
    return dg.MaterializeResult(
        metadata={
            "serving": current.name if current else WARM_START,
            "path": dg.MetadataValue.path(str(serving)),
            "versions": len(registry.versions()),
            "verdict": "promoted" if decision.promoted else "refused",
            "reason": decision.reason,
            "history": dg.MetadataValue.md(history_chart(registry.decisions())),
            "serve_with": serve_line(
                target.path, serving, evaluation.num_speculative_tokens, target.trust_remote_code
            ),
        },
        check_results=[
            dg.AssetCheckResult(
                check_name=BEATS_PROMOTED,
                passed=decision.promoted,
                description=decision.reason,
                metadata={
                    "against": incumbent,
                    "candidate": dg.MetadataValue.json(decision.candidate_acceptance),
                    "incumbent": dg.MetadataValue.json(decision.incumbent_acceptance),
                    "margin": decision.margin,
                },
            )
        ],
    )


def promotion_automation(running: bool) -> dg.AutomationConditionSensorDefinition:
    """Judges each evaluated candidate, on when the drafter steps are (EAGLE3_AUTOMATION). Its
    runs are retried only when their worker died: a refusal is a verdict, not a failure to
    run again."""
    return dg.AutomationConditionSensorDefinition(
        "promotion_automation",
        target=dg.AssetSelection.assets(promoted_drafter),
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING
        if running
        else dg.DefaultSensorStatus.STOPPED,
        run_tags={"dagster/retry_on_asset_or_op_failure": "false"},
        description="Requests promoted_drafter when drafter_evaluation is updated and passed its "
        "check: the candidate replaces the promoted drafter only if it beats it on every set.",
    )

"""Drafter evaluation: the warm start and the finetuned drafter, each served by real vLLM as
the target's eagle3 speculator on prompts never trained on; the numbers users decide from."""

from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg

from eagle3_assets.defs.checkpoint.assets import drafter_checkpoint
from eagle3_assets.defs.evaluation.resources import EvaluationRecipe
from eagle3_assets.defs.generation.resources import GenerationRecipe, PromptPool
from eagle3_assets.defs.serving.resources import VLLMServer
from eagle3_assets.defs.training.assets import eagle3_drafter
from eagle3_assets.lib.evaluation.promotion import Registry
from eagle3_assets.partitions import eager_on_checked_inputs
from eagle3_assets.resources import Compute, Storage, TargetModel

if TYPE_CHECKING:
    from eagle3_assets.lib.training.train_drafter import RunConfig

BEATS_WARM_START = "beats_warm_start"
WARM_START, FINETUNED = "warm start", "finetuned"
HELD_OUT = "held-out"


@dg.asset(
    deps=[eagle3_drafter, drafter_checkpoint],
    group_name="evaluation",
    kinds={"vllm"},
    pool="gpu",  # its servers need the accelerators the training used
    automation_condition=eager_on_checked_inputs(),  # acted on by drafter_automation
    check_specs=[
        dg.AssetCheckSpec(
            BEATS_WARM_START,
            asset="drafter_evaluation",
            blocking=True,
            description="The finetuned drafter is accepted more often than the warm start on "
            "the held-out prompts, and not near zero (a drafter reading the wrong layers).",
        )
    ],
)
def drafter_evaluation(
    context: dg.AssetExecutionContext,
    target: TargetModel,
    compute: Compute,
    evaluation: EvaluationRecipe,
    generation: GenerationRecipe,
    storage: Storage,
    vllm: VLLMServer,
    prompt_pool: PromptPool,
) -> dg.MaterializeResult:
    """Acceptance before (warm start) and after (finetuned) in the serving engine, the speedup
    over the target alone, and the training-time accuracy of both on held-out shards. Each
    measurement is kept as it is taken: a re-run starts servers only for what is missing.
    Prompts are rendered with the generation's chat template kwargs: the drafter is measured on
    the rendering it was trained on. With an inbox, its held-out slices are prompt sets too:
    the newest traffic's, and the earlier files' (forgetting shows there)."""
    from eagle3_assets.lib.checkpoint.drafter_io import export_for_vllm
    from eagle3_assets.lib.evaluation.evaluate import (
        BASELINE,
        COMPARISON_COLUMNS,
        Contender,
        acceptance_by_set,
        comparison_rows,
        evaluate,
        per_position_chart,
        speedup,
        verdict,
    )
    from eagle3_assets.lib.serving.vllm_launcher import serve_line
    from eagle3_assets.lib.training.train_drafter import RunConfig, trained_aux_layers

    compute.require(evaluation.serving_python, evaluation.tensor_parallel_size, "evaluation")
    finetuned, lineage = _finetuned_export(context)
    warm_start = export_for_vllm(
        storage.path("drafter", "warm_start"),
        storage.path("evaluation", "warm_start"),
        target.shape(),
    )
    inbox = prompt_pool.open_inbox(storage)
    prompt_sets = evaluation.conversations(inbox.evaluation_sets() if inbox else None)
    # the target's chat template: each evaluation server must render the prompts as it does
    tokenizer = target.tokenizer()
    context.log.info("prompt sets: " + ", ".join(f"{n} ({len(c)})" for n, c in prompt_sets.items()))
    # the drafter a candidate must beat to be promoted, measured in the same run
    promoted = Registry(storage.path("promotion")).current()
    incumbent = [Contender(promoted.name, Path(promoted.path))] if promoted else []
    measurements = evaluate(
        evaluation.launch_spec(target, storage.path("evaluation", "vllm"), vllm.served_model_name),
        [
            Contender(BASELINE, None),
            Contender(WARM_START, warm_start),
            *incumbent,
            Contender(FINETUNED, finetuned),
        ],
        prompt_sets,
        evaluation.settings(generation.config().chat_template_kwargs),
        storage.path("evaluation", "measurements"),
        tokenizer,
        api_key=vllm.api_key,
        log=context.log.info,
    )
    by = {(m.contender, m.prompt_set): m for m in measurements}
    before, after = by[(WARM_START, HELD_OUT)], by[(FINETUNED, HELD_OUT)]
    run = RunConfig.from_json(finetuned.parent / "run.json")
    trained_layers = trained_aux_layers(run)
    offline = _offline_accuracy(run, finetuned, warm_start, context)
    problem = verdict(before, after, trained_layers, evaluation.min_acceptance_rate)
    return dg.MaterializeResult(
        metadata={
            "comparison": dg.MetadataValue.table(
                [dg.TableRecord(row) for row in comparison_rows(measurements)],
                dg.TableSchema([dg.TableColumn(n, t) for n, t in COMPARISON_COLUMNS.items()]),
            ),
            "per_position_acceptance": dg.MetadataValue.md(
                per_position_chart(measurements, HELD_OUT)
            ),
            "mean_acceptance_length": round(after.acceptance.mean_length, 3),
            "acceptance_by_set": dg.MetadataValue.json(acceptance_by_set(measurements)),
            "incumbent": promoted.name if promoted else WARM_START,
            "lineage": dg.MetadataValue.json(lineage),
            "mean_acceptance_length_warm_start": round(before.acceptance.mean_length, 3),
            "acceptance_rate": round(after.acceptance_rate, 4),
            "per_position": dg.MetadataValue.json(
                [round(p, 3) for p in after.acceptance.per_position]
            ),
            "speedup": round(speedup(measurements, FINETUNED, HELD_OUT), 3),
            "output_tokens_per_s": round(after.tokens_per_s, 1),
            "heldout_prompts": after.prompts,
            "training_time_accuracy": dg.MetadataValue.md(offline),
            "export": dg.MetadataValue.path(str(finetuned)),
            "serve_with": serve_line(
                target.path,
                finetuned,
                evaluation.num_speculative_tokens,
                target.trust_remote_code,
            ),
        },
        check_results=[
            dg.AssetCheckResult(
                check_name=BEATS_WARM_START,
                passed=problem is None,
                description=problem or "beats the warm start",
                metadata={
                    "served_aux_layers": dg.MetadataValue.json(list(after.aux_layers)),
                    "trained_aux_layers": dg.MetadataValue.json(list(trained_layers)),
                    "finetuned": round(after.acceptance.mean_length, 3),
                    "warm_start": round(before.acceptance.mean_length, 3),
                    "acceptance_rate": round(after.acceptance_rate, 4),
                    "min_acceptance_rate": evaluation.min_acceptance_rate,
                },
            )
        ],
    )


def _finetuned_export(context: dg.AssetExecutionContext) -> tuple[Path, dict]:
    """The directory eagle3_drafter last exported for vLLM, and its lineage: what it learnt
    from (the batches, the warm start) and how (steps)."""
    event = context.instance.get_latest_materialization_event(dg.AssetKey("eagle3_drafter"))
    if event is None or "export" not in event.asset_materialization.metadata:
        raise dg.Failure("no exported eagle3_drafter: materialize eagle3_drafter first")
    meta = {k: v.value for k, v in event.asset_materialization.metadata.items()}
    export = Path(meta["export"])
    if not (export / "config.json").exists():
        raise dg.Failure(f"eagle3_drafter's export {export} is gone: materialize it again")
    lineage = {  # a drafter materialized before versions were kept learnt from the hub's
        "export": str(export),
        "run_id": event.run_id,
        "batches": meta["batches"].split(", ") if meta.get("batches") else [],
        "warm_start": meta.get("warm_start_version", "hub warm start"),
        "steps": meta.get("steps"),
    }
    return export, lineage


def _offline_accuracy(
    run: "RunConfig", finetuned: Path, warm_start: Path, context: dg.AssetExecutionContext
) -> str:
    """Markdown: per-position TTT accuracy of both drafters on the samples the training run
    held out, labelled as what it is."""
    from eagle3_assets.lib.training.train_drafter import LayerMismatch, heldout_accuracy

    if run.stream is not None:
        return (
            "No training-time accuracy: the hidden states were streamed, so none are stored "
            "to score on; the acceptance measured in vLLM is the measure."
        )
    try:
        rows = {
            name: heldout_accuracy(
                drafter,
                Path(run.target),
                run.batch_dirs,
                run.holdout_fraction,
                run.ttt_length,
                platform=run.platform,
            )
            for name, drafter in ((WARM_START, warm_start), (FINETUNED, finetuned))
        }
    except LayerMismatch as mismatch:
        context.log.warning(str(mismatch))
        return f"No training-time accuracy: {mismatch}"
    samples = rows[FINETUNED]["samples"]
    context.log.info(f"training-time accuracy on {samples} held-out samples: {rows}")
    if not samples:
        return (
            f"No held-out samples (holdout_fraction {run.holdout_fraction} of the training "
            "batches): no training-time accuracy."
        )
    lines = [
        f"Training-time accuracy (teacher-forced TTT on {samples} held-out samples, "
        f"{rows[FINETUNED]['tokens']} tokens), not acceptance in vLLM:",
        "",
        "| drafter | accuracy by TTT position |",
        "| --- | --- |",
    ]
    for name, row in rows.items():
        lines.append(f"| {name} | {', '.join(f'{a:.3f}' for a in row['accuracy'])} |")
    return "\n".join(lines)

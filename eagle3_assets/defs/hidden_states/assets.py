"""Hidden states: the target's states at the drafter's layers for each batch of generations."""

from typing import TYPE_CHECKING, Any

import dagster as dg

from eagle3_assets.defs.checkpoint.assets import drafter_checkpoint
from eagle3_assets.defs.generation.assets import (
    ONE_ROW_PER_PROMPT,
    RESPONSE_QUALITY,
    synthetic_generations,
)
from eagle3_assets.defs.generation.resources import GenerationRecipe
from eagle3_assets.defs.hidden_states.resources import HiddenStatesRecipe
from eagle3_assets.partitions import eager_on_checked_inputs, latest_check_statuses, sample_batches
from eagle3_assets.resources import Compute, Storage, TargetModel

if TYPE_CHECKING:  # imported where used: every multiprocess step re-imports this module
    from eagle3_assets.lib.hidden_states.extract import BatchVerification
    from eagle3_assets.lib.hidden_states.token_sequences import TokenSequence

COMPLETE = "manifest_complete"
FINITE = "values_finite"
TOKENS_MATCH = "token_ids_match_generations"
LOSS_FRACTION = "loss_mask_fraction"
CHECKS = (COMPLETE, FINITE, TOKENS_MATCH, LOSS_FRACTION)
# what to fix before re-materializing a batch that failed each check (named in refusals)
FIXES = {
    COMPLETE: "finding why shards are missing or fail their sha256 (disk full, a concurrent "
    "writer)",
    FINITE: "fixing the NaN/Inf states (the extraction dtype, EAGLE3_EXTRACT_DTYPE, or the "
    "target's weights)",
    TOKENS_MATCH: "re-materializing synthetic_generations of that batch (the stored token ids "
    "differ from the generation's)",
    LOSS_FRACTION: "checking the chat template and EAGLE3_CHAT_TEMPLATE_KWARGS (a loss mask "
    "that is empty or everything)",
}


@dg.asset(
    partitions_def=sample_batches,
    deps=[synthetic_generations, drafter_checkpoint],
    group_name="hidden_states",
    kinds={"pytorch", "safetensors"},
    pool="gpu",
    automation_condition=eager_on_checked_inputs(),  # acted on by drafter_automation
    backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=1),
    # one result per batch (partitioned), so a later batch's pass never hides this one's failure
    check_specs=[
        dg.AssetCheckSpec(name, asset="hidden_states", blocking=True, partitions_def=sample_batches)
        for name in CHECKS
    ],
)
def hidden_states(
    context: dg.AssetExecutionContext,
    target: TargetModel,
    compute: Compute,
    generation: GenerationRecipe,
    hidden: HiddenStatesRecipe,
    storage: Storage,
) -> dg.MaterializeResult:
    """The batch's sequences exactly as the target saw them, with the aux states at the
    drafter's layers and the final state where the drafter is trained, in compact shards. A
    re-run keeps every finished shard; a batch that cannot fit fails before any forward."""
    from eagle3_assets.lib.hidden_states.backends import drafter_layers, open_backend
    from eagle3_assets.lib.hidden_states.extract import extract_batch, human_bytes, verify_batch
    from eagle3_assets.lib.hidden_states.shard_format import KIMI_AUX_LAYERS, KIMI_HIDDEN_SIZE

    key = context.partition_key
    settings = hidden.extraction()  # a bad setting fails here, before any reading
    _refuse_failed_generations(context.instance, key)
    rows, sequences = batch_sequences(key, target, generation, hidden, storage)
    template_kwargs = generation.config().chat_template_kwargs or {}
    shape = target.shape()
    try:
        layers = drafter_layers(storage.path("drafter", "warm_start"), shape.num_hidden_layers)
    except FileNotFoundError as missing:
        raise dg.Failure(str(missing)) from None
    context.log.info(
        f"{key}: {len(sequences)} samples; layers {list(layers.aux)} + final {layers.final} "
        f"(vLLM ids, from {layers.source}); {hidden.format} via {hidden.backend}"
    )
    out_dir = storage.path("hidden_states", key)
    summary = extract_batch(
        sequences,
        out_dir,
        lambda: open_backend(
            hidden,
            compute.platform,
            target.path,
            target.trust_remote_code,
            layers.ids,
            shape.hidden_size,
            storage.path("vllm-extraction"),
            context.log.info,
        ),
        layers,
        shape.hidden_size,
        settings,
        {
            "target": target.path,
            "revision": target.revision,
            "backend": hidden.backend,
            "dtype": hidden.dtype,
            "chat_template_kwargs": template_kwargs,
        },
        progress=context.log.info,
    )
    expected = {r["sample_id"]: [*r["prompt_token_ids"], *r["token_ids"]] for r in rows}
    verification = verify_batch(out_dir, expected)
    fmt = settings.format
    teacher_share = summary.teacher_positions / max(summary.tokens, 1)
    kimi_bytes = fmt.bytes_per_token(KIMI_HIDDEN_SIZE, KIMI_AUX_LAYERS, teacher_share)
    return dg.MaterializeResult(
        metadata={
            "path": dg.MetadataValue.path(str(out_dir)),
            "format": fmt.name,
            "backend": hidden.backend,
            "samples": summary.samples,
            "tokens": summary.tokens,
            "teacher_positions": summary.teacher_positions,
            "truncated": sum(s.truncated for s in sequences),
            "bytes": summary.bytes,
            "size": human_bytes(summary.bytes),
            "bytes_per_token": round(summary.bytes / max(summary.tokens, 1), 1),
            "kimi_k2_5_bytes_per_token": round(kimi_bytes),
            "shards": summary.shards,
            "reused_shards": summary.reused_shards,
            "extracted_tokens": summary.extracted_tokens,
            "tokens_per_s": round(summary.tokens_per_s, 1),
            "seconds": round(summary.seconds, 1),
            "aux_layer_ids_vllm": dg.MetadataValue.json(list(layers.aux)),
            "final_layer_id_vllm": layers.final,
        },
        check_results=_checks(verification, hidden),
    )


def batch_sequences(
    key: str,
    target: TargetModel,
    generation: GenerationRecipe,
    hidden: HiddenStatesRecipe,
    storage: Storage,
    tokenizer: Any = None,
) -> tuple[list[dict], list["TokenSequence"]]:
    """A batch's generation rows and its token sequences exactly as the target saw them: what
    extraction stores and a streamed run extracts (`tokenizer`: the target's, loaded once for
    many batches). A prompt the local template renders other than the server did is a Failure
    naming both renderings and what to fix."""
    import pyarrow.parquet as pq

    from eagle3_assets.lib.generation.store import FINAL_NAME
    from eagle3_assets.lib.hidden_states.token_sequences import (
        TemplateMismatchError,
        build_sequences,
    )

    generations = storage.path("generations", key, FINAL_NAME)
    if not generations.exists():
        raise dg.Failure(f"{key}: no {generations}; materialize synthetic_generations[{key}] first")
    rows = pq.read_table(generations).to_pylist()
    template_kwargs = generation.config().chat_template_kwargs or {}
    try:
        tokenizer = tokenizer or target.tokenizer()
        return rows, build_sequences(rows, tokenizer, template_kwargs, hidden.max_length)
    except TemplateMismatchError as mismatch:
        raise dg.Failure(
            f"{key}: {mismatch}\nFix: EAGLE3_CHAT_TEMPLATE_KWARGS must be the kwargs this "
            f"batch was generated with (re-materialize synthetic_generations[{key}] after "
            f"changing them), and EAGLE3_TARGET_PATH ({target.path}) must hold the tokenizer "
            "and chat template the generation's vLLM served (no --chat-template override).",
            metadata={"mismatched_prompts": len(mismatch.mismatches), "prompts": mismatch.total},
        ) from None


def _refuse_failed_generations(instance: dg.DagsterInstance, key: str) -> None:
    """Never extract a batch of generations whose latest blocking checks did not pass: the
    failed run stopped, but its rows stayed on disk."""
    from eagle3_assets.lib.hidden_states.batch_selection import select_batches

    checks = (ONE_ROW_PER_PROMPT, RESPONSE_QUALITY)
    statuses = latest_check_statuses(instance, "synthetic_generations", checks, [key])
    for excluded in select_batches(statuses, [key]).excluded:
        raise dg.Failure(
            f"{excluded.message('synthetic_generations', {})}, then hidden_states[{key}]",
            metadata={"batch": key, **excluded.problems},
        )


def _checks(result: "BatchVerification", recipe: HiddenStatesRecipe) -> list[dg.AssetCheckResult]:
    """Blocking: training must never read a partial batch, NaNs, other tokens than the
    target generated, or a mask that is empty or everything (a template bug)."""
    fraction = result.loss_fraction
    return [
        dg.AssetCheckResult(
            check_name=COMPLETE,
            passed=not (result.missing_samples or result.unexpected_samples or result.bad_shards),
            metadata={
                "missing_samples": len(result.missing_samples),
                "unexpected_samples": len(result.unexpected_samples),
                "bad_shards": ", ".join(result.bad_shards) or "none",
            },
        ),
        dg.AssetCheckResult(
            check_name=FINITE,
            passed=result.nonfinite == 0,
            metadata={"nonfinite": result.nonfinite},
        ),
        dg.AssetCheckResult(
            check_name=TOKENS_MATCH,
            passed=not result.token_mismatches,
            metadata={
                "mismatched_samples": len(result.token_mismatches),
                "examples": ", ".join(result.token_mismatches[:5]) or "none",
            },
        ),
        dg.AssetCheckResult(
            check_name=LOSS_FRACTION,
            passed=recipe.min_loss_fraction <= fraction <= recipe.max_loss_fraction,
            metadata={
                "loss_fraction": round(fraction, 4),
                "bounds": f"[{recipe.min_loss_fraction}, {recipe.max_loss_fraction}]",
                "samples_without_loss": result.samples_without_loss,
            },
        ),
    ]

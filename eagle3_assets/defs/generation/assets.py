"""Synthetic generations: the target's own answers to the prompt pool, one batch a partition."""

import json

import dagster as dg

from eagle3_assets.defs.generation.resources import GenerationRecipe, PromptPool
from eagle3_assets.defs.serving.assets import vllm_server
from eagle3_assets.defs.serving.resources import VLLMServer
from eagle3_assets.partitions import sample_batches
from eagle3_assets.resources import Storage

ONE_ROW_PER_PROMPT = "one_row_per_prompt"
RESPONSE_QUALITY = "response_quality"


@dg.asset(
    partitions_def=sample_batches,
    deps=[vllm_server],
    group_name="generation",
    kinds={"vllm", "parquet"},
    pool="vllm",  # batch runs share the server instead of flooding it
    backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=1),
    check_specs=[  # per batch: a later batch's pass must not hide this one's failure
        dg.AssetCheckSpec(
            name, asset="synthetic_generations", blocking=True, partitions_def=sample_batches
        )
        for name in (ONE_ROW_PER_PROMPT, RESPONSE_QUALITY)
    ],
)
def synthetic_generations(
    context: dg.AssetExecutionContext,
    vllm: VLLMServer,
    prompt_pool: PromptPool,
    generation: GenerationRecipe,
    storage: Storage,
) -> dg.MaterializeResult:
    """The batch's conversations answered by the served target. Completed rows persist as they
    finish, so a crash or cancel loses only requests in flight and a re-run sends only what is
    missing; the final Parquet appears only when every prompt has its row."""
    import pyarrow.parquet as pq

    from eagle3_assets.lib.generation.batch import run_batch

    batch = prompt_pool.batch(context.partition_key, storage)
    context.log.info(f"{context.partition_key}: {len(batch)} prompts from {prompt_pool.describe()}")
    summary = run_batch(
        batch,
        storage.path("generations", context.partition_key),
        vllm.base_urls,
        vllm.served_model_name,
        generation.config(),
        api_key=vllm.api_key,
        progress=lambda report: context.log.info(str(report)),
    )
    if summary.failed:
        examples = "; ".join(f"{p}: {e}" for p, e in list(summary.failures.items())[:3])
        raise dg.Failure(
            f"{summary.failed} of {summary.total} samples failed after retries (kept: "
            f"{summary.total - summary.failed}; a re-run requests only the failed): {examples}"
        )
    table = pq.read_table(summary.final_path, columns=["prompt_id", "response", "finish_reason"])
    return dg.MaterializeResult(
        metadata={
            "path": dg.MetadataValue.path(str(summary.final_path)),
            "samples": summary.total,
            "resumed": summary.resumed,
            "requested": summary.requested,
            "prompt_tokens": summary.prompt_tokens,
            "completion_tokens": summary.completion_tokens,
            "seconds": round(summary.seconds, 1),
            "requests_per_s": round(summary.requests_per_s, 2),
            "output_tokens_per_s": round(summary.output_tokens_per_s, 1),
            "errors": summary.errors,
            "retries": summary.retries,
            "finish_reasons": dg.MetadataValue.json(summary.finish_reasons),
            "model": vllm.served_model_name,
            "recipe": dg.MetadataValue.json(json.loads(generation.model_dump_json())),
        },
        check_results=_checks(table, [c.prompt_id for c in batch], generation),
    )


def _checks(table, expected_ids: list[str], recipe: GenerationRecipe) -> list[dg.AssetCheckResult]:
    """Blocking: a batch with missing, duplicated, empty or mostly-truncated answers stops here
    instead of flowing into hidden states and training."""
    ids = table.column("prompt_id").to_pylist()
    duplicates = len(ids) - len(set(ids))
    missing = len(set(expected_ids) - set(ids))
    extra = len(set(ids) - set(expected_ids))
    rows = max(len(ids), 1)
    empty = sum(1 for r in table.column("response").to_pylist() if not (r or "").strip()) / rows
    truncated = table.column("finish_reason").to_pylist().count("length") / rows
    return [
        dg.AssetCheckResult(
            check_name=ONE_ROW_PER_PROMPT,
            passed=duplicates == missing == extra == 0,
            metadata={
                "rows": len(ids),
                "duplicates": duplicates,
                "missing": missing,
                "unexpected": extra,
            },
        ),
        dg.AssetCheckResult(
            check_name=RESPONSE_QUALITY,
            passed=empty <= recipe.max_empty_rate and truncated <= recipe.max_truncated_rate,
            metadata={
                "empty_rate": round(empty, 4),
                "truncated_rate": round(truncated, 4),
                "max_empty_rate": recipe.max_empty_rate,
                "max_truncated_rate": recipe.max_truncated_rate,
            },
        ),
    ]

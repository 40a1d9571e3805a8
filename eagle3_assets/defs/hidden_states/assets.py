"""Hidden states: the target's states at the drafter's layers for each batch of generations."""

import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg

from eagle3_assets.defs.checkpoint.assets import drafter_checkpoint
from eagle3_assets.defs.generation.assets import synthetic_generations
from eagle3_assets.partitions import sample_batches
from eagle3_assets.resources import GenerationRecipe, HiddenStatesRecipe, Storage, TargetModel

if TYPE_CHECKING:  # imported where used: every multiprocess step re-imports this module
    from eagle3_assets.lib.hidden_states.extract import BatchVerification, LayerSelection

COMPLETE = "manifest_complete"
FINITE = "values_finite"
TOKENS_MATCH = "token_ids_match_generations"
LOSS_FRACTION = "loss_mask_fraction"


@dg.asset(
    partitions_def=sample_batches,
    deps=[synthetic_generations, drafter_checkpoint],
    group_name="hidden_states",
    kinds={"pytorch", "safetensors"},
    pool="gpu",
    automation_condition=dg.AutomationCondition.eager(),  # acted on by drafter_automation
    backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=1),
    check_specs=[
        dg.AssetCheckSpec(name, asset="hidden_states", blocking=True)
        for name in (COMPLETE, FINITE, TOKENS_MATCH, LOSS_FRACTION)
    ],
)
def hidden_states(
    context: dg.AssetExecutionContext,
    target: TargetModel,
    generation: GenerationRecipe,
    hidden: HiddenStatesRecipe,
    storage: Storage,
) -> dg.MaterializeResult:
    """The batch's sequences exactly as the target saw them, with the aux states at the
    drafter's layers and the final state where the drafter is trained, in compact shards. A
    re-run keeps every finished shard; a batch that cannot fit fails before any forward."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from eagle3_assets.lib.generation.store import FINAL_NAME
    from eagle3_assets.lib.hidden_states.extract import extract_batch, human_bytes, verify_batch
    from eagle3_assets.lib.hidden_states.shard_format import KIMI_AUX_LAYERS, KIMI_HIDDEN_SIZE
    from eagle3_assets.lib.hidden_states.token_sequences import build_sequences

    key = context.partition_key
    settings = hidden.settings()  # a bad setting fails here, before any reading
    generations = storage.path("generations", key, FINAL_NAME)
    if not generations.exists():
        raise dg.Failure(f"{key}: no {generations}; materialize synthetic_generations[{key}] first")
    rows = pq.read_table(generations).to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(
        target.path, trust_remote_code=target.trust_remote_code
    )
    template_kwargs = generation.config().chat_template_kwargs or {}
    sequences, mismatches = build_sequences(rows, tokenizer, template_kwargs, hidden.max_length)
    if mismatches:
        context.log.warning(
            f"{len(mismatches)} of {len(rows)} prompts render differently here than in vLLM "
            f"(stored as vLLM saw them; check EAGLE3_CHAT_TEMPLATE_KWARGS): {mismatches[0]}"
        )
    shape = target.shape()
    layers = _drafter_layers(storage.path("drafter", "warm_start"), shape.num_hidden_layers)
    context.log.info(
        f"{key}: {len(sequences)} samples; layers {list(layers.aux)} + final {layers.final} "
        f"(vLLM ids, from {layers.source}); {hidden.format} via {hidden.backend}"
    )
    out_dir = storage.path("hidden_states", key)
    summary = extract_batch(
        sequences,
        out_dir,
        lambda: _open_source(target, hidden, layers.ids, shape.hidden_size, storage),
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
            "aux_layer_ids_vllm": str(list(layers.aux)),
            "final_layer_id_vllm": layers.final,
            "template_mismatches": len(mismatches),
        },
        check_results=_checks(verification, hidden),
    )


def _drafter_layers(drafter_dir: Path, num_layers: int) -> "LayerSelection":
    """The warm-start drafter's aux ids (either convention, declared by its config)."""
    from eagle3_assets.lib.core.layer_ids import aux_layer_ids
    from eagle3_assets.lib.hidden_states.extract import LayerSelection

    config = drafter_dir / "config.json"
    if not config.exists():
        raise dg.Failure(f"no {config}: materialize drafter_checkpoint first")
    ids = aux_layer_ids(json.loads(config.read_text()), num_layers)
    return LayerSelection(aux=ids.fc_order, final=num_layers, source=str(ids.source))


def _open_source(
    target: TargetModel,
    hidden: HiddenStatesRecipe,
    layer_ids: tuple[int, ...],
    hidden_size: int,
    storage: Storage,
) -> AbstractContextManager:
    """The configured backend, loaded only when a shard is missing."""
    if hidden.backend == "hf":
        from eagle3_assets.lib.hidden_states.hf_backend import HFTarget

        return HFTarget(
            Path(target.path), layer_ids, hidden.dtype, hidden.device, target.trust_remote_code
        )
    from eagle3_assets.lib.hidden_states.hf_backend import resolve_device
    from eagle3_assets.lib.hidden_states.vllm_backend import extraction_server
    from eagle3_assets.lib.serving.vllm_launcher import VLLMLaunchSpec

    cpu = resolve_device(hidden.device) == "cpu"
    serving = VLLMLaunchSpec(
        model=target.path,
        python=Path(hidden.serving_python),
        run_dir=storage.path("vllm-extraction"),
        port=hidden.vllm_port,
        tensor_parallel_size=hidden.vllm_tensor_parallel_size,
        max_model_len=hidden.max_length + 1,
        dtype=hidden.dtype,
        trust_remote_code=target.trust_remote_code,
        cpu_kvcache_gib=1 if cpu else None,
        extra_args=tuple(hidden.vllm_args),
    )
    return extraction_server(serving, layer_ids, hidden_size, cpu, hidden.vllm_load_timeout_s)


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

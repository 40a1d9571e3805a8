"""The serving side as assets: the server itself (observed, never materialized by us) and
the target as it is actually served."""

import dagster as dg

from eagle3_assets.defs.serving.resources import VLLMServer

vllm_server = dg.AssetSpec(
    "vllm_server",
    description=(
        "The target LLM served by vLLM, started outside Dagster (a 22-minute load must not be "
        "tied to a run). The readiness sensor records an observation at every state change."
    ),
    group_name="serving",
    kinds={"vllm"},
)

SMOKE_PROMPT = [{"role": "user", "content": "Explain the assignment statement in one sentence."}]


@dg.asset(deps=[vllm_server], group_name="serving", kinds={"vllm"}, pool="vllm")
def served_target(context: dg.AssetExecutionContext, vllm: VLLMServer) -> dg.MaterializeResult:
    """Each replica generates with the expected model, not merely answers /health."""
    replicas = []
    for base_url in vllm.base_urls:
        seen = vllm.probe(base_url)
        if not seen.healthy or vllm.served_model_name not in seen.model_ids:
            raise dg.Failure(
                f"{base_url} does not serve {vllm.served_model_name!r}: "
                f"health={seen.health_status}, models={list(seen.model_ids)}, {seen.error or ''}"
            )
        reply = vllm.smoke_chat(base_url, SMOKE_PROMPT, max_tokens=32)
        if reply["completion_tokens"] < 1:
            raise dg.Failure(f"{base_url} generated no tokens for the smoke prompt")
        context.log.info(
            f"{base_url}: {reply['completion_tokens']} tokens in "
            f"{reply['latency_s']:.2f}s: {reply['text'][:120]!r}"
        )
        replicas.append((base_url, seen, reply))
    _, seen, reply = replicas[0]
    return dg.MaterializeResult(
        metadata={
            "model": vllm.served_model_name,
            "replicas": len(replicas),
            "base_urls": ", ".join(url for url, _, _ in replicas),
            "max_model_len": seen.max_model_len,
            "vllm_version": seen.version or "unknown",
            "smoke_latency_s": dg.FloatMetadataValue(round(reply["latency_s"], 3)),
            "smoke_completion_tokens": reply["completion_tokens"],
            "smoke_finish_reason": reply["finish_reason"] or "",
            "smoke_text": dg.MetadataValue.md(f"> {reply['text']}"),
        }
    )

"""Drafters measured where they will run: each served by vLLM as the target's eagle3
speculator, one server at a time, the same prompts greedy through the chat template, with a
plain server (no drafter) as the throughput baseline. Numbers come from /metrics deltas
(lib/evaluation/acceptance.py).

Prompts are rendered as the drafter's training data was: every request carries the
generation's `chat_template_kwargs` (Kimi: `{"thinking": false}`), and before measuring, each
server's rendering of every prompt is checked against the local chat template with those
kwargs, the check extraction makes against the generation server (lib/evaluation/rendering.py);
another rendering is another distribution.

A measurement is saved as soon as it is taken, keyed by what decides it (the drafter's bytes,
the server command, the prompts, the settings, the template kwargs among them): a crashed
evaluation re-measures only what is missing, and neither a changed drafter nor another
rendering is mistaken for the old one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_assets.lib.core.atomic_files import file_hashes, write_atomically
from eagle3_assets.lib.core.charts import line_chart_svg, markdown_image
from eagle3_assets.lib.core.layer_ids import KEY
from eagle3_assets.lib.evaluation.acceptance import Acceptance, measure_acceptance
from eagle3_assets.lib.evaluation.rendering import check_served_rendering
from eagle3_assets.lib.evaluation.settings import EvaluationSettings
from eagle3_assets.lib.serving.vllm_launcher import (
    VLLMLaunchSpec,
    build_command,
    start,
    stop,
    wait_ready,
    with_eagle3_drafter,
)
from eagle3_assets.lib.serving.vllm_probe import smoke_chat

BASELINE = "without drafter"
# vLLM's own word on what it feeds the drafter (0.32's model runner logs it at load)
AUX_LAYERS_LINE = re.compile(r"Using auxiliary layers from [\w ]+: \(([\d, ]+)\)")


@dataclass(frozen=True)
class Contender:
    """A server to measure: the target alone (drafter None) or with an exported drafter."""

    name: str
    drafter: Path | None


@dataclass(frozen=True)
class Measurement:
    contender: str
    prompt_set: str
    prompts: int
    acceptance: Acceptance
    aux_layers: tuple[int, ...] | None = None  # fed to the drafter; None: no drafter

    @property
    def tokens_per_s(self) -> float:
        seconds = self.acceptance.seconds
        return self.acceptance.output_tokens / seconds if seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per proposed draft token."""
        drafted = self.acceptance.draft_tokens
        return self.acceptance.accepted / drafted if drafted else 0.0


def evaluate(
    spec: VLLMLaunchSpec,
    contenders: Sequence[Contender],
    prompt_sets: dict[str, list[list[dict]]],
    settings: EvaluationSettings,
    results_dir: Path,
    tokenizer: Any,
    api_key: str | None = None,
    log: Callable[[str], None] = print,
) -> list[Measurement]:
    """Every contender on every prompt set; a server starts only for what is not saved yet.
    `tokenizer` is the target's, whose chat template the training data was rendered with."""
    results_dir.mkdir(parents=True, exist_ok=True)
    measurements = []
    for contender in contenders:
        served = serving_spec(spec, contender, settings)
        drafter = file_hashes(contender.drafter) if contender.drafter else None  # once: GBs
        files = {
            name: results_dir / f"{_key(served, drafter, conversations, settings)}.json"
            for name, conversations in prompt_sets.items()
        }
        todo = [name for name, path in files.items() if not path.exists()]
        if todo:
            todo_sets = {n: prompt_sets[n] for n in todo}
            _measure_on_new_server(
                served, contender, todo_sets, settings, files, tokenizer, api_key, log
            )
        else:
            log(f"{contender.name}: every prompt set measured before, reusing {results_dir}")
        measurements += [_load(files[name], contender.name, name) for name in prompt_sets]
    return measurements


def serving_spec(
    spec: VLLMLaunchSpec, contender: Contender, settings: EvaluationSettings
) -> VLLMLaunchSpec:
    """The launch spec of one contender: its own run directory, its drafter if any."""
    run_dir = spec.run_dir / contender.name.replace(" ", "-")
    served = dataclasses.replace(spec, run_dir=run_dir)
    if contender.drafter is None:
        return served
    return with_eagle3_drafter(served, contender.drafter, settings.num_speculative_tokens)


def _measure_on_new_server(
    spec: VLLMLaunchSpec,
    contender: Contender,
    prompt_sets: dict[str, list[list[dict]]],
    settings: EvaluationSettings,
    files: dict[str, Path],
    tokenizer: Any,
    api_key: str | None,
    log: Callable[[str], None],
) -> None:
    log(f"{contender.name}: starting vLLM at {spec.base_url} (log: {spec.log_file})")
    start(spec, log)  # a killed attempt's server in spec.run_dir: reused or replaced
    try:
        loaded = wait_ready(spec, settings.load_timeout_s)
        model = spec.served_model_name or spec.model
        first = next(iter(prompt_sets.values()))[0]
        kwargs = settings.chat_template_kwargs
        check_served_rendering(spec.base_url, model, prompt_sets, tokenizer, kwargs, api_key)
        smoke_chat(spec.base_url, model, first, 8, 600.0, api_key, kwargs)  # warm-up, not counted
        layers = served_aux_layers(spec.log_file, contender.drafter) if contender.drafter else None
        log(f"{contender.name}: ready in {loaded:.0f}s, vLLM feeds the drafter layers {layers}")
        for name, conversations in prompt_sets.items():
            counted = measure_acceptance(
                spec.base_url,
                model,
                conversations,
                settings.max_tokens,
                settings.concurrency,
                api_key,
                kwargs,
            )
            measured = Measurement(contender.name, name, len(conversations), counted, layers)
            record = {
                "prompts": measured.prompts,
                "acceptance": dataclasses.asdict(counted),
                "aux_layers": layers,
            }
            write_atomically(files[name], json.dumps(record).encode())
            log(
                f"{contender.name} on {name} ({len(conversations)} prompts): mean acceptance "
                f"length {counted.mean_length:.3f}, {measured.tokens_per_s:.1f} output tokens/s"
            )
    finally:
        stop(spec.run_dir, grace_s=30)


def _key(
    spec: VLLMLaunchSpec,
    drafter: dict[str, str] | None,
    conversations: list[list[dict]],
    settings: EvaluationSettings,
) -> str:
    """What decides a measurement: the server command, the drafter's bytes (not where they
    lie: a promoted copy of a measured drafter is measured already), the prompts and the
    settings (the chat template kwargs that render the prompts among them)."""
    speculative = spec.speculative_config and {**spec.speculative_config, "model": "<drafter>"}
    unplaced = dataclasses.replace(
        spec, port=0, run_dir=Path("."), speculative_config=speculative or None
    )
    decided_by = {
        "command": build_command(unplaced),
        "drafter": drafter,
        "prompts": conversations,
        "settings": settings.model_dump(),
    }
    return hashlib.sha256(json.dumps(decided_by, sort_keys=True).encode()).hexdigest()[:16]


def _load(path: Path, contender: str, prompt_set: str) -> Measurement:
    record = json.loads(path.read_text())
    layers = tuple(record["aux_layers"]) if record["aux_layers"] is not None else None
    return Measurement(
        contender, prompt_set, record["prompts"], Acceptance(**record["acceptance"]), layers
    )


def served_aux_layers(log_file: Path, drafter: Path) -> tuple[int, ...]:
    """The aux layers the last server start in `log_file` says it feeds the drafter; where a
    vLLM does not say, the only ids it reads: the drafter config's top-level ones."""
    found = AUX_LAYERS_LINE.findall(log_file.read_text(errors="replace"))
    if found:
        return tuple(int(i) for i in found[-1].split(",") if i.strip())
    return tuple(json.loads((drafter / "config.json").read_text())[KEY])


def acceptance_by_set(measurements: Sequence[Measurement]) -> dict[str, dict[str, float]]:
    """contender -> prompt set -> mean acceptance length, for every drafter measured."""
    table: dict[str, dict[str, float]] = {}
    for m in measurements:
        if m.contender != BASELINE:
            table.setdefault(m.contender, {})[m.prompt_set] = round(m.acceptance.mean_length, 3)
    return table


def speedup(measurements: Sequence[Measurement], contender: str, prompt_set: str) -> float:
    """Output tokens/s with the contender over without any drafter, on one prompt set."""
    by = {(m.contender, m.prompt_set): m for m in measurements}
    baseline = by[(BASELINE, prompt_set)].tokens_per_s
    return by[(contender, prompt_set)].tokens_per_s / baseline if baseline else 0.0


COMPARISON_COLUMNS = {  # column: type, as Dagster's TableSchema names types
    "prompt set": "string",
    "server": "string",
    "prompts": "int",
    "mean acceptance length": "float",
    "acceptance rate": "float",
    "per position": "string",
    "output tokens/s": "float",
    "speedup": "float",
}


def comparison_rows(measurements: Sequence[Measurement]) -> list[dict[str, Any]]:
    """One row per prompt set and server (COMPARISON_COLUMNS), rounded to the digits shown;
    no acceptance rate (None) and no per-position rates ("") without a drafter."""
    rows = []
    for m in sorted(measurements, key=lambda m: m.prompt_set):
        drafted = m.contender != BASELINE
        rows.append(
            {
                "prompt set": m.prompt_set,
                "server": m.contender,
                "prompts": m.prompts,
                "mean acceptance length": round(m.acceptance.mean_length, 3),
                "acceptance rate": round(m.acceptance_rate, 3) if drafted else None,
                "per position": ", ".join(f"{p:.3f}" for p in m.acceptance.per_position),
                "output tokens/s": round(m.tokens_per_s, 1),
                "speedup": round(speedup(measurements, m.contender, m.prompt_set), 2),
            }
        )
    return rows


def comparison_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown of comparison_rows, for a terminal: before vs after at a glance."""
    lines = [
        "| " + " | ".join(COMPARISON_COLUMNS) + " |",
        "| " + " | ".join("---" for _ in COMPARISON_COLUMNS) + " |",
    ]
    for row in rows:
        rate = row["acceptance rate"]
        lines.append(
            f"| {row['prompt set']} | {row['server']} | {row['prompts']} | "
            f"{row['mean acceptance length']:.3f} | {'-' if rate is None else f'{rate:.3f}'} | "
            f"{row['per position'] or '-'} | {row['output tokens/s']:.1f} | "
            f"{row['speedup']:.2f}x |"
        )
    return "\n".join(lines)


def per_position_chart(measurements: Sequence[Measurement], prompt_set: str) -> str:
    """Markdown image: acceptance at each draft position, one line per drafter."""
    series = {
        m.contender: m.acceptance.per_position
        for m in measurements
        if m.prompt_set == prompt_set and m.contender != BASELINE
    }
    return markdown_image(
        line_chart_svg(f"acceptance by draft position ({prompt_set})", series),
        f"per-position acceptance on {prompt_set}",
    )


def verdict(
    warm_start: Measurement,
    finetuned: Measurement,
    trained_layers: tuple[int, ...],
    min_rate: float,
) -> str | None:
    """Why the finetuned drafter must not ship, or None. vLLM must feed it the layers it was
    trained on (elsewhere it can still draft, badly: on a big target acceptance collapses
    towards zero, on a tiny one it may hardly show), it must draft, and beat the warm start."""
    if finetuned.aux_layers is not None and finetuned.aux_layers != tuple(trained_layers):
        return (
            f"vLLM feeds the drafter target layers {list(finetuned.aux_layers)}, it was trained "
            f"on {list(trained_layers)} (vLLM ids): fix eagle_aux_hidden_state_layer_ids"
        )
    if finetuned.acceptance.drafts == 0:
        return "vLLM counted no drafts: the server did not speculate with the drafter"
    if finetuned.acceptance_rate < min_rate:
        return (
            f"acceptance rate {finetuned.acceptance_rate:.3f} is below {min_rate}: near zero, "
            "as when the drafter reads other layers than it was trained on"
        )
    if finetuned.acceptance.mean_length <= warm_start.acceptance.mean_length:
        return (
            f"mean acceptance length {finetuned.acceptance.mean_length:.3f} does not beat the "
            f"warm start's {warm_start.acceptance.mean_length:.3f}"
        )
    return None

"""Which layers a warm start reads, measured when its config cannot say, then pinned.

A SpecForge config nests its aux ids in `eagle_config`, in SGLang convention by SpecForge's
own rule; but AQ-MedAI/Kimi-K2-Instruct-eagle3 nests [2, 30, 58], which is also exactly vLLM's
default for 61 layers, so it may be vLLM ids. Read one way the drafter is fed [3, 31, 59],
the other [2, 30, 58]; only the weights know which they were trained on. So when both
readings are valid for the target and differ (`layer_ids.nested_readings`), the served target
answers a few held-out prompts, their states are extracted at the union of both readings'
layers, and the drafter is measured both ways on the same samples: how near rest its weights
are (`lib/training/stationarity.py`: training leaves a drafter at a stationary point of its
loss for the layers it learnt on, and nowhere else), and, for the user, its teacher-forced
loss and accuracy (`train_drafter.heldout_accuracy`). The reading clearly nearer rest, by a
jackknife test over the samples (`CLEARLY_BETTER`), wins; when neither is, the user must say
(EAGLE3_AUX_LAYER_IDS) instead of the pipeline guessing. The loss does not decide: later
layers carry more about the next token, so it leans towards the later reading whichever the
drafter learnt on.

Whatever decides the ids (the probe or the user), they are pinned in the downloaded config:
top-level ids in vLLM convention, the nested list rewritten consistently, the published
nested list kept in `PIN_FIELD`. Every reader (drafter_io, extraction, training, export,
vLLM itself) then sees the same layers.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_assets.lib.core.atomic_files import write_atomically
from eagle3_assets.lib.core.layer_ids import (
    KEY,
    AuxLayerIds,
    Reading,
    check_layer_ids,
    fc_order,
    nested_readings,
    vllm_to_sglang,
)
from eagle3_assets.lib.core.target import TargetShape
from eagle3_assets.lib.training.stationarity import Stationarity

if TYPE_CHECKING:  # torch, pyarrow: imported where used
    from contextlib import AbstractContextManager

    from eagle3_assets.lib.generation.conversations import Conversation
    from eagle3_assets.lib.generation.settings import GenerationConfig
    from eagle3_assets.lib.hidden_states.extract import ExtractionSettings, StateSource

PROBE_TTT_STEPS = 3  # accuracy recorded for the user; the choice reads step 0 alone
PROBE_VERSION = 3  # part of probe_key: scores an older probe measured are measured again
PIN_FIELD = "eagle3_assets_aux_layer_ids"  # config.json: how the top-level ids were decided
OVERRIDE_VARIABLE = "EAGLE3_AUX_LAYER_IDS"


@dataclass(frozen=True)
class Clearly:
    """When one reading is "clearly" better than the other: on the same probe samples, the
    drafter is nearer rest read that way by at least `t` jackknife standard errors of the
    difference, over at least `min_samples` samples, and it predicts at all there (its step-0
    loss below ln(draft vocab), a uniform guess's)."""

    t: float
    min_samples: int


# Why stationarity and a jackknife, not a loss or accuracy margin: reading a real Kimi-K2.5
# drafter one layer off costs ~0.10 acceptance length (SGLang PR #25454), a step-0 accuracy
# gap of a few hundredths, and in the Kimi test world the loss gap (a paired t over samples)
# leaned towards the later reading: drafters trained on the SGLang (later) reading scored
# t 2.8 to 5.2 its way, those trained on the vLLM reading only 0.5 to 2.4 (and -0.4, the
# wrong way, on another CPU's build), so a rule on the loss pinned the first and refused the
# second.
# Measured on the same world, whitened stationarity, t for the reading each drafter was
# trained on, over 11 recipes (steps, batch, draft vocab, training answers, weight decay) and
# both CPU builds of the world: SGLang-trained 2.0 to 9.3 (10 of 11 pinned), vLLM-trained -1.0
# to 4.9 (5 of 11 pinned, none misread); the published world drafter's 100 steps, 2.28 and
# -1.09. The earlier reading is the hard one: read one layer later, a drafter is only a little
# farther from rest; read one layer earlier, far from it (AVX2 build, 395 unseen answers,
# stationarity at the vLLM ids shifted by -1, 0, +1, +2: vLLM-trained 3536, 2324, 2541, 4331;
# SGLang-trained 13911, 6112, 2226, 2663). A drafter not near rest on the user's prompts is
# refused, never misread. A wrong choice costs a little acceptance that finetuning wins back;
# a refusal stops the pipeline: 3 standard errors (a chance pick under 1% of the time on a
# drafter indifferent to the reading) weighs the two.
CLEARLY_BETTER = Clearly(t=3.0, min_samples=8)


class LayerIdsUnclear(ValueError):
    """Neither reading of the nested ids scored clearly better: the user must set them."""


@dataclass(frozen=True)
class ProbeScores:
    """One drafter read both ways on the same samples: how near rest it is (for the choice),
    teacher-forced TTT accuracy per step and mean step-0 loss (for the user)."""

    readings: dict[Reading, tuple[int, ...]]  # vLLM ids each reading feeds the drafter
    stationarity: dict[Reading, Stationarity]
    accuracy: dict[Reading, list[float]]
    loss: dict[Reading, float]  # mean step-0 loss over the supervised samples
    chance_loss: float  # ln(draft vocab): the loss of a drafter that knows nothing
    samples: int
    tokens: int  # supervised positions at step 0

    def supervised(self) -> int:
        """Samples with a supervised position at step 0: those the measures are made on."""
        return len(next(iter(self.stationarity.values())).leave_one_out)

    def t(self, nearer: Reading, farther: Reading) -> float:
        """How many jackknife standard errors `nearer` is nearer rest than `farther`."""
        gap = self.stationarity[farther].value - self.stationarity[nearer].value
        without = [
            f - n
            for n, f in zip(
                self.stationarity[nearer].leave_one_out,
                self.stationarity[farther].leave_one_out,
                strict=True,
            )
        ]
        count = len(without)
        if count < 3:
            return 0.0
        mean = statistics.fmean(without)
        error = math.sqrt((count - 1) / count * sum((w - mean) ** 2 for w in without))
        if error == 0.0:
            return math.inf if gap > 0 else 0.0
        return gap / error

    def ranked(self) -> tuple[Reading, Reading]:
        """(nearer rest, farther)."""
        nearer, farther = sorted(self.readings, key=lambda r: self.stationarity[r].value)
        return nearer, farther

    def describe(self) -> str:
        nearer, farther = self.ranked()
        return (
            "; ".join(
                f"{reading} reading {list(ids)}: stationarity "
                f"{self.stationarity[reading].value:.4g}, step-0 loss {self.loss[reading]:.4f}, "
                f"accuracy {self.accuracy[reading][0]:.3f}"
                for reading, ids in self.readings.items()
            )
            + f" (jackknife t {self.t(nearer, farther):.2f} for the {nearer} reading; "
            f"{self.supervised()} of {self.samples} samples supervised, {self.tokens} tokens; "
            f"chance loss {self.chance_loss:.4f})"
        )

    def to_json(self) -> dict:
        return {
            "readings": {str(r): list(ids) for r, ids in self.readings.items()},
            "stationarity": {str(r): asdict(s) for r, s in self.stationarity.items()},
            "accuracy": {str(r): acc for r, acc in self.accuracy.items()},
            "loss": {str(r): loss for r, loss in self.loss.items()},
            "chance_loss": self.chance_loss,
            "samples": self.samples,
            "tokens": self.tokens,
        }

    @classmethod
    def from_json(cls, data: dict) -> ProbeScores:
        return cls(
            {Reading(r): tuple(ids) for r, ids in data["readings"].items()},
            {Reading(r): Stationarity(**s) for r, s in data["stationarity"].items()},
            {Reading(r): list(acc) for r, acc in data["accuracy"].items()},
            {Reading(r): loss for r, loss in data["loss"].items()},
            data["chance_loss"],
            data["samples"],
            data["tokens"],
        )


def choose_reading(scores: ProbeScores, clearly: Clearly = CLEARLY_BETTER) -> Reading:
    """The clearly better reading; LayerIdsUnclear, naming both scores, why neither is, and
    the setting to use instead."""
    nearer, farther = scores.ranked()
    supervised = scores.supervised()
    t = scores.t(nearer, farther)
    if scores.loss[nearer] >= scores.chance_loss:
        why = (
            f"the warm start predicts no better than chance read the {nearer} way (step-0 "
            f"loss {scores.loss[nearer]:.4f}, a uniform guess {scores.chance_loss:.4f})"
        )
    elif supervised < clearly.min_samples:
        why = f"{supervised} probe samples supervise a position, fewer than {clearly.min_samples}"
    elif t < clearly.t:
        why = f"the {nearer} reading is nearer rest by {t:.2f} standard errors, not {clearly.t}"
    else:
        return nearer
    first = next(iter(scores.readings))
    raise LayerIdsUnclear(
        f"the warm start's nested {KEY} can be read two ways and neither scores clearly "
        f"better: {why}. {scores.describe()}. Set {OVERRIDE_VARIABLE} to the vLLM ids it "
        f"was trained on, e.g. {','.join(map(str, scores.readings[first]))}"
    )


def score_readings(
    drafter_dir: Path,
    target_dir: Path,
    hidden_dir: Path,
    readings: dict[Reading, tuple[int, ...]],
    ttt_length: int = PROBE_TTT_STEPS,
) -> ProbeScores:
    """The drafter on every sample of `hidden_dir` (shards holding the union of the
    readings' layers), read each way."""
    from eagle3_assets.lib.training.stationarity import stationarity
    from eagle3_assets.lib.training.train_drafter import heldout_accuracy

    rows = {
        reading: heldout_accuracy(
            drafter_dir,
            target_dir,
            [str(hidden_dir)],
            1.0,
            ttt_length,
            aux_layer_ids=ids,
        )
        for reading, ids in readings.items()
    }
    first = next(iter(rows.values()))
    if first["accuracy"] is None:
        raise LayerIdsUnclear(
            f"no supervised token among the {first['samples']} probe samples in {hidden_dir}: "
            f"nothing to score the readings on. Set {OVERRIDE_VARIABLE}"
        )
    return ProbeScores(
        dict(readings),
        stationarity(drafter_dir, target_dir, [str(hidden_dir)], readings),
        {reading: row["accuracy"] for reading, row in rows.items()},
        {reading: statistics.fmean(row["sample_loss"]) for reading, row in rows.items()},
        math.log(first["draft_vocab_size"]),
        first["samples"],
        first["tokens"],
    )


def union_layers(readings: dict[Reading, tuple[int, ...]]) -> tuple[int, ...]:
    """The aux layers to extract so that every reading can be scored on the same samples."""
    return fc_order([i for ids in readings.values() for i in ids])


def probe_key(drafter_revision: str, target_dir: Path, target_revision: str | None) -> str:
    """What a probe's scores depend on: the drafter's files (a revision sha names them) and
    the target (its folder, revision and config). A restart with the same pair re-probes
    nothing."""
    config = hashlib.sha256((Path(target_dir) / "config.json").read_bytes()).hexdigest()
    payload = [drafter_revision, str(target_dir), target_revision, config, PROBE_VERSION]
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LayerIdDecision:
    """The aux ids pinned in the warm start, and why."""

    vllm: tuple[int, ...]
    how: str  # "probe" or OVERRIDE_VARIABLE
    published_nested: list[int] | None  # eagle_config's list as published
    reading: Reading | None = None  # the probe's choice
    scores: ProbeScores | None = None

    def record(self) -> dict:
        """What the config keeps (PIN_FIELD): deterministic, so the pinned files of one
        revision are byte-identical at every restart."""
        return {
            "decided_by": self.how,
            "published_eagle_config_ids": self.published_nested,
            "reading": None if self.reading is None else str(self.reading),
        }

    def metadata(self) -> dict:
        """Flat values for the asset's metadata."""
        meta: dict = {
            "aux_layer_ids_decided_by": self.how,
            "aux_layer_ids_published_nested": self.published_nested,
            "aux_layer_ids_reading": "none" if self.reading is None else str(self.reading),
        }
        if self.scores is not None:
            scores = self.scores
            for reading in scores.readings:
                meta[f"layer_probe_{reading}_ids"] = list(scores.readings[reading])
                meta[f"layer_probe_{reading}_stationarity"] = float(
                    f"{scores.stationarity[reading].value:.4g}"
                )
                meta[f"layer_probe_{reading}_step0_loss"] = round(scores.loss[reading], 4)
                meta[f"layer_probe_{reading}_accuracy"] = [
                    round(a, 4) for a in scores.accuracy[reading]
                ]
            meta["layer_probe_t"] = round(scores.t(*scores.ranked()), 2)
            meta["layer_probe_chance_loss"] = round(scores.chance_loss, 4)
            meta["layer_probe_samples"] = scores.samples
            meta["layer_probe_tokens"] = scores.tokens
        return meta


def pin_layer_ids(drafter_dir: Path, decision: LayerIdDecision) -> None:
    """Rewrite config.json so that every reader sees `decision.vllm`: top-level ids (vLLM
    reads only these), the nested list (when the layout has one) in SGLang convention as
    SpecForge writes it, and PIN_FIELD saying how they were decided and what was published."""
    path = Path(drafter_dir) / "config.json"
    config = json.loads(path.read_text())
    config[KEY] = list(decision.vllm)
    if isinstance(config.get("eagle_config"), dict):
        config["eagle_config"][KEY] = list(vllm_to_sglang(decision.vllm))
    config[PIN_FIELD] = decision.record()
    write_atomically(path, (json.dumps(config, indent=2) + "\n").encode())


def _published_nested(drafter_dir: Path) -> list[int] | None:
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    nested = config.get("eagle_config")
    return nested.get(KEY) if isinstance(nested, dict) else None


def check_override(ids: Sequence[int], current: AuxLayerIds, target: TargetShape) -> None:
    """The user's ids fit the drafter and the target: as many as its fc reads, ascending and
    unique (vLLM's order), in range. ValueError naming the variable, expected and found."""
    if len(ids) != len(current.vllm):
        raise ValueError(
            f"{OVERRIDE_VARIABLE}: expected {len(current.vllm)} ids (the drafter's fc reads "
            f"{len(current.vllm)} aux states), found {list(ids)}"
        )
    if list(ids) != list(fc_order(ids)):
        raise ValueError(
            f"{OVERRIDE_VARIABLE}: expected ascending unique ids (vLLM sorts them), "
            f"found {list(ids)}"
        )
    check_layer_ids(ids, target.num_hidden_layers, OVERRIDE_VARIABLE)


def settle_layer_ids(
    drafter_dir: Path,
    current: AuxLayerIds,
    target: TargetShape,
    override: Sequence[int] | None,
    cache_file: Path,
    measure: Callable[[dict[Reading, tuple[int, ...]]], ProbeScores],
    log: Callable[[str], None] = print,
) -> LayerIdDecision | None:
    """Decide and pin the aux ids of the validated drafter in `drafter_dir` (`current`: what
    its config says). The user's `override` wins, checked, with no probe. Otherwise, when the
    nested ids are ambiguous, `measure` scores both readings (its scores are kept in
    `cache_file`, so the same drafter and target are measured once) and the clearly better
    reading is pinned; LayerIdsUnclear when neither is. None: nothing to decide."""
    published = _published_nested(drafter_dir)
    if override is not None:
        check_override(override, current, target)
        decision = LayerIdDecision(tuple(override), OVERRIDE_VARIABLE, published)
        log(f"aux layers {list(override)} (vLLM ids) from {OVERRIDE_VARIABLE}: no probe")
        pin_layer_ids(drafter_dir, decision)
        return decision
    readings = nested_readings(current, target.num_hidden_layers)
    if readings is None:
        return None
    if cache_file.exists():
        scores = ProbeScores.from_json(json.loads(cache_file.read_text()))
        log(f"layer probe: scores measured earlier for this drafter and target ({cache_file})")
    else:
        log(
            f"layer probe: eagle_config ids {published} can be read as "
            + " or ".join(f"{r} {list(ids)}" for r, ids in readings.items())
            + " (vLLM ids); scoring both"
        )
        scores = measure(readings)
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(cache_file, json.dumps(scores.to_json(), indent=1).encode())
    log(f"layer probe: {scores.describe()}")
    reading = choose_reading(scores)
    decision = LayerIdDecision(readings[reading], "probe", published, reading, scores)
    log(f"layer probe: chose the {reading} reading, aux layers {list(decision.vllm)} (vLLM ids)")
    pin_layer_ids(drafter_dir, decision)
    return decision


@dataclass(frozen=True)
class ProbeSamples:
    """Where the probe's samples come from and go: plain values the asset fills in."""

    conversations: Sequence[Conversation]  # held out: never batched for training
    base_urls: Sequence[str]
    served_model: str
    api_key: str | None
    generation: GenerationConfig  # the recipe's; answered greedy, cut at max_tokens
    max_tokens: int
    work_dir: Path


def measure_readings(
    samples: ProbeSamples,
    drafter_dir: Path,
    target_dir: Path,
    tokenizer: Any,
    open_source: Callable[[tuple[int, ...]], AbstractContextManager[StateSource]],
    extraction: ExtractionSettings,
    identity: dict[str, Any],
    readings: dict[Reading, tuple[int, ...]],
    log: Callable[[str], None] = print,
) -> ProbeScores:
    """The served target answers the held-out prompts greedy (the recipe's template kwargs),
    their token sequences are built exactly as extraction builds them, the states at the
    union of the readings' layers (and the final one) are extracted with the configured
    backend (`open_source(layer ids)`, `extraction`: ExtractionSettings), and both readings
    are scored. Generations and shards are resumable under `samples.work_dir`."""
    import pyarrow.parquet as pq

    from eagle3_assets.lib.generation.batch import run_batch
    from eagle3_assets.lib.hidden_states.extract import LayerSelection, extract_batch
    from eagle3_assets.lib.hidden_states.token_sequences import build_sequences

    recipe = samples.generation.model_copy(
        update={"temperature": 0.0, "max_tokens": samples.max_tokens}
    )
    summary = run_batch(
        list(samples.conversations),
        samples.work_dir / "generations",
        samples.base_urls,
        samples.served_model,
        recipe,
        api_key=samples.api_key,
    )
    if summary.final_path is None:
        raise RuntimeError(
            f"layer probe: {summary.failed} of {summary.total} held-out prompts failed: "
            f"{next(iter(summary.failures.values()), '')}"
        )
    rows = pq.read_table(summary.final_path).to_pylist()
    template_kwargs = recipe.chat_template_kwargs or {}
    sequences = build_sequences(rows, tokenizer, template_kwargs, extraction.max_length)
    num_layers = TargetShape.from_config(Path(target_dir)).num_hidden_layers
    layers = LayerSelection(union_layers(readings), num_layers, "layer probe: both readings")
    hidden_dir = samples.work_dir / "hidden_states"
    extract_batch(
        sequences,
        hidden_dir,
        lambda: open_source(layers.ids),
        layers,
        TargetShape.from_config(Path(target_dir)).hidden_size,
        extraction,
        {**identity, "chat_template_kwargs": template_kwargs},
        progress=log,
    )
    return score_readings(drafter_dir, target_dir, hidden_dir, readings)

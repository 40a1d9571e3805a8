"""Extract one batch's hidden states into shards: planned, budgeted, resumable.

The plan comes first and is deterministic: samples sorted by length (so forward batches pad
little and shards are length-homogeneous for training), cut into shards by their exact
encoded size. That gives the batch's bytes before any forward, so a batch that cannot fit
fails at once, naming needed vs free and the formats that would fit. Each shard is written
atomically and its sha256 recorded in `progress.json` at once; a re-run keeps every planned
shard whose file matches its checksum and computes only the others, in the same forward
batches, so a resumed batch is byte-identical to an uninterrupted one. `manifest.json`
appears last, when every shard is there.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from eagle3_assets.lib.core.atomic_files import file_sha256, write_atomically
from eagle3_assets.lib.hidden_states.settings import DEFAULTS
from eagle3_assets.lib.hidden_states.shard_format import (
    FORMAT_VERSION,
    ShardFile,
    ShardFormat,
    candidate_formats,
    encode_sample,
    shard_bytes,
)
from eagle3_assets.lib.hidden_states.token_sequences import TokenSequence

MANIFEST = "manifest.json"
PROGRESS = "progress.json"


class StateSource(Protocol):
    """A backend: the target's states at the manifest's layers (aux ids, then the final id)."""

    hidden_size: int

    def capture(
        self, sequences: Sequence[TokenSequence], batch_tokens: int
    ) -> Iterator[tuple[int, torch.Tensor]]: ...

    def top_logits(self, final: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class ExtractionSettings:
    format: ShardFormat = field(default_factory=ShardFormat)
    shard_bytes: int = int(DEFAULTS.shard_mb * 2**20)
    batch_tokens: int = DEFAULTS.batch_tokens  # per forward, padding included
    cap_bytes: int | None = None  # on everything under the hidden-states root
    max_length: int = DEFAULTS.max_length  # what the sequences were cut to (for the manifest)


@dataclass(frozen=True)
class LayerSelection:
    """Which states a batch holds, in vLLM convention (see layer_ids)."""

    aux: tuple[int, ...]
    final: int
    source: str  # where the aux ids came from

    @property
    def ids(self) -> tuple[int, ...]:
        return (*self.aux, self.final)


@dataclass(frozen=True)
class ShardPlan:
    name: str
    samples: tuple[int, ...]  # indices into the batch's sequences
    tokens: int
    teacher_positions: int
    bytes: int


def plan_shards(
    sequences: Sequence[TokenSequence], fmt: ShardFormat, hidden: int, num_aux: int, limit: int
) -> list[ShardPlan]:
    """Shards of at most `limit` estimated bytes (a bigger sample goes alone), by length."""
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i]), sequences[i].sample_id))
    groups: list[list[int]] = []
    size = 0
    for index in order:
        sequence = sequences[index]
        cost = fmt.estimate(len(sequence), len(sequence.teacher_positions), 1, hidden, num_aux)
        if not groups or size + cost > limit:
            groups.append([])
            size = 0
        groups[-1].append(index)
        size += cost
    plans = []
    for number, group in enumerate(groups):
        tokens = sum(len(sequences[i]) for i in group)
        teacher = sum(len(sequences[i].teacher_positions) for i in group)
        plans.append(
            ShardPlan(
                f"shard-{number:05d}.safetensors",
                tuple(group),
                tokens,
                teacher,
                fmt.estimate(tokens, teacher, len(group), hidden, num_aux),
            )
        )
    return plans


class StorageBudgetError(RuntimeError):
    pass


def _free_bytes(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _tree_bytes(root: Path, skip: Path) -> int:
    if not root.exists():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and skip not in p.parents)


def check_budget(
    out_dir: Path,
    needed: int,
    batch_total: int,
    cap_bytes: int | None,
    alternatives: dict[str, int],
) -> None:
    """Fail before any work when the batch cannot fit the volume or the cap. `needed`: bytes
    still to write; `alternatives`: the batch's total bytes in each other format."""
    free = _free_bytes(out_dir)
    used_elsewhere = _tree_bytes(out_dir.parent, out_dir) if cap_bytes is not None else 0
    problems = []
    if needed > free:
        problems.append(f"needs {human_bytes(needed)} more, {human_bytes(free)} free on the volume")
    if cap_bytes is not None and used_elsewhere + batch_total > cap_bytes:
        problems.append(
            f"needs {human_bytes(batch_total)}, and other batches use "
            f"{human_bytes(used_elsewhere)} of the {human_bytes(cap_bytes)} cap"
        )
    if not problems:
        return
    room = min(free + batch_total - needed, (cap_bytes or free + batch_total) - used_elsewhere)
    fitting = [
        f"{name} ({human_bytes(size)})" for name, size in alternatives.items() if size <= room
    ]
    advice = (
        f"Formats that would fit: {', '.join(fitting)}."
        if fitting
        else "No format fits: free space, raise the cap or lower max_length."
    )
    raise StorageBudgetError(f"{out_dir.name}: {'; '.join(problems)}. {advice}")


def human_bytes(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(size) < 1000:
            return f"{size:.3g} {unit}"
        size /= 1000
    return f"{size:,.2f} TB"


@dataclass(frozen=True)
class ExtractionSummary:
    manifest_path: Path
    samples: int
    tokens: int
    teacher_positions: int
    bytes: int
    shards: int
    reused_shards: int  # found complete from an earlier run
    extracted_tokens: int  # by this run
    seconds: float
    nonfinite: int

    @property
    def tokens_per_s(self) -> float:
        return self.extracted_tokens / self.seconds if self.seconds else 0.0


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _write_json(path: Path, value: dict) -> None:
    write_atomically(path, (json.dumps(value, indent=1) + "\n").encode())


def extract_batch(
    sequences: Sequence[TokenSequence],
    out_dir: Path,
    open_source: Callable[[], AbstractContextManager[StateSource]],
    layers: LayerSelection,
    hidden_size: int,
    settings: ExtractionSettings,
    identity: dict[str, Any],
    progress: Callable[[str], None] = lambda message: None,
) -> ExtractionSummary:
    """Shards and manifest for `sequences` under `out_dir`. `open_source` loads the backend
    (minutes for a big target; a context manager, so a server it starts is stopped), called
    only when some shard is missing. `identity` (target,
    revision, dtype, template kwargs...) goes into the manifest and, with the plan, decides
    whether earlier shards still belong to this batch."""
    started = time.monotonic()
    fmt = settings.format
    plans = plan_shards(sequences, fmt, hidden_size, len(layers.aux), settings.shard_bytes)
    fingerprint = _digest(
        {
            "format_version": FORMAT_VERSION,
            "format": fmt.name,
            "layers": asdict(layers),
            "batch_tokens": settings.batch_tokens,
            "identity": identity,
            "shards": [asdict(p) for p in plans],
            "samples": [
                [
                    s.sample_id,
                    hashlib.sha256(s.input_ids.tobytes() + s.loss_mask.tobytes()).hexdigest(),
                ]
                for s in sequences
            ],
        }
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    done = _verified_shards(out_dir, fingerprint, plans, progress)
    todo = [p for p in plans if p.name not in done]
    total = sum(p.bytes for p in plans)
    if todo:
        check_budget(
            out_dir,
            sum(p.bytes for p in todo),
            total,
            settings.cap_bytes,
            _alternatives(sequences, fmt, hidden_size, len(layers.aux)),
        )
    tokens = sum(p.tokens for p in plans)
    progress(
        f"{len(sequences)} samples, {tokens:,} tokens, {len(plans)} shards of {fmt.name} "
        f"({human_bytes(total)}); {len(done)} complete from an earlier run, {len(todo)} to extract"
    )
    extracted = 0
    if todo:
        progress("loading the extraction backend")
        with open_source() as source:
            extract_started = time.monotonic()
            for plan in todo:
                done[plan.name] = _extract_shard(plan, sequences, source, settings, out_dir)
                _write_json(out_dir / PROGRESS, {"fingerprint": fingerprint, "shards": done})
                extracted += plan.tokens
                elapsed = time.monotonic() - extract_started
                progress(
                    f"{plan.name}: {len(plan.samples)} samples, {plan.tokens:,} tokens; "
                    f"{len(done)}/{len(plans)} shards, {extracted / elapsed:,.0f} tokens/s"
                )
    manifest = _manifest(
        sequences, plans, done, layers, fmt, fingerprint, identity, settings.max_length
    )
    _write_json(out_dir / MANIFEST, manifest)
    (out_dir / PROGRESS).unlink(missing_ok=True)
    return ExtractionSummary(
        out_dir / MANIFEST,
        len(sequences),
        tokens,
        manifest["totals"]["teacher_positions"],
        manifest["totals"]["bytes"],
        len(plans),
        len(plans) - len(todo),
        extracted,
        time.monotonic() - started,
        manifest["totals"]["nonfinite"],
    )


def _alternatives(sequences, fmt: ShardFormat, hidden: int, num_aux: int) -> dict[str, int]:
    tokens = sum(len(s) for s in sequences)
    teacher = sum(len(s.teacher_positions) for s in sequences)
    return {
        other.name: other.estimate(tokens, teacher, len(sequences), hidden, num_aux)
        for other in candidate_formats(fmt.topk or 64)
        if other != fmt
    }


def _verified_shards(
    out_dir: Path, fingerprint: str, plans: list[ShardPlan], progress: Callable[[str], None]
) -> dict[str, dict]:
    """Shard records of an earlier run of this same plan whose files match their checksums;
    everything else in `out_dir` is removed (a different plan's shards, temp files)."""
    record = _read_json(out_dir / MANIFEST) or _read_json(out_dir / PROGRESS) or {}
    current = record.get("fingerprint") == fingerprint
    earlier = record.get("shards", {}) if current else {}
    if record and not current:
        progress("the batch's samples or settings changed since the last extraction: starting over")
    done = {}
    for plan in plans:
        entry = earlier.get(plan.name)
        path = out_dir / plan.name
        if entry and path.exists() and file_sha256(path) == entry["sha256"]:
            done[plan.name] = entry
        elif entry:
            progress(f"{plan.name}: missing or failing its checksum, extracting it again")
    keep = {*done, PROGRESS, MANIFEST} if current else set(done)
    for path in out_dir.iterdir():
        if path.name not in keep:
            path.unlink()
    return done


def encode_states(
    sequence: TokenSequence, states: torch.Tensor, source: StateSource, fmt: ShardFormat
) -> dict[str, torch.Tensor]:
    """One captured sequence's tensors as a shard stores them (stored and streamed alike): the
    aux states everywhere, the final state (or the target's top-k) at the teacher positions."""
    final = states[torch.from_numpy(sequence.teacher_positions), -1]
    teacher = source.top_logits(final, fmt.topk) if fmt.topk is not None else final
    return encode_sample(sequence.input_ids, sequence.loss_mask, states[:, :-1], teacher, fmt)


def _extract_shard(
    plan: ShardPlan,
    sequences: Sequence[TokenSequence],
    source: StateSource,
    settings: ExtractionSettings,
    out_dir: Path,
) -> dict:
    fmt = settings.format
    members = [sequences[i] for i in plan.samples]
    encoded: list[dict[str, torch.Tensor] | None] = [None] * len(members)
    nonfinite = 0
    for index, states in source.capture(members, settings.batch_tokens):
        nonfinite += int((~torch.isfinite(states)).sum())
        encoded[index] = encode_states(members[index], states, source, fmt)
    payload = shard_bytes(encoded, [s.sample_id for s in members], fmt)
    sha256 = write_atomically(out_dir / plan.name, payload)
    return {
        "sha256": sha256,
        "bytes": len(payload),
        "samples": [s.sample_id for s in members],
        "sample_tokens": [len(s) for s in members],
        "tokens": plan.tokens,
        "teacher_positions": plan.teacher_positions,
        "nonfinite": nonfinite,
    }


def _manifest(
    sequences: Sequence[TokenSequence],
    plans: list[ShardPlan],
    shards: dict[str, dict],
    layers: LayerSelection,
    fmt: ShardFormat,
    fingerprint: str,
    identity: dict[str, Any],
    max_length: int,
) -> dict:
    names = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}
    dtypes = {"input_ids": "int32", "loss_mask": "bool", "aux": names[fmt.aux]}
    if fmt.aux == "fp8":
        dtypes["aux_scale"] = "float32"
    if fmt.topk is not None:
        dtypes |= {"topk_logits": "bfloat16", "topk_ids": "int32"}
    else:
        dtypes["final"] = names[fmt.final]
        if fmt.final == "fp8":
            dtypes["final_scale"] = "float32"
    ordered = {plan.name: shards[plan.name] for plan in plans}
    return {
        "format_version": FORMAT_VERSION,
        "format": fmt.name,
        "fingerprint": fingerprint,
        "max_length": max_length,
        "layer_ids": {"convention": "vllm", **asdict(layers)},
        "identity": identity,
        "dtypes": dtypes,
        "totals": {
            "samples": len(sequences),
            "tokens": sum(p.tokens for p in plans),
            "teacher_positions": sum(p.teacher_positions for p in plans),
            "bytes": sum(s["bytes"] for s in ordered.values()),
            "nonfinite": sum(s["nonfinite"] for s in ordered.values()),
            "truncated": sum(s.truncated for s in sequences),
        },
        "shards": ordered,
    }


def read_manifest(batch_dir: Path) -> dict:
    manifest = _read_json(batch_dir / MANIFEST)
    if manifest is None:
        raise FileNotFoundError(f"{batch_dir}: no {MANIFEST}; the batch is not extracted")
    return manifest


@dataclass(frozen=True)
class BatchVerification:
    """What the asset checks report, read back from the files (not from the writer's memory)."""

    missing_samples: list[str]
    unexpected_samples: list[str]
    bad_shards: list[str]  # missing, or failing their sha256
    nonfinite: int  # NaN/Inf values stored
    token_mismatches: list[str]  # samples whose ids differ from the generation's
    tokens: int
    loss_tokens: int
    samples_without_loss: int

    @property
    def loss_fraction(self) -> float:
        return self.loss_tokens / self.tokens if self.tokens else 0.0


def verify_batch(batch_dir: Path, expected: dict[str, list[int]]) -> BatchVerification:
    """Re-read every shard: checksums, finite values, and token ids against `expected` (the
    generation's prompt + response ids per sample id, truncated as extraction truncates)."""
    manifest = read_manifest(batch_dir)
    bad_shards, nonfinite, mismatches, seen = [], 0, [], []
    tokens = loss_tokens = without_loss = 0
    for name, entry in manifest["shards"].items():
        path = batch_dir / name
        if not path.exists() or file_sha256(path) != entry["sha256"]:
            bad_shards.append(name)
            continue
        shard = ShardFile(path)
        floats = {"aux", "aux_scale", "final", "final_scale", "topk_logits"} & set(shard.keys())
        nonfinite += sum(shard.count_nonfinite(name) for name in floats)
        ids, mask = shard.tensor("input_ids"), shard.tensor("loss_mask")
        for index, sample_id in enumerate(shard.sample_ids):
            start, end = shard.token_offsets[index], shard.token_offsets[index + 1]
            seen.append(sample_id)
            want = expected.get(sample_id)
            if want is not None and ids[start:end].tolist() != want[: manifest["max_length"]]:
                mismatches.append(sample_id)
            masked = int(mask[start:end].sum())
            tokens, loss_tokens = tokens + end - start, loss_tokens + masked
            without_loss += masked == 0
    return BatchVerification(
        missing_samples=sorted(set(expected) - set(seen)),
        unexpected_samples=sorted(set(seen) - set(expected)),
        bad_shards=bad_shards,
        nonfinite=nonfinite,
        token_mismatches=mismatches,
        tokens=tokens,
        loss_tokens=loss_tokens,
        samples_without_loss=without_loss,
    )

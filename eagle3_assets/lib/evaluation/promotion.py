"""The drafter serving should use: replaced only by a candidate measurably better on every
evaluation set, never by a worse one, and every promoted version kept with its lineage.

On the volume (`root`): `versions/v001/`, ... (the export vLLM loads, copied byte for byte)
with `versions/v001.json` (where it came from, what it learnt from, what it scored), `current.json`
(the promoted version; absent: the hub warm start serves) and `decisions.jsonl` (every
candidate judged, promoted or refused, and why). A version directory is complete before
`current.json` names it, and `current.json` is replaced atomically: a crash leaves the old
version or the new one promoted, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_assets.lib.core.atomic_files import file_hashes, write_atomically
from eagle3_assets.lib.core.charts import line_chart_svg, markdown_image


@dataclass(frozen=True)
class Version:
    number: int
    path: str  # the export vLLM loads
    files: dict[str, str]  # name -> sha256 (config, weights): never promoted twice
    lineage: dict  # the candidate's export, training run (batches, warm start, recipe)
    acceptance: dict[str, float]  # prompt set -> mean acceptance length when promoted

    @property
    def name(self) -> str:
        return f"promoted v{self.number:03d}"


@dataclass(frozen=True)
class Decision:
    candidate: str  # its export
    files: dict[str, str]
    incumbent: str  # "warm start" or a version's name
    candidate_acceptance: dict[str, float]
    incumbent_acceptance: dict[str, float]
    margin: float
    promoted: bool
    reason: str
    version: int | None  # what serves after the decision (None: the warm start)


def shortfalls(
    candidate: Mapping[str, float], incumbent: Mapping[str, float], margin: float, against: str
) -> list[str]:
    """Why the candidate is not better, set by set: every set the incumbent was measured on
    needs the candidate's mean acceptance length >= (1 + margin) x the incumbent's."""
    reasons = []
    for prompt_set, theirs in incumbent.items():
        needed = theirs * (1 + margin)
        ours = candidate.get(prompt_set)
        if ours is None:
            reasons.append(f"{prompt_set}: not measured for the candidate")
        elif ours < needed:
            reasons.append(
                f"{prompt_set}: {ours:.3f} vs {against} {theirs:.3f} (needs >= {needed:.3f}, "
                f"margin {margin:.0%})"
            )
    return reasons


class Registry:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def current(self) -> Version | None:
        path = self.root / "current.json"
        if not path.exists():
            return None
        return self._version(json.loads(path.read_text())["version"])

    def versions(self) -> list[Version]:
        found = sorted((self.root / "versions").glob("v[0-9][0-9][0-9].json"))
        return [Version(**json.loads(path.read_text())) for path in found]

    def decisions(self) -> list[Decision]:
        path = self.root / "decisions.jsonl"
        if not path.exists():
            return []
        return [Decision(**json.loads(line)) for line in path.read_text().splitlines() if line]

    def judge(
        self,
        candidate: Path,
        lineage: dict,
        scores: Mapping[str, float],
        incumbent: str,
        incumbent_scores: Mapping[str, float],
        margin: float,
    ) -> Decision:
        """Promote `candidate` (an export) if it beats `incumbent` (the warm start or the
        promoted version, measured in the same evaluation: prompt set -> mean acceptance
        length) on every set by `margin`; record the decision either way. Judging the same
        candidate against the same incumbent again returns the first decision."""
        files = file_hashes(Path(candidate))
        for earlier in self.decisions():
            if earlier.files == files and earlier.incumbent == incumbent:
                return earlier
        current = self.current()
        reasons = shortfalls(scores, incumbent_scores, margin, incumbent)
        if current is not None and current.files == files:
            reasons = [f"it is {current.name} already"]
        version = current.number if current else None
        if not reasons:
            version = self._promote(candidate, files, lineage, dict(scores)).number
        decision = Decision(
            str(candidate),
            files,
            incumbent,
            dict(scores),
            dict(incumbent_scores),
            margin,
            not reasons,
            f"beats {incumbent} on every set" if not reasons else "; ".join(reasons),
            version,
        )
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "decisions.jsonl", "a", encoding="utf-8") as log:
            log.write(json.dumps(asdict(decision)) + "\n")
            log.flush()
            os.fsync(log.fileno())
        return decision

    def _version(self, number: int) -> Version:
        path = self.root / "versions" / f"v{number:03d}.json"
        return Version(**json.loads(path.read_text()))

    def _promote(
        self, candidate: Path, files: dict[str, str], lineage: dict, acceptance: dict
    ) -> Version:
        versions = self.versions()
        same = [v for v in versions if v.files == files]  # copied before a crash: reuse it
        if same:
            version = same[0]
        else:
            number = versions[-1].number + 1 if versions else 1
            final = self.root / "versions" / f"v{number:03d}"
            staging = final.with_name(f".staging-{final.name}")
            staging.parent.mkdir(parents=True, exist_ok=True)
            for partial in (staging, final):  # a copy whose record a crash cut off
                shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(candidate, staging)
            os.replace(staging, final)
            version = Version(number, str(final), files, lineage, acceptance)
            write_atomically(final.with_suffix(".json"), json.dumps(asdict(version)).encode())
        write_atomically(
            self.root / "current.json", json.dumps({"version": version.number}).encode()
        )
        return version


def history_chart(decisions: list[Decision]) -> str:
    """Markdown: each judged candidate's acceptance per prompt set, in order, as a chart and
    a table (promoted or refused, and against what)."""
    sets = list(dict.fromkeys(s for d in decisions for s in d.candidate_acceptance))
    series = {s: [d.candidate_acceptance.get(s, 0.0) for d in decisions] for s in sets}
    chart = markdown_image(line_chart_svg("candidate acceptance by prompt set", series), "history")
    rows = [
        f"| {i} | {', '.join(f'{s} {d.candidate_acceptance.get(s, 0):.3f}' for s in sets)} | "
        f"{d.incumbent} | {'promoted' if d.promoted else 'refused'} | "
        f"{'warm start' if d.version is None else f'v{d.version:03d}'} |"
        for i, d in enumerate(decisions, start=1)
    ]
    table = [
        "| candidate | mean acceptance length | against | verdict | serving after |",
        "| --- | --- | --- | --- | --- |",
        *rows,
    ]
    return chart + "\n\n" + "\n".join(table)

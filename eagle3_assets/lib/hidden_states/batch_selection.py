"""Which extracted batches a consumer may read, given each batch's latest check results.

A batch is materialized before its checks run (its files must exist to be checked), so
"materialized" is not "usable": a batch whose latest evaluation of any check did not pass
(failed, not evaluated yet, or older than the batch's latest materialization) is left out and
named, with what to do. The statuses come from the orchestrator; this module only decides.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

PASSED = "passed"
NO_MANIFEST = "manifest.json"  # pseudo-check: the batch's files are gone from the volume


@dataclass(frozen=True)
class Exclusion:
    batch: str
    problems: dict[str, str]  # check name -> its latest status, e.g. {"values_finite": "failed"}

    def message(self, asset: str, fixes: Mapping[str, str]) -> str:
        """`asset[batch]: check failed (...); re-materialize asset[batch] after <fix>`."""
        found = "; ".join(f"{check} {status}" for check, status in self.problems.items())
        causes = [fixes[c] for c in self.problems if c in fixes]
        after = f" after {'; and '.join(causes)}" if causes else ""
        return (
            f"{asset}[{self.batch}] left out: {found} (latest evaluation); "
            f"re-materialize {asset}[{self.batch}]{after}"
        )


@dataclass(frozen=True)
class BatchSelection:
    usable: list[str]
    excluded: list[Exclusion]


def select_batches(
    statuses: Mapping[str, Mapping[str, str]], extracted: Iterable[str]
) -> BatchSelection:
    """`statuses`: batch -> check -> latest status (PASSED or why not); `extracted`: batches
    whose files (manifest) exist. Usable: every check passed and the files are there."""
    on_disk = set(extracted)
    usable, excluded = [], []
    for batch in sorted(statuses):
        problems = {check: s for check, s in statuses[batch].items() if s != PASSED}
        if batch not in on_disk:
            problems[NO_MANIFEST] = "missing"
        if problems:
            excluded.append(Exclusion(batch, problems))
        else:
            usable.append(batch)
    return BatchSelection(usable, excluded)

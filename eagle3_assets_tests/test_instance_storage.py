"""Pool slots on the project's instances (dagster.yaml on SQLite, deploy/dagster-postgres.yaml
on a real PostgreSQL): two steps that claim a slot of a pool of 1 at the same moment never
both hold it. The moment is made, not waited for: each claimer runs on its own instance, and
both must reach each of the claim's writes before either makes it, the interleaving in which
Dagster's own storage tells both CLAIMED."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest
from dagster._utils.concurrency import ConcurrencySlotStatus
from sqlalchemy import event
from sqlalchemy.engine import Engine

from eagle3_assets_tests.deploy.postgres import running_postgres, use_postgres_instance

# A claim's writes, in order: queue the step (assigned, since both see the slot free), then
# write the claimer into the free slot both selected.
CLAIM_WRITES = ("INSERT INTO PENDING_STEPS", "UPDATE CONCURRENCY_SLOTS")
CLAIMED, BLOCKED = ConcurrencySlotStatus.CLAIMED, ConcurrencySlotStatus.BLOCKED
claimer = threading.local()  # `run` set while a test thread claims


@pytest.fixture(params=["sqlite", "postgres"])
def instance_home(request, dagster_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """DAGSTER_HOME with the instance config of a laptop (SQLite) or of a deployment."""
    if request.param == "sqlite":
        yield dagster_home
        return
    with running_postgres() as postgres:
        use_postgres_instance(dagster_home, postgres, monkeypatch)
        yield dagster_home


@contextmanager
def claims_in_step(claimers: int) -> Iterator[Counter[str]]:
    """Holds each thread that set `claimer.run` at each of CLAIM_WRITES until all `claimers`
    are there; counts the arrivals."""
    barriers = {write: threading.Barrier(claimers, timeout=60) for write in CLAIM_WRITES}
    arrivals: Counter[str] = Counter()

    def before_write(conn, cursor, statement: str, *args) -> None:
        for write, barrier in barriers.items():
            if getattr(claimer, "run", None) and statement.lstrip().upper().startswith(write):
                arrivals[write] += 1
                barrier.wait()

    event.listen(Engine, "before_cursor_execute", before_write)
    try:
        yield arrivals
    finally:
        event.remove(Engine, "before_cursor_execute", before_write)


def test_two_steps_claiming_together_never_both_hold_a_slot(instance_home: Path) -> None:
    with dg.DagsterInstance.get() as run_a, dg.DagsterInstance.get() as run_b:  # a storage each
        storages = {"run-a": run_a.event_log_storage, "run-b": run_b.event_log_storage}
        storages["run-a"].set_concurrency_slots("vllm", 1)

        def claim(run: str) -> ConcurrencySlotStatus:
            claimer.run = run
            try:
                return storages[run].claim_concurrency_slot("vllm", run, "step").slot_status
            finally:
                claimer.run = None

        def holders() -> list[str]:
            return [s.run_id for s in storages["run-a"].get_concurrency_info("vllm").claimed_slots]

        with claims_in_step(len(storages)) as arrivals, ThreadPoolExecutor(len(storages)) as pool:
            statuses = dict(zip(storages, pool.map(claim, storages), strict=True))
        assert arrivals == {write: 2 for write in CLAIM_WRITES}  # both at each write together
        assert Counter(statuses.values()) == {CLAIMED: 1, BLOCKED: 1}, statuses
        winner, loser = sorted(statuses, key=lambda run: statuses[run] != CLAIMED)
        assert holders() == [winner]

        # The loser's run asks again: blocked while the winner holds the slot, its own once freed.
        assert claim(loser) == BLOCKED
        storages[winner].free_concurrency_slot_for_step(winner, "step")
        assert claim(loser) == CLAIMED
        assert holders() == [loser]

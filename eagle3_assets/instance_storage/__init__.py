"""Dagster's instance storage, with pool slots that two steps can never hold at once.

Dagster 1.13 claims a pool slot in two statements: it selects a free slot, then writes the
claimer into that slot by id. Two runs that start together can both select the same free
slot and both write it, each told CLAIMED: a `vllm` pool of 1 let two generation batches
load the server at once (a CI run of test_pools.py), on SQLite and on PostgreSQL alike.
Here the claim is one statement that writes a free slot only while it is still free, so one
of the two wins; the other is told BLOCKED, and its run asks again until the winner frees
it. Configured in dagster.yaml (`storage: custom`); `postgres.py` is the same for
deployments.
"""

from __future__ import annotations

import sqlalchemy as db
from dagster._core.storage.event_log import SqliteEventLogStorage
from dagster._core.storage.event_log.schema import ConcurrencySlotsTable
from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage
from dagster._core.storage.sqlite_storage import DagsterSqliteStorage, _event_logs_directory
from dagster._serdes import ConfigurableClassData
from dagster._utils.concurrency import ConcurrencySlotStatus


class AtomicSlotClaims(SqlEventLogStorage):
    """An event log storage whose slot claim is one conditional write."""

    def _claim_concurrency_slot(
        self, concurrency_key: str, run_id: str, step_key: str
    ) -> ConcurrencySlotStatus:
        slots = ConcurrencySlotsTable
        free = db.and_(
            slots.c.concurrency_key == concurrency_key,
            slots.c.step_key.is_(None),
            slots.c.deleted.is_(False),
        )
        a_free_slot = db.select(slots.c.id).where(free).limit(1).scalar_subquery()
        # `free` again: PostgreSQL re-checks it once it holds the row a rival may have taken
        claim = slots.update().where(slots.c.id == a_free_slot, free)
        with self.index_connection() as conn:
            won = conn.execute(claim.values(run_id=run_id, step_key=step_key)).rowcount == 1
        return ConcurrencySlotStatus.CLAIMED if won else ConcurrencySlotStatus.BLOCKED


class AtomicSqliteEventLogStorage(AtomicSlotClaims, SqliteEventLogStorage):
    pass


class SqliteStorage(DagsterSqliteStorage):
    """Dagster's SQLite storage (`storage: sqlite`), its slot claims atomic."""

    def __init__(self, base_dir: str, inst_data: ConfigurableClassData | None = None) -> None:
        super().__init__(base_dir, inst_data)
        self._event_log_storage = AtomicSqliteEventLogStorage(_event_logs_directory(base_dir))

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData, config_value: dict
    ) -> SqliteStorage:
        return cls.from_local(inst_data=inst_data, **config_value)

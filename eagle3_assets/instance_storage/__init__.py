"""Dagster's instance storage, made safe for several processes at once.

Pool slots: Dagster 1.13 claims a pool slot in two statements: it selects a free slot, then
writes the claimer into that slot by id. Two runs that start together can both select the
same free slot and both write it, each told CLAIMED: a `vllm` pool of 1 let two generation
batches load the server at once (a CI run of test_pools.py), on SQLite and on PostgreSQL
alike. Here the claim is one statement that writes a free slot only while it is still free,
so one of the two wins; the other is told BLOCKED, and its run asks again until the winner
frees it.

First creation (SQLite): each process that opens a new DAGSTER_HOME creates and stamps the
databases it finds missing. Two at once (the daemon's code server and the webserver) can
stamp one database twice, with head and with the revision Dagster assumes for tables found
unstamped (Dagster issue 27390), and every later open fails on "more than one head". Here
opening the storage holds a file lock beside the databases, so one process creates them;
a database already stamped twice that way is repaired, and any other damage refused with
the file named.

Configured in dagster.yaml (`storage: custom`); `postgres.py` is the same for deployments
(PostgreSQL stamps head only, in the transaction that creates the tables: no such race).
"""

from __future__ import annotations

import fcntl
import logging
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import dagster._core.storage.runs.sqlite.sqlite_run_storage as sqlite_run_storage
import sqlalchemy as db
from alembic.script import ScriptDirectory
from dagster._core.storage.event_log import SqliteEventLogStorage
from dagster._core.storage.event_log.schema import ConcurrencySlotsTable
from dagster._core.storage.event_log.sql_event_log import SqlEventLogStorage
from dagster._core.storage.event_log.sqlite.sqlite_event_log import INDEX_SHARD_NAME
from dagster._core.storage.runs import SqliteRunStorage
from dagster._core.storage.schedules import SqliteScheduleStorage
from dagster._core.storage.sql import get_alembic_config
from dagster._core.storage.sqlite_storage import (
    DagsterSqliteStorage,
    _event_logs_directory,
    _runs_directory,
    _schedule_directory,
)
from dagster._serdes import ConfigurableClassData
from dagster._utils.concurrency import ConcurrencySlotStatus

log = logging.getLogger(__name__)

CREATION_LOCK = ".storage.lock"


class DamagedInstanceError(RuntimeError):
    """An instance database whose revision stamps this storage cannot repair."""


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


@contextmanager
def creation_lock(base_dir: Path) -> Iterator[None]:
    """Held by one process at a time while it opens (and, the first time, creates) the
    databases under base_dir; per open file, so threads of one process take turns too."""
    base_dir.mkdir(parents=True, exist_ok=True)
    with open(base_dir / CREATION_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def stamped_databases(base_dir: str) -> list[Path]:
    """The databases whose creation stamps a revision, where Dagster puts them (each run's
    own event database is stamped head only, and Dagster retries a concurrent stamp of it)."""
    return [
        Path(_runs_directory(base_dir)) / "runs.db",
        Path(_event_logs_directory(base_dir)) / f"{INDEX_SHARD_NAME}.db",
        Path(_schedule_directory(base_dir)) / "schedules.db",
    ]


def repair_revision_stamps(database: Path) -> None:
    """One stamp per database: of two, the head and an older revision (the concurrent first
    creation's), keep the head, since both creators made the tables at head; refuse anything
    else with what to do."""
    if not database.exists():
        return
    with closing(sqlite3.connect(database)) as conn:
        if not conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'alembic_version'"
        ).fetchone():
            return
        stamps = [row[0] for row in conn.execute("SELECT version_num FROM alembic_version")]
        if len(stamps) <= 1:
            return
        script = ScriptDirectory.from_config(get_alembic_config(sqlite_run_storage.__file__))
        head = script.get_current_head()
        history = {revision.revision for revision in script.iterate_revisions(head, "base")}
        if head not in stamps or not set(stamps) <= history:
            raise DamagedInstanceError(
                f"{database}: alembic_version holds {len(stamps)} revisions {sorted(stamps)}, "
                f"expected one (this Dagster's head is {head}); it was not made by two "
                "processes creating the instance at once, so it is not repaired here. Stop "
                "every Dagster process on this DAGSTER_HOME, then run `dagster instance "
                "migrate`, or move the file aside to start it afresh (its runs are lost)."
            )
        with conn:
            conn.execute("DELETE FROM alembic_version WHERE version_num != ?", (head,))
    log.warning(
        "%s: stamped %s by two processes that created it at once; kept the head %s",
        database,
        sorted(stamps),
        head,
    )


class SqliteStorage(DagsterSqliteStorage):
    """Dagster's SQLite storage (`storage: sqlite`), its slot claims atomic, opened under
    the creation lock."""

    def __init__(self, base_dir: str, inst_data: ConfigurableClassData | None = None) -> None:
        # Dagster's own __init__, the atomic event log built instead of its (not beside it)
        self.base_dir, self._inst_data = base_dir, inst_data
        with creation_lock(Path(base_dir)):
            for database in stamped_databases(base_dir):
                repair_revision_stamps(database)
            self._run_storage = SqliteRunStorage.from_local(_runs_directory(base_dir))
            self._event_log_storage = AtomicSqliteEventLogStorage(_event_logs_directory(base_dir))
            self._schedule_storage = SqliteScheduleStorage.from_local(_schedule_directory(base_dir))
        super(DagsterSqliteStorage, self).__init__()

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData, config_value: dict
    ) -> SqliteStorage:
        return cls.from_local(inst_data=inst_data, **config_value)

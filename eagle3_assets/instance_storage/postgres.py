"""Dagster's PostgreSQL storage with atomic slot claims and a creation lock (see the
package): for deployments, named by deploy/dagster-postgres.yaml; needs the `postgres` extra.

Several processes creating the tables of a new database at once fail, all but one, on
"relation ... already exists" (instance_info, created outside Dagster's creation retry): a
webserver or daemon that dies on start. Opening holds a PostgreSQL advisory lock instead,
one per database, so one process creates and the others find the tables made."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as db
from dagster._serdes import ConfigurableClassData
from dagster_postgres import (
    DagsterPostgresStorage,
    PostgresEventLogStorage,
    PostgresRunStorage,
    PostgresScheduleStorage,
)
from dagster_postgres.auth import PgTokenProvider
from dagster_postgres.utils import (
    create_pg_engine,
    get_token_provider_from_config,
    pg_url_from_config,
)
from sqlalchemy import pool

from eagle3_assets.instance_storage import AtomicSlotClaims

CREATION_LOCK = 0x4541474C45335354  # the advisory lock's key: "EAGLE3ST"


class AtomicPostgresEventLogStorage(AtomicSlotClaims, PostgresEventLogStorage):
    pass


@contextmanager
def creation_lock(postgres_url: str, token_provider: PgTokenProvider | None) -> Iterator[None]:
    """Held by one process at a time while it opens (and, the first time, creates) the
    tables; released with the session if the process dies."""
    engine = create_pg_engine(
        postgres_url, token_provider, isolation_level="AUTOCOMMIT", poolclass=pool.NullPool
    )
    try:
        with engine.connect() as conn:
            conn.execute(db.text("SELECT pg_advisory_lock(:key)"), {"key": CREATION_LOCK})
            try:
                yield
            finally:
                conn.execute(db.text("SELECT pg_advisory_unlock(:key)"), {"key": CREATION_LOCK})
    finally:
        engine.dispose()


class PostgresStorage(DagsterPostgresStorage):
    """Dagster's PostgreSQL storage (`storage: postgres`), its slot claims atomic, opened
    under the creation lock."""

    def __init__(
        self,
        postgres_url: str,
        should_autocreate_tables: bool = True,
        inst_data: ConfigurableClassData | None = None,
        token_provider: PgTokenProvider | None = None,
    ) -> None:
        # Dagster's own __init__, the atomic event log built instead of its (not beside it)
        self.postgres_url, self.should_autocreate_tables = postgres_url, should_autocreate_tables
        self._inst_data = inst_data
        args = (postgres_url, should_autocreate_tables)
        with creation_lock(postgres_url, token_provider):
            self._run_storage = PostgresRunStorage(*args, token_provider=token_provider)
            self._event_log_storage = AtomicPostgresEventLogStorage(
                *args, token_provider=token_provider
            )
            self._schedule_storage = PostgresScheduleStorage(*args, token_provider=token_provider)
        super(DagsterPostgresStorage, self).__init__()

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: dict
    ) -> PostgresStorage:
        return cls(
            pg_url_from_config(config_value),
            config_value.get("should_autocreate_tables", True),
            inst_data=inst_data,
            token_provider=get_token_provider_from_config(config_value),
        )

"""Dagster's PostgreSQL storage with atomic slot claims (see the package): for deployments,
named by deploy/dagster-postgres.yaml; needs the `postgres` extra."""

from __future__ import annotations

from dagster._serdes import ConfigurableClassData
from dagster_postgres import DagsterPostgresStorage, PostgresEventLogStorage
from dagster_postgres.auth import PgTokenProvider
from dagster_postgres.utils import get_token_provider_from_config, pg_url_from_config

from eagle3_assets.instance_storage import AtomicSlotClaims


class AtomicPostgresEventLogStorage(AtomicSlotClaims, PostgresEventLogStorage):
    pass


class PostgresStorage(DagsterPostgresStorage):
    """Dagster's PostgreSQL storage (`storage: postgres`), its slot claims atomic."""

    def __init__(
        self,
        postgres_url: str,
        should_autocreate_tables: bool = True,
        inst_data: ConfigurableClassData | None = None,
        token_provider: PgTokenProvider | None = None,
    ) -> None:
        super().__init__(postgres_url, should_autocreate_tables, inst_data, token_provider)
        self._event_log_storage = AtomicPostgresEventLogStorage(
            postgres_url, should_autocreate_tables, token_provider=token_provider
        )

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

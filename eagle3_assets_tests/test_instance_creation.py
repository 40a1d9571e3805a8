"""A new instance opened by many processes at once (the webserver, the daemon, its code
server, run workers, a CLI) is created once and opens for all of them, on the project's
SQLite config (dagster.yaml) and the deployment's PostgreSQL one; an instance already
stamped twice by Dagster's own storage is repaired, other damage refused by name."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.sqlite import LAST_KNOWN_STAMPED_SQLITE_ALEMBIC_REVISION

from eagle3_assets.instance_storage import DamagedInstanceError, stamped_databases
from eagle3_assets_tests.conftest import REPO
from eagle3_assets_tests.deploy.postgres import PG_CONFIG, Postgres, running_postgres

PROCESSES = 8
ROUNDS = 20
# forked: each opener is a process of its own, started without re-importing Dagster (a
# spawned one would take seconds, and the openers would no longer meet)
FORK = multiprocessing.get_context("fork")


def open_and_store_a_run(home: Path, env: dict[str, str], start, results) -> None:
    """One opener: wait for the others, open the instance, store a run and an event of it,
    read both back."""
    os.environ.update(env, DAGSTER_HOME=str(home))
    start.wait(timeout=60)
    try:
        with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
            run = instance.add_run(dg.DagsterRun(job_name="opener"))
            instance.report_engine_event("opened", run)
            stored = instance.get_run_by_id(run.run_id)
            events = [e.message for e in instance.all_logs(run.run_id)]
            results.put((stored.job_name if stored else None, events))
    except Exception as error:  # reported to the test, which fails on it
        results.put((type(error).__name__, [str(error).splitlines()[0]]))


def open_together(home: Path, env: dict[str, str]) -> list[tuple]:
    """PROCESSES openers of `home`, released at one moment; what each stored and read."""
    start, results = FORK.Barrier(PROCESSES), FORK.Queue()
    openers = [
        FORK.Process(target=open_and_store_a_run, args=(home, env, start, results))
        for _ in range(PROCESSES)
    ]
    for opener in openers:
        opener.start()
    found = [results.get(timeout=120) for _ in openers]
    for opener in openers:
        opener.join(timeout=60)
    return found


def stamps(database: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(database)) as conn:
        return [row[0] for row in conn.execute("SELECT version_num FROM alembic_version")]


def new_home(root: Path, config: Path) -> Path:
    root.mkdir()
    shutil.copy(config, root / "dagster.yaml")
    return root


def test_a_new_sqlite_instance_opened_by_many_processes_is_created_once(tmp_path: Path) -> None:
    for round_ in range(ROUNDS):
        home = new_home(tmp_path / f"home-{round_}", REPO / "dagster.yaml")
        found = open_together(home, {})
        assert found == [("opener", ["opened"])] * PROCESSES, f"round {round_}: {found}"
        for database in stamped_databases(str(home)):
            assert len(stamps(database)) == 1, f"round {round_}: {database}"


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    with running_postgres() as server:
        yield server


def test_a_new_postgres_instance_opened_by_many_processes_is_created_once(
    tmp_path: Path, postgres: Postgres
) -> None:
    for round_ in range(ROUNDS):
        server = postgres.new_database(f"round_{round_}")  # an empty database each round
        home = new_home(tmp_path / f"home-{round_}", PG_CONFIG)
        found = open_together(home, server.env())
        assert found == [("opener", ["opened"])] * PROCESSES, f"round {round_}: {found}"
        with contextlib.closing(server.connect()) as conn:
            cursor = conn.cursor()
            cursor.execute("SELECT count(*) FROM alembic_version")
            assert cursor.fetchone() == (1,), f"round {round_}"


@pytest.fixture
def instance_stamped_twice(dagster_home: Path) -> Path:
    """An instance whose schedules database holds two stamps, as two processes creating it
    with Dagster's own storage leave it: head, and the revision assumed for unstamped tables."""
    dg.DagsterInstance.get().dispose()
    database = dagster_home / "schedules" / "schedules.db"
    with contextlib.closing(sqlite3.connect(database)) as conn, conn:
        conn.execute(
            "INSERT INTO alembic_version VALUES (?)", (LAST_KNOWN_STAMPED_SQLITE_ALEMBIC_REVISION,)
        )
    return database


def test_an_instance_stamped_twice_at_creation_is_repaired(instance_stamped_twice: Path) -> None:
    (head,) = set(stamps(instance_stamped_twice)) - {LAST_KNOWN_STAMPED_SQLITE_ALEMBIC_REVISION}
    with dg.DagsterInstance.get() as instance:
        run = instance.add_run(dg.DagsterRun(job_name="after-repair"))
        assert instance.get_run_by_id(run.run_id).job_name == "after-repair"
        assert instance.all_instigator_state() == []
    assert stamps(instance_stamped_twice) == [head]


def test_other_damage_is_refused_with_the_file_named(instance_stamped_twice: Path) -> None:
    with contextlib.closing(sqlite3.connect(instance_stamped_twice)) as conn, conn:
        conn.execute("INSERT INTO alembic_version VALUES ('0123456789ab')")
    with pytest.raises(DamagedInstanceError) as refused:
        dg.DagsterInstance.get()
    message = str(refused.value)
    assert message.startswith(f"{instance_stamped_twice}: alembic_version holds 3 revisions")
    assert "'0123456789ab'" in message and "dagster instance migrate" in message
    assert len(stamps(instance_stamped_twice)) == 3  # nothing changed

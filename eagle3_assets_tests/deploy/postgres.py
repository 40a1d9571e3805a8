"""A real PostgreSQL server for tests: Debian's binaries, a throwaway cluster, 127.0.0.1 only.

initdb and postgres refuse to run as root; CI runs as root, so there the cluster belongs to
the `postgres` system user and the binaries run through `runuser`. As any other user they
run directly. Password authentication (scram) is on, so a wrong password would fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from eagle3_assets_tests.conftest import REPO, free_port

PG_CONFIG = REPO / "deploy" / "dagster-postgres.yaml"  # the deployment's instance config
PG_BIN = Path(os.environ.get("EAGLE3_PG_BIN", "/usr/lib/postgresql/15/bin"))


@dataclass(frozen=True)
class Postgres:
    host: str
    port: int
    user: str
    password: str
    db_name: str

    def env(self) -> dict[str, str]:
        """The variables deploy/dagster-postgres.yaml reads."""
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USERNAME": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
            "DAGSTER_PG_DB": self.db_name,
        }

    def connect(self):
        import psycopg2

        return psycopg2.connect(
            host=self.host,
            port=self.port,
            user=self.user,
            password=self.password,
            dbname=self.db_name,
        )

    def new_database(self, db_name: str) -> Postgres:
        """The same server with an empty database `db_name`, created now."""
        with contextlib.closing(self.connect()) as conn:
            conn.autocommit = True
            conn.cursor().execute(f'CREATE DATABASE "{db_name}"')
        return dataclasses.replace(self, db_name=db_name)


def use_postgres_instance(home: Path, server: Postgres, monkeypatch: pytest.MonkeyPatch) -> None:
    """DAGSTER_HOME `home` as a deployment has it: deploy/dagster-postgres.yaml, and the
    server's variables for it (and for the processes started after)."""
    shutil.copy(PG_CONFIG, home / "dagster.yaml")
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)


def _as_owner(argv: list[str], owner: str | None) -> list[str]:
    return ["runuser", "-u", owner, "--", *argv] if owner else argv


@contextlib.contextmanager
def running_postgres(db_name: str = "dagster") -> Iterator[Postgres]:
    """initdb + postgres on a free loopback port; the cluster is deleted on exit."""
    if not (PG_BIN / "postgres").exists():
        raise RuntimeError(f"no PostgreSQL at {PG_BIN}: `make system-packages` installs it")
    owner = "postgres" if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))  # not under pytest's 0700 tmp dirs
    data, sockets = root / "data", root / "sockets"
    sockets.mkdir()
    password, user = "pg-test-password", "dagster"
    (root / "pwfile").write_text(password + "\n")
    if owner:
        entry = pwd.getpwnam(owner)
        for path in (root, sockets, root / "pwfile"):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    port = free_port()
    process = None
    try:
        subprocess.run(
            _as_owner(
                [str(PG_BIN / "initdb"), "-D", str(data), "-U", user, "-E", "UTF8",
                 "--auth=scram-sha-256", f"--pwfile={root / 'pwfile'}", "--no-sync",
                 "--no-instructions"],
                owner,
            ),
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        log = open(root / "postgres.log", "wb")  # noqa: SIM115  (closed below)
        process = subprocess.Popen(
            _as_owner(
                [str(PG_BIN / "postgres"), "-D", str(data), "-p", str(port),
                 "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={sockets}",
                 "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off"],
                owner,
            ),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()
        server = Postgres("127.0.0.1", port, user, password, "postgres")
        _wait_accepting(server, process, root / "postgres.log")
        yield server.new_database(db_name)
    finally:
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)  # "fast" shutdown
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        shutil.rmtree(root, ignore_errors=True)


def _wait_accepting(server: Postgres, process: subprocess.Popen, log: Path) -> None:
    import psycopg2

    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"postgres exited {process.returncode}: {log.read_text()[-2000:]}")
        try:
            server.connect().close()
            return
        except psycopg2.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)

"""The project's real `dagster-webserver` as a subprocess, and a GraphQL client for it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3_assets.localdev.processes import process_group

REPO = Path(__file__).resolve().parents[1]
WEBSERVER = Path(sys.executable).parent / "dagster-webserver"

LOCATION_STATUS = """
{ workspaceOrError { ... on Workspace { locationEntries {
    name loadStatus
    locationOrLoadError { __typename ... on PythonError { message } }
} } } }
"""


@dataclass(frozen=True)
class Webserver:
    url: str
    pid: int
    log: Path

    def graphql(self, query: str, variables: dict | None = None) -> dict:
        """POST one query; GraphQL errors raise (a typo in a query must not pass silently)."""
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        request = urllib.request.Request(
            f"{self.url}/graphql", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        if answer.get("errors"):
            raise AssertionError(f"GraphQL errors: {answer['errors']}")
        return answer["data"]


@contextlib.contextmanager
def running_webserver(
    dagster_home: Path,
    env: dict[str, str],
    port: int,
    log: Path,
    timeout_s: float = 180.0,
    workspace: Path = REPO / "workspace.yaml",
) -> Iterator[Webserver]:
    """`dagster-webserver -h 127.0.0.1 -p PORT -w workspace.yaml`, yielded once the code
    location has loaded; its process group stopped on exit."""
    argv = [str(WEBSERVER), "-h", "127.0.0.1", "-p", str(port), "-w", str(workspace)]
    full_env = {**os.environ, **env, "DAGSTER_HOME": str(dagster_home)}
    with process_group(argv, full_env, log) as process:
        server = Webserver(f"http://127.0.0.1:{port}", process.pid, log)
        _wait_loaded(server, process, timeout_s)
        yield server


def _wait_loaded(server: Webserver, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(
                f"webserver exited {process.returncode}: {server.log.read_text()[-3000:]}"
            )
        try:
            entries = server.graphql(LOCATION_STATUS)["workspaceOrError"]["locationEntries"]
            if entries and all(e["loadStatus"] == "LOADED" for e in entries):
                errors = [
                    e["locationOrLoadError"] for e in entries
                    if e["locationOrLoadError"]["__typename"] == "PythonError"
                ]  # fmt: skip
                if errors:
                    raise RuntimeError(f"code location failed to load: {errors}")
                return
        except (urllib.error.URLError, ConnectionError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"webserver not ready in {timeout_s}s: {server.log}")
        time.sleep(0.25)

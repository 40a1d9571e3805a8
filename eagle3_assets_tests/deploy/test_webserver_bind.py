"""The web UI listens on loopback unless someone says otherwise: `make ui` is started as the
Makefile spells it (on a free port) and its listening sockets are read from the kernel; every
other place we ship that starts a webserver is checked statically (containers must listen on
0.0.0.0 inside, so compose may publish their ports on the host's 127.0.0.1 only)."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path

import yaml

from eagle3_assets.localdev.processes import process_group
from eagle3_assets_tests.conftest import REPO, free_port
from eagle3_assets_tests.deploy.dockerfile import instructions

STARTS_UI = re.compile(r"dagster(-webserver| dev)\b")


def make_ui_command() -> list[str]:
    """The `ui` target's command line, from make itself (dry run: nothing is built)."""
    dry = subprocess.run(
        ["make", "-n", "ui"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    (line,) = [line for line in dry.splitlines() if STARTS_UI.search(line)]
    return shlex.split(line)


def option(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg in names:
            return argv[i + 1]
    return None


def listening(port: int) -> set[str]:
    """Local addresses in LISTEN state on `port` (IPv4 and IPv6), from /proc/net."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hex_port, 16) == port:
                if len(address) == 8:
                    found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1]))
                else:
                    raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, 32, 8))
                    found.add(socket.inet_ntop(socket.AF_INET6, raw))
    return found


def test_make_ui_listens_on_loopback_only(dagster_home: Path, tmp_path: Path) -> None:
    argv = make_ui_command()
    assert option(argv, "-h", "--host") == "127.0.0.1"
    port = free_port()
    flag = next(i for i, arg in enumerate(argv) if arg in ("-p", "--port"))
    argv[flag + 1] = str(port)  # the Makefile's 3000 may be taken here
    log = tmp_path / "ui.log"
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home)}
    with process_group(argv, env, log) as process:
        deadline = time.monotonic() + 120
        while not listening(port):
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the UI never listened"
            time.sleep(0.25)
        assert listening(port) == {"127.0.0.1"}


def test_every_shipped_webserver_start_is_loopback_or_published_on_loopback() -> None:
    starts = []
    for path in [REPO / "Makefile", *sorted((REPO / "eagle3_assets").rglob("*.py"))]:
        for line in path.read_text().splitlines():
            if STARTS_UI.search(line) and not line.lstrip().startswith(("#", "@echo")):
                starts.append((path.name, line))
                assert "127.0.0.1" in line and "0.0.0.0" not in line, (path, line)
    assert any(name == "Makefile" for name, _ in starts)

    # Containers listen on 0.0.0.0 inside; only the host's loopback may reach them.
    (cmd,) = [s.args for s in instructions(REPO / "Dockerfile") if s.keyword == "CMD"]
    assert "dagster-webserver" in cmd and "EXPOSE" in {
        s.keyword for s in instructions(REPO / "Dockerfile")
    }
    compose = yaml.safe_load((REPO / "deploy" / "docker-compose.yaml").read_text())
    published = {name: service.get("ports", []) for name, service in compose["services"].items()}
    assert published["webserver"] == ["127.0.0.1:3000:3000"]
    for name, ports in published.items():
        for port in ports:
            assert str(port).startswith("127.0.0.1:"), (name, port)  # nothing else is exposed

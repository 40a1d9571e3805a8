"""deploy/docker-compose.yaml without Docker: its wiring is consistent (one image, the Postgres
instance config mounted everywhere, secrets only from the environment, the workspace pointing
at the code service), the GPU override gives the GPUs and the `gpu` image to the code location
alone, and the code-server and webserver command lines, run as written on loopback, serve the
code location over gRPC."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

from eagle3_assets.localdev.processes import process_group
from eagle3_assets_tests.conftest import REPO, free_port
from eagle3_assets_tests.webserver import running_webserver

COMPOSE = yaml.safe_load((REPO / "deploy" / "docker-compose.yaml").read_text())
SERVICES = COMPOSE["services"]
GPU_OVERRIDE = yaml.safe_load((REPO / "deploy" / "docker-compose.gpu.yaml").read_text())
DAGSTER_SERVICES = ("init", "code", "webserver", "daemon")
GRPC_WORKSPACE = REPO / "deploy" / "workspace-grpc.yaml"

JOBS = """
{ repositoryOrError(repositorySelector: {repositoryLocationName: "eagle3_assets",
                                         repositoryName: "__repository__"}) {
    ... on Repository { jobs { name } } } }
"""


def test_wiring() -> None:
    assert set(SERVICES) == {"postgres", *DAGSTER_SERVICES}
    images = {SERVICES[name]["image"] for name in DAGSTER_SERVICES}
    assert len(images) == 1  # one image for every Dagster process
    for name in DAGSTER_SERVICES:
        service = SERVICES[name]
        assert service["build"] == {"context": "..", "dockerfile": "Dockerfile"}
        assert "./dagster-postgres.yaml:/opt/dagster/home/dagster.yaml:ro" in service["volumes"]
        assert service["environment"]["DAGSTER_PG_HOST"] == "postgres"
        for key, value in service["environment"].items():
            if re.search(r"PASSWORD|KEY|TOKEN", key):  # a value from the host, never literal
                assert re.fullmatch(r"\$\{\w+(:[?-][^}]*)?\}", str(value)), (name, key, value)
    assert "ports" not in SERVICES["postgres"]
    grpc = yaml.safe_load(GRPC_WORKSPACE.read_text())["load_from"][0]["grpc_server"]
    code = SERVICES["code"]["command"]
    assert grpc["host"] == "code" and str(grpc["port"]) == code[code.index("-p") + 1]
    assert grpc["location_name"] == code[code.index("--location-name") + 1]
    local = yaml.safe_load((REPO / "workspace.yaml").read_text())["load_from"][0]["python_module"]
    assert code[code.index("-m") + 1] == local["module_name"]
    assert grpc["location_name"] == local["location_name"]
    for name in ("webserver", "daemon"):
        command = SERVICES[name]["command"]
        assert command[command.index("-w") + 1] == "deploy/workspace-grpc.yaml"


def test_on_the_gpu_node_only_the_code_location_gets_gpus_and_the_gpu_image() -> None:
    """Runs execute in `code` (the default run launcher): it takes the node's GPUs, the
    Dockerfile's gpu target (the serving venv, EAGLE3_PLATFORM=cuda: test_dockerfile.py) with
    a CUDA torch; the webserver, daemon and init keep the CPU image and no GPU."""
    (name,) = GPU_OVERRIDE["services"]
    code = GPU_OVERRIDE["services"][name]
    assert name == "code"
    assert code["build"]["target"] == "gpu" and code["build"]["dockerfile"] == "Dockerfile"
    index = code["build"]["args"]["TORCH_INDEX"]
    assert re.fullmatch(
        r"\$\{EAGLE3_TORCH_INDEX:-https://download\.pytorch\.org/whl/cu\d+\}", index
    )
    assert code["image"] != SERVICES["code"]["image"]  # two images, never one tag for both
    (devices,) = code["deploy"]["resources"]["reservations"]["devices"]
    assert devices == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
    assert code["shm_size"]  # NCCL's shared memory between the ranks
    for other in ("init", "webserver", "daemon"):
        assert "target" not in SERVICES[other]["build"] and "deploy" not in SERVICES[other]


def wait_serving(process: subprocess.Popen, port: int, log: Path, timeout_s: float = 120) -> None:
    """Until the code server answers gRPC health checks (it loads the code first)."""
    from dagster._grpc.client import DagsterGrpcClient

    client = DagsterGrpcClient(port=port, host="127.0.0.1")
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, log.read_text()[-3000:]
        try:  # a plain connect first: gRPC logs every refused attempt
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            if client.health_check_query() == "SERVING":
                return
        except Exception:  # not listening or not serving yet
            pass
        assert time.monotonic() < deadline, f"code server not serving: {log}"
        time.sleep(0.5)


def test_code_server_and_webserver_commands_serve_the_location(
    dagster_home: Path, tmp_path: Path
) -> None:
    """The compose command lines with 0.0.0.0 -> 127.0.0.1 and free ports; `code` -> loopback."""
    code_port, ui_port = free_port(), free_port()
    command = SERVICES["code"]["command"]
    argv = [{"0.0.0.0": "127.0.0.1", "4000": str(code_port)}.get(arg, arg) for arg in command]
    argv[0] = str(Path(sys.executable).parent / argv[0])
    workspace = yaml.safe_load(GRPC_WORKSPACE.read_text())
    workspace["load_from"][0]["grpc_server"].update(host="127.0.0.1", port=code_port)
    (tmp_path / "workspace.yaml").write_text(yaml.safe_dump(workspace))
    env = {**os.environ, "DAGSTER_HOME": str(dagster_home)}
    with process_group(argv, env, tmp_path / "code.log") as code:
        wait_serving(code, code_port, tmp_path / "code.log")
        with running_webserver(
            dagster_home, {}, ui_port, tmp_path / "ui.log", workspace=tmp_path / "workspace.yaml"
        ) as server:
            jobs = {j["name"] for j in server.graphql(JOBS)["repositoryOrError"]["jobs"]}
        assert {"generate_batch", "launch"} <= jobs
        assert code.poll() is None  # the webserver talked to the running gRPC server

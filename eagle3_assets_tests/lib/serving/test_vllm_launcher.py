import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import stat
import sys
import time
from pathlib import Path

import pytest

from eagle3_assets.lib.serving import vllm_launcher
from eagle3_assets.lib.serving.vllm_launcher import (
    LaunchError,
    VLLMLaunchSpec,
    build_command,
    build_env,
    group_members,
    start,
    stop,
)
from eagle3_assets_tests.conftest import free_port

# Plays a vLLM API server: records how it was started, spawns "workers", and (like a
# wedged engine) ignores SIGTERM, so only the group SIGKILL can end it.
FAKE_SERVER = """#!/bin/bash
echo "$PATH" > path.txt
echo "$@" > argv.txt
env | sort > env.txt
trap '' TERM
touch trapped
sleep 600 &
sleep 600 &
bash -c 'sleep 600' &
wait
"""

# The vllm#55510 shape: the API server obeys SIGTERM, its worker does not.
WORKER_OUTLIVES_SERVER = """#!/bin/bash
bash -c "trap '' TERM; touch trapped; sleep 600" &
exec sleep 600
"""

# A server that obeys SIGTERM, as vLLM does (its group is stopped within the grace).
OBEYS_TERM = """#!/bin/bash
sleep 600 &
sleep 600 &
sleep 600 &
wait
"""


# A server that says it was stopped by SIGTERM (a shell cannot trap a signal ignored at its start).
SAYS_TERM = """#!/bin/bash
trap 'touch stopped-by-term; exit 0' TERM
touch trapped
sleep 600 &
wait
"""


def fake_venv(tmp_path: Path, script: str) -> Path:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(script)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.mark.parametrize("script", [FAKE_SERVER, WORKER_OUTLIVES_SERVER])
def test_stop_leaves_no_process_in_the_group(tmp_path, monkeypatch, script):
    sent: list[tuple[int, signal.Signals]] = []
    real_signal_group = vllm_launcher._signal_group

    def recorded(pgid: int, sig: signal.Signals) -> None:
        sent.append((pgid, sig))
        real_signal_group(pgid, sig)

    monkeypatch.setattr(vllm_launcher, "_signal_group", recorded)
    spec = VLLMLaunchSpec(
        model="m", python=fake_venv(tmp_path, script), run_dir=tmp_path / "run", port=free_port()
    )
    pgid = start(spec)
    assert spec.pid_file.read_text().strip() == str(pgid)
    wait_for(lambda: (spec.run_dir / "trapped").exists() and len(group_members(pgid)) >= 2)
    assert os.getpgid(pgid) == pgid != os.getpgid(0)  # its own group, not ours

    assert stop(spec.run_dir, grace_s=1.0) is True
    assert group_members(pgid) == []
    # a member ignores SIGTERM: after the grace the whole group got SIGKILL, nothing else
    assert sent == [(pgid, signal.SIGTERM), (pgid, signal.SIGKILL)]
    assert not spec.pid_file.exists()
    assert stop(spec.run_dir) is False  # idempotent


def test_child_gets_absolute_python_venv_path_and_no_key_on_argv(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sk-secret-for-test")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    spec = VLLMLaunchSpec(
        model="/models/target",
        python=Path("venv/bin/python"),  # relative on purpose
        run_dir=tmp_path / "run",
        port=free_port(),
        engine_ready_timeout_s=1500,
    )
    fake_venv(tmp_path, FAKE_SERVER)
    start(spec)
    try:
        wait_for(lambda: (spec.run_dir / "env.txt").exists())
        wait_for(lambda: "VLLM_ENGINE" in (spec.run_dir / "env.txt").read_text())
        path = (spec.run_dir / "path.txt").read_text().strip()
        env = (spec.run_dir / "env.txt").read_text()
        argv = json.loads((spec.run_dir / "launch.json").read_text())["argv"]
    finally:
        stop(spec.run_dir, grace_s=0.5)
    assert path.split(":")[0] == str(tmp_path / "venv" / "bin")
    assert argv[0] == str(tmp_path / "venv" / "bin" / "python")
    assert "VLLM_ENGINE_READY_TIMEOUT_S=1500" in env.splitlines()
    assert "VLLM_API_KEY=sk-secret-for-test" in env.splitlines()  # reaches vLLM by env...
    assert "sk-secret" not in " ".join(argv)  # ...never by argv (visible in ps and logs)
    assert "sk-secret" not in (spec.run_dir / "server.log").read_text()


def test_second_start_on_a_busy_port_is_refused(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        spec = VLLMLaunchSpec(
            model="m", python=fake_venv(tmp_path, FAKE_SERVER), run_dir=tmp_path / "r", port=port
        )
        with pytest.raises(LaunchError, match=f"port {port} on 127.0.0.1 is already in use"):
            start(spec)
    assert not spec.pid_file.exists()


def test_an_identical_server_left_in_the_run_dir_is_reused(tmp_path):
    spec = VLLMLaunchSpec(
        model="m", python=fake_venv(tmp_path, FAKE_SERVER), run_dir=tmp_path / "r", port=free_port()
    )
    pgid = start(spec)
    said: list[str] = []
    try:
        wait_for(lambda: len(group_members(pgid)) >= 4)
        members = sorted(group_members(pgid))
        assert start(spec, log=said.append) == pgid
        assert sorted(group_members(pgid)) == members  # nothing started, nothing stopped
        assert spec.log_file.read_text().count("\n=== ") == 1  # one launch in the log
    finally:
        stop(spec.run_dir, grace_s=0.5)
    assert said == [
        f"reusing the vLLM server (pid {pgid}) a previous attempt left running in {spec.run_dir}"
    ]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"max_model_len": 512}, r"its command differs \(was: .* --port \d+; now: .* 512\)"),
        ({"cpu_kvcache_gib": 2}, "its environment differs in VLLM_CPU_KVCACHE_SPACE$"),
        ({"extra_env": {"SECRET": "s3cr3t"}}, "its environment differs in SECRET$"),
        ({"launch_json": "gone"}, "no launch.json records how it was started$"),
    ],
)
def test_another_server_left_in_the_run_dir_is_stopped_then_replaced(tmp_path, change, why):
    old = VLLMLaunchSpec(
        model="m", python=fake_venv(tmp_path, OBEYS_TERM), run_dir=tmp_path / "r", port=free_port()
    )
    pgid = start(old)
    wait_for(lambda: len(group_members(pgid)) >= 4)
    if change.pop("launch_json", None):
        (old.run_dir / "launch.json").unlink()
    new = dataclasses.replace(old, **change)
    said: list[str] = []
    try:
        started = start(new, log=said.append)
        assert started != pgid and group_members(pgid) == []
        wait_for(lambda: len(group_members(started)) >= 4)
        assert new.pid_file.read_text().strip() == str(started)
        assert json.loads((new.run_dir / "launch.json").read_text())["pid"] == started
    finally:
        stop(new.run_dir, grace_s=0.5)
    assert group_members(started) == []
    (line,) = said
    prefix = f"stopping the vLLM server (pid {pgid}) a previous attempt left running in "
    assert line.startswith(prefix + f"{old.run_dir}: ")
    assert re.fullmatch(why, line.removeprefix(prefix + f"{old.run_dir}: ")), line
    assert "s3cr3t" not in (new.run_dir / "launch.json").read_text()  # hashed, never written


def test_a_server_started_by_a_process_ignoring_stop_signals_stops_on_sigterm(
    tmp_path, stop_signals_ignored
):
    """A nohup'd Dagster step starts its vLLM with SIGTERM ignored unless the launcher resets
    it: the server would outlive the grace and die by SIGKILL, never stopping cleanly."""
    spec = VLLMLaunchSpec(
        model="m", python=fake_venv(tmp_path, SAYS_TERM), run_dir=tmp_path / "r", port=free_port()
    )
    pgid = start(spec)
    wait_for(lambda: (spec.run_dir / "trapped").exists())
    assert stop(spec.run_dir, grace_s=10.0)
    assert (spec.run_dir / "stopped-by-term").exists()
    assert group_members(pgid) == []


def test_a_dead_server_left_in_the_run_dir_is_simply_replaced(tmp_path):
    spec = VLLMLaunchSpec(
        model="m", python=fake_venv(tmp_path, FAKE_SERVER), run_dir=tmp_path / "r", port=free_port()
    )
    pgid = start(spec)
    vllm_launcher.terminate_group(pgid, grace_s=0.1)  # its pid file stays: killed, not stopped
    said: list[str] = []
    started = start(spec, log=said.append)
    try:
        assert started != pgid and said == []
    finally:
        stop(spec.run_dir, grace_s=0.5)


def test_missing_interpreter_is_named(tmp_path):
    spec = VLLMLaunchSpec(
        model="m", python=tmp_path / "nope/bin/python", run_dir=tmp_path / "r", port=free_port()
    )
    with pytest.raises(LaunchError, match=r"serving interpreter not found: .*nope/bin/python"):
        start(spec)


def test_production_command_for_eight_gpus():
    spec = VLLMLaunchSpec(
        model="moonshotai/Kimi-K2.5",
        python=Path("/opt/vllm/bin/python"),
        run_dir=Path("/data/vllm"),
        host="0.0.0.0",
        port=8000,
        served_model_name="kimi-k2.5",
        tensor_parallel_size=8,
        max_model_len=8192,
        speculative_config={
            "method": "eagle3",
            "model": "/data/drafter",
            "num_speculative_tokens": 3,
        },
        trust_remote_code=True,
    )
    assert build_command(spec) == [
        "/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "moonshotai/Kimi-K2.5", "--host", "0.0.0.0", "--port", "8000",
        "--served-model-name", "kimi-k2.5", "--tensor-parallel-size", "8",
        "--max-model-len", "8192",
        "--speculative-config",
        '{"method": "eagle3", "model": "/data/drafter", "num_speculative_tokens": 3}',
        "--trust-remote-code",
    ]  # fmt: skip
    env = build_env(spec, {"PATH": "/usr/bin", "PYTHONPATH": "/project", "VLLM_API_KEY": "k"})
    assert env["PATH"] == "/opt/vllm/bin:/usr/bin"
    # the spec's own value reaches vLLM; by default more than Kimi-K2.5's ~22 min engine start
    # (vLLM's own 600 s default kills that start)
    assert env["VLLM_ENGINE_READY_TIMEOUT_S"] == str(spec.engine_ready_timeout_s)
    assert spec.engine_ready_timeout_s > 22 * 60
    assert env["VIRTUAL_ENV"] == "/opt/vllm"
    assert "PYTHONPATH" not in env and env["VLLM_API_KEY"] == "k"


def test_cli_prints_the_command(capsys):
    argv = [
        "command",
        "--model",
        "/m",
        "--python",
        "/v/bin/python",
        "--tensor-parallel-size",
        "8",
        "--speculative-config",
        '{"method": "eagle3"}',
        "--",
        "--gpu-memory-utilization",
        "0.9",
    ]
    assert vllm_launcher.main(argv) == 0
    printed = shlex.split(capsys.readouterr().out)
    assert printed[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert printed[-2:] == ["--gpu-memory-utilization", "0.9"]
    assert printed[printed.index("--speculative-config") + 1] == '{"method": "eagle3"}'
    assert printed[printed.index("--tensor-parallel-size") + 1] == "8"


def test_cli_start_reports_errors_without_a_traceback(tmp_path, capsys):
    argv = [
        "start",
        "--model",
        "/m",
        "--python",
        str(tmp_path / "none/python"),
        "--run-dir",
        str(tmp_path / "r"),
        "--port",
        str(free_port()),
    ]
    assert vllm_launcher.main(argv) == 1
    assert "error: serving interpreter not found" in capsys.readouterr().err
    assert sys.exc_info() == (None, None, None)


def test_launch_records_keep_the_spec_for_restarts_but_never_an_environment_value(tmp_path):
    spec = vllm_launcher.VLLMLaunchSpec(
        model="m",
        python=Path("/venv/bin/python"),
        run_dir=tmp_path,
        extra_args=("--enforce-eager",),
        speculative_config={"method": "eagle3", "model": "/d", "num_speculative_tokens": 3},
    )
    kept = json.loads(json.dumps(vllm_launcher.spec_to_json(spec)))
    assert vllm_launcher.spec_from_json(kept) == spec  # what a restart repeats

    secret = dataclasses.replace(spec, extra_env={"SECRET": "s3cr3t"})
    kept = vllm_launcher.spec_to_json(secret)
    assert kept["extra_env"] == ["SECRET"] and "s3cr3t" not in json.dumps(kept)
    with pytest.raises(vllm_launcher.LaunchError, match=r"variables \(SECRET\) whose values"):
        vllm_launcher.spec_from_json(kept)

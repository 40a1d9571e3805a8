"""Dagster's processes (daemon, webserver, code server) started as process groups we fully own:
a stop takes every child with it."""

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from eagle3_assets.lib.serving.vllm_launcher import start_group, terminate_group
from eagle3_assets.localdev.miniature import PROJECT_ROOT


@contextlib.contextmanager
def process_group(
    argv: list[str], env: dict[str, str], log_file: Path, cwd: Path = PROJECT_ROOT
) -> Iterator[subprocess.Popen]:
    """`argv` in its own session, output appended to `log_file`; on exit SIGINT to the whole
    group (a Dagster process takes it as a clean stop, its children too), SIGKILL after 20 s."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    process = start_group(argv, env, log_file, cwd)
    try:
        yield process
    finally:
        terminate_group(process.pid, grace_s=20.0, first=signal.SIGINT)


def running_daemon(
    dagster_home: Path,
    env: dict[str, str],
    log_file: Path,
    code: tuple[str, ...] = ("-w", str(PROJECT_ROOT / "workspace.yaml")),
) -> contextlib.AbstractContextManager[subprocess.Popen]:
    """`dagster-daemon run` on the project's workspace (or other `code`: `-m module`), with
    `env` and DAGSTER_HOME."""
    daemon = Path(sys.executable).parent / "dagster-daemon"
    return process_group(
        [str(daemon), "run", *code],
        {**os.environ, **env, "DAGSTER_HOME": str(dagster_home)},
        log_file,
    )

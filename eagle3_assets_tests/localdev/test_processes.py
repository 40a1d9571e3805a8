"""Dagster's processes, started as groups we own, stop cleanly on SIGINT whatever the test
process or the demo ignores."""

import os
import stat

from eagle3_assets.localdev.processes import process_group
from eagle3_assets_tests.deploy.helpers import wait_for

# Plays a Dagster process: a clean stop on SIGINT, which it says (a shell cannot trap a signal
# ignored at its start). The foreground sleep takes SIGINT too: background jobs ignore it.
SAYS_INT = """#!/bin/bash
trap 'touch stopped-by-int; exit 0' INT
touch trapped
sleep 600
"""


def test_a_group_started_while_sigint_is_ignored_stops_cleanly_on_sigint(
    tmp_path, stop_signals_ignored
):
    program = tmp_path / "dagster-process"
    program.write_text(SAYS_INT)
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "log"
    with process_group([str(program)], dict(os.environ), log, cwd=tmp_path):
        wait_for((tmp_path / "trapped").exists, 30, "trap set", log)
    assert (tmp_path / "stopped-by-int").exists()

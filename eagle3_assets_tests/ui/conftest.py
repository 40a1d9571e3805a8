"""The project's webserver and daemon on 127.0.0.1, and headless Chromium to drive them.

The browser is Debian's (`chromium`, installed by `make system-packages`), driven through
Playwright's Python API and its bundled node driver: no browser download. Screenshots and the
Dagster processes' logs land in EAGLE3_TEST_ARTIFACTS (default data/test-artifacts/ui/).
"""

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from eagle3_assets.localdev.processes import running_daemon
from eagle3_assets_tests.conftest import SMALL_DRAFTER, free_port
from eagle3_assets_tests.webserver import running_webserver

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("EAGLE3_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(os.environ.get("EAGLE3_TEST_ARTIFACTS", REPO / "data" / "test-artifacts" / "ui"))
POOLS = ("vllm", "gpu")  # the limits `make setup` sets with `dagster instance concurrency set`


@dataclass(frozen=True)
class DagsterUI:
    """A running webserver; the daemon starts when the test asks (after it set automation)."""

    url: str
    home: Path
    env: dict[str, str]

    def daemon(self) -> contextlib.AbstractContextManager[int]:
        return running_daemon(self.home, self.env, ARTIFACTS / "dagster-daemon.log")


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for pattern in ("[0-9][0-9]-*.png", "FAILED-*.png", "dagster-*.log"):  # ours, last time's
        for old in ARTIFACTS.glob(pattern):
            old.unlink()
    return ARTIFACTS


@pytest.fixture
def pipeline_env(pipeline_env: dict[str, str]) -> dict[str, str]:
    """The session's pipeline settings, with a drafter small enough to train and evaluate,
    and the evaluation's servers on a port of their own."""
    return {**pipeline_env, **SMALL_DRAFTER, "EAGLE3_EVAL_PORT": str(free_port())}


@pytest.fixture
def dagster_ui(pipeline_env, dagster_home, artifacts) -> Iterator[DagsterUI]:
    """The webserver on the project's workspace, pointed at the session's vLLM server and a
    fresh data root, over a fresh instance with the pool limits the Makefile sets."""
    with dg.DagsterInstance.get() as instance:
        for pool in POOLS:
            instance.event_log_storage.set_concurrency_slots(pool, 1)
    log = artifacts / "dagster-webserver.log"
    with running_webserver(dagster_home, pipeline_env, free_port(), log) as server:
        yield DagsterUI(server.url, dagster_home, pipeline_env)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture
def page(request, artifacts) -> Iterator[Page]:
    """A headless Chromium page with generous waits (a slow 2-core machine); a failing test
    leaves a screenshot of where it stopped."""
    if not CHROMIUM.exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: run `make system-packages` (Debian chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1200})
            page.set_default_timeout(60_000)
            expect.set_options(timeout=60_000)
            yield page
            report = getattr(request.node, "report_call", None)
            if report is not None and report.failed:
                page.screenshot(path=artifacts / f"FAILED-{request.node.name}.png")
        finally:
            browser.close()

"""The web UI as a person uses it, in headless Chromium against the real webserver and daemon
(and the session's real vLLM server): stop the automation so every run is the person's, read
the lineage, materialize the drafter checkpoint, backfill two sample batches, watch the runs
succeed, find the generation's progress lines in a run's logs, read a batch's metadata; then
extract, train and evaluate a drafter and read the result where a person reads it: the
drafter's loss and accuracy charts, the evaluation's before/after table, per-position chart and
serve line, each against what the instance recorded."""

import re
from dataclasses import dataclass

import dagster as dg
import pytest
from playwright.sync_api import Locator, Page, expect

from eagle3_assets.definitions import defs
from eagle3_assets.lib.generation.conversations import batch_key
from eagle3_assets_tests.ui.conftest import ARTIFACTS, DagsterUI

# A hang guard, not a speed bound: the whole pipeline, three evaluation servers, one core.
pytestmark = [pytest.mark.vllm, pytest.mark.ui, pytest.mark.timeout(1800)]

ROOT = "vllm_server"
RUN_S = 300_000  # ms: a run (or a backfill) from queued to done, on a loaded 2-core machine
EVALUATION_S = 900_000  # ms: drafter_evaluation starts three vLLM servers, one at a time


@dataclass(frozen=True)
class Expected:
    """What the code location defines, hence what the UI must show."""

    parents: dict[str, set[str]]  # vllm_server and everything downstream: upstream assets
    assets: list[str]  # every asset
    groups: list[str]  # every asset group
    automations: int  # sensors and schedules


def from_definitions() -> Expected:
    definitions = defs()
    graph = definitions.resolve_asset_graph()
    chain, todo = {dg.AssetKey(ROOT)}, [dg.AssetKey(ROOT)]
    while todo:
        for child in graph.get(todo.pop()).child_keys:
            if child not in chain:
                chain.add(child)
                todo.append(child)
    parents = {
        key.to_user_string(): {parent.to_user_string() for parent in graph.get(key).parent_keys}
        for key in chain
    }
    keys = graph.get_all_asset_keys()
    return Expected(
        parents=parents,
        assets=sorted(key.to_user_string() for key in keys),
        groups=sorted({graph.get(key).group_name for key in keys}),
        automations=len(list(definitions.sensors or [])) + len(list(definitions.schedules or [])),
    )


def draws(label: str, name: str) -> bool:
    """Whether a graph label shows `name`: at the zoom that fits the graph, long names are cut
    in the middle (synth…_generations)."""
    head, cut, tail = label.partition("…")
    if not cut:
        return label == name
    return name.startswith(head) and name.endswith(tail) and len(head) + len(tail) < len(name)


def shot(page: Page, name: str) -> None:
    page.screenshot(path=ARTIFACTS / f"{name}.png")


def button(scope: Page | Locator, text: str) -> Locator:
    """A button by its exact label (the accessible name also holds the icon's name)."""
    return scope.get_by_role("button").filter(has_text=re.compile(rf"^{re.escape(text)}$"))


def follow_toast_link(page: Page, ui: DagsterUI, message: str) -> str:
    """Wait for the toast saying `message` (a regex), open its View link; return the link."""
    view = page.get_by_role("link").filter(has_text=re.compile(r"^View$"))
    toast = page.locator("div").filter(has=page.get_by_text(re.compile(message))).filter(has=view)
    href = toast.last.locator(view).get_attribute("href")
    assert href
    page.goto(ui.url + href)
    return href


def run_outcome(page: Page) -> str:
    """The run page's status once the run has ended (it updates live)."""
    ended = page.get_by_text(re.compile(r"^(Success|Failure|Canceled)$")).first
    expect(ended).to_be_visible(timeout=RUN_S)
    return ended.inner_text()


def metadata_value(page: Page, key: str) -> str:
    """The value column of the asset's metadata table, in the row of `key`."""
    return metadata_row(page, key).get_by_role("cell").nth(2).inner_text().strip()


def metadata_row(page: Page, key: str) -> Locator:
    """The row of `key` in the asset's metadata table."""
    return page.get_by_role("row").filter(has=page.get_by_role("cell", name=key, exact=True))


def shown_table(page: Page, key: str) -> list[dict[str, str]]:
    """A table metadata value as the page draws it: one dict per row, by column header."""
    table = metadata_row(page, key).locator("table").first
    expect(table).to_be_visible()
    lines = [row.locator("th, td").all_inner_texts() for row in table.locator("tr").all()]
    header, *rows = [[cell.strip() for cell in line] for line in lines]
    return [dict(zip(header, row, strict=True)) for row in rows]


def shown_images(page: Page, key: str, alts: list[str]) -> list[str]:
    """The srcs of the images `alts` drawn by the markdown value of `key`: inline, or, when
    long, in the dialog its [Show Markdown] link opens (closed again afterwards)."""
    row = metadata_row(page, key)
    expect(row).to_be_visible()
    more = row.get_by_text("[Show Markdown]", exact=True)
    opened = more.count() > 0
    if opened:
        more.click()
    scope = page.get_by_role("dialog") if opened else row
    srcs = []
    for alt in alts:
        image = scope.get_by_role("img", name=alt, exact=True)
        expect(image).to_be_visible()
        srcs.append(image.get_attribute("src"))
    if opened:
        page.keyboard.press("Escape")
        expect(page.get_by_role("dialog")).to_have_count(0)
    return srcs


def backfill(page: Page, ui: DagsterUI, asset: str, keys: list[str]) -> None:
    """Launch a backfill of `keys` from the asset's page; wait until it succeeded."""
    page.goto(f"{ui.url}/assets/{asset}")
    button(page, "Materialize…").click()
    dialog = page.get_by_role("dialog").filter(has_text="Launch runs to materialize")
    dialog.get_by_text("Select a partition or create one").click()
    for key in keys:
        page.get_by_role("menuitem").filter(has_text=re.compile(rf"^{key}")).click()
    page.keyboard.press("Escape")  # closes the partition list, not the dialog
    expect(dialog).to_contain_text(f"{len(keys)} partitions")
    shot(page, f"05-backfill-dialog-{asset}")
    button(dialog, "Launch backfill").click()
    follow_toast_link(page, ui, r"^Created backfill [a-z]{8}$")
    status = page.get_by_text("Status", exact=True).locator("xpath=..")
    expect(status).to_have_text(re.compile("Succeeded|Failed|Canceled"), timeout=RUN_S)
    assert "Succeeded" in status.inner_text(), asset
    selection = page.get_by_text("Partition selection", exact=True).locator("xpath=..")
    assert sorted(re.findall(r"batch-\d{5}", selection.inner_text())) == keys


def materialize(page: Page, ui: DagsterUI, asset: str, timeout_ms: int = RUN_S) -> str:
    """Materialize an unpartitioned asset from its page; the run's id once it succeeded."""
    page.goto(f"{ui.url}/assets/{asset}")
    button(page, "Materialize").click()
    run_id = follow_toast_link(page, ui, r"^Launched run [0-9a-f]{8}$").split("/")[-1]
    ended = page.get_by_text(re.compile(r"^(Success|Failure|Canceled)$")).first
    expect(ended).to_be_visible(timeout=timeout_ms)
    assert ended.inner_text() == "Success", asset
    return run_id


def latest_metadata(instance: dg.DagsterInstance, asset: str) -> dict:
    """The latest materialization's metadata values, as the instance keeps them."""
    event = instance.get_latest_materialization_event(dg.AssetKey(asset))
    assert event is not None, asset
    return {k: v.value for k, v in event.asset_materialization.metadata.items()}


def test_a_person_runs_the_pipeline_from_the_web_ui(
    dagster_ui: DagsterUI, page: Page, pipeline_env: dict[str, str]
) -> None:
    ui = dagster_ui
    expected = from_definitions()
    parents, automations = expected.parents, expected.automations
    assert {"drafter_checkpoint", "synthetic_generations", "eagle3_drafter"} <= parents.keys()
    batch_size = int(pipeline_env["EAGLE3_BATCH_SIZE"])
    registered = [batch_key(i) for i in range(3)]  # what new_batches_sensor would register
    chosen = registered[:2]
    with dg.DagsterInstance.get() as instance:
        instance.add_dynamic_partitions("sample_batches", registered)

    # Automation off before the daemon starts: every run below is one the person launched.
    page.goto(ui.url + "/automation")
    expect(page.get_by_text("vllm_readiness_sensor", exact=True)).to_be_visible()
    page.get_by_text("Select all", exact=True).click()
    button(page, "Actions").click()
    stop_all = f"Stop {automations} automations"
    page.get_by_role("menuitem").filter(has_text=stop_all).click()
    confirm = page.get_by_role("dialog").filter(has_text="Stop automations")
    button(confirm, stop_all).click()
    expect(confirm).to_contain_text(f"Successfully stopped {automations} automations.")
    shot(page, "01-automation-stopped")
    button(confirm, "Done").click()

    with ui.daemon():
        # Lineage: the global asset graph, every group expanded, draws every asset ...
        page.goto(f"{ui.url}/asset-groups")
        page.get_by_role("button", name="settings", exact=True).click()
        page.get_by_role("menuitem").filter(has_text="Expand all groups").click()
        page.keyboard.press("Escape")
        drawn = page.locator("foreignObject").get_by_text(re.compile(r"^\w+(…\w+)?$"))
        expect(drawn.filter(visible=True)).to_have_count(len(expected.groups + expected.assets))
        labels = drawn.filter(visible=True).all_inner_texts()
        for group in expected.groups:
            labels.remove(group)  # a group's box is labelled with its name
        assert sorted(n for n in expected.assets for label in labels if draws(label, n)) == (
            expected.assets
        ), labels
        page.wait_for_timeout(1000)  # the graph's zoom animation
        shot(page, "02-lineage")
        # ... and each edge, as each asset's page lists its upstream assets.
        for name, upstream in sorted(parents.items()):
            if name == ROOT:
                continue
            page.goto(f"{ui.url}/assets/{name}")
            section = page.get_by_text("Upstream assets", exact=True).locator("xpath=..")
            links = section.get_by_role("link")
            expect(links).to_have_count(len(upstream))
            shown = {link.locator("[title]").first.get_attribute("title") for link in links.all()}
            assert shown == upstream, name
            shot(page, f"03-upstream-of-{name}")

        # Materialize the drafter checkpoint (an offline download from the local hub cache).
        page.goto(f"{ui.url}/assets/drafter_checkpoint")
        button(page, "Materialize").click()
        checkpoint_run = follow_toast_link(page, ui, r"^Launched run [0-9a-f]{8}$").split("/")[-1]
        assert run_outcome(page) == "Success"
        repo = pipeline_env["EAGLE3_DRAFTER_REPO"]
        page.get_by_placeholder("Filter…").fill("parameters, aux layers")
        expect(
            page.get_by_text(re.compile(rf"^{re.escape(repo)}@[0-9a-f]{{12}}: [\d,]+ parameters"))
        ).to_be_visible()
        shot(page, "04-checkpoint-run")

        # Backfill two of the three registered batches.
        backfill(page, ui, "synthetic_generations", chosen)
        shot(page, "06-backfill-succeeded")
        page.get_by_role("tab", name="Runs").click()
        runs = page.get_by_role("link").filter(has_text=re.compile(r"^[0-9a-f]{8}$"))
        expect(runs).to_have_count(len(chosen))
        expect(page.get_by_text("Success", exact=True)).to_have_count(len(chosen))
        shot(page, "07-backfill-runs")

        # A batch run's logs: the generation's progress reports, from the first to done.
        runs.first.click()
        assert run_outcome(page) == "Success"
        page.get_by_placeholder("Filter…").fill("done (")
        progress = page.get_by_text(re.compile(rf"^\d+/{batch_size} done \(0 resumed\)"))
        expect(progress.first).to_be_visible()
        lines = progress.all_inner_texts()
        assert len(lines) >= 2, lines
        assert lines[0].startswith(f"0/{batch_size} done (0 resumed), ")
        assert lines[-1].startswith(f"{batch_size}/{batch_size} done (0 resumed), 0 in flight")
        assert ", 0 failed, " in lines[-1]
        shot(page, "08-run-logs-progress")

        # The batch's metadata on the asset's page.
        page.goto(f"{ui.url}/assets/synthetic_generations")
        expect(page.get_by_role("cell", name="output_tokens_per_s", exact=True)).to_be_visible()
        latest = (
            page.locator("div")
            .filter(has=page.get_by_text("Latest materialization", exact=True))
            .filter(has_text=re.compile(r"batch-\d{5}"))
            .last  # the innermost: the status block with the batch tag
        )
        expect(latest).to_be_visible()
        (shown_batch,) = set(re.findall(r"batch-\d{5}", latest.inner_text()))
        samples = metadata_value(page, "samples")
        tokens_per_s = metadata_value(page, "output_tokens_per_s")
        shot(page, "09-generations-metadata")

        # The drafter: both batches' hidden states, the finetuning, its evaluation in vLLM.
        backfill(page, ui, "hidden_states", chosen)
        drafter_run = materialize(page, ui, "eagle3_drafter")
        page.goto(f"{ui.url}/assets/eagle3_drafter")
        expect(metadata_row(page, "steps")).to_be_visible()
        curves = shown_images(page, "curves", ["loss", "accuracy"])
        drafter_steps = metadata_value(page, "steps")
        drafter_export = metadata_value(page, "export")
        shot(page, "10-drafter-curves")
        evaluation_run = materialize(page, ui, "drafter_evaluation", EVALUATION_S)
        page.goto(f"{ui.url}/assets/drafter_evaluation")
        comparison = shown_table(page, "comparison")
        (chart,) = shown_images(
            page, "per_position_acceptance", ["per-position acceptance on held-out"]
        )
        headline = {
            key: metadata_value(page, key)
            for key in ("mean_acceptance_length", "mean_acceptance_length_warm_start", "speedup")
        }
        serve_with = metadata_value(page, "serve_with")
        shot(page, "11-evaluation")

    assert shown_batch in chosen
    assert samples == str(batch_size)
    # What the UI showed is what the instance recorded; nothing ran but what the person ran.
    with dg.DagsterInstance.get() as instance:
        key = dg.AssetKey("synthetic_generations")
        assert instance.get_materialized_partitions(key) == set(chosen)
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=key, asset_partitions=[shown_batch]), limit=1
        ).records
        recorded = records[0].asset_materialization.metadata
        checkpoint = instance.get_latest_materialization_event(dg.AssetKey("drafter_checkpoint"))
        all_runs = instance.get_runs()
        drafter, evaluation = (
            latest_metadata(instance, "eagle3_drafter"),
            latest_metadata(instance, "drafter_evaluation"),
        )
        drafter_event = instance.get_latest_materialization_event(dg.AssetKey("eagle3_drafter"))
        evaluation_event = instance.get_latest_materialization_event(
            dg.AssetKey("drafter_evaluation")
        )
    assert float(tokens_per_s) == recorded["output_tokens_per_s"].value
    assert int(samples) == recorded["samples"].value
    assert checkpoint is not None and checkpoint.run_id == checkpoint_run
    # the drafter's page showed its loss and accuracy charts, and its numbers
    assert curves == re.findall(r"\((data:image/svg\+xml;base64,[^)]+)\)", drafter["curves"])
    assert int(drafter_steps) == drafter["steps"] == 60
    assert drafter_export == drafter["export"]
    assert drafter_event.run_id == drafter_run
    # the evaluation's page: the before/after table as a table, the chart, the serve line
    records = [row.data for row in evaluation["comparison"].records]
    assert [row["server"] for row in comparison] == [row["server"] for row in records]
    assert len(comparison) == 3  # held-out: without drafter, warm start, finetuned
    for shown, kept in zip(comparison, records, strict=True):
        assert (
            shown["prompt set"] == kept["prompt set"] and int(shown["prompts"]) == kept["prompts"]
        )
        for column in ("mean acceptance length", "output tokens/s", "speedup"):
            assert float(shown[column]) == kept[column], column
        rate, shown_rate = kept["acceptance rate"], shown["acceptance rate"]
        assert shown_rate == "" if rate is None else float(shown_rate) == rate
        assert shown["per position"] == kept["per position"]
    assert [chart] == re.findall(
        r"\((data:image/svg\+xml;base64,[^)]+)\)", evaluation["per_position_acceptance"]
    )
    assert {key: float(value) for key, value in headline.items()} == {
        key: evaluation[key] for key in headline
    }
    assert serve_with == evaluation["serve_with"]
    assert f'--speculative-config \'{{"method": "eagle3", "model": "{drafter_export}"' in (
        serve_with
    )
    assert evaluation_event.run_id == evaluation_run
    # every run is one the person launched: checkpoint, two backfills, drafter, evaluation
    assert len(all_runs) == 1 + 2 * len(chosen) + 2
    assert all(run.status == dg.DagsterRunStatus.SUCCESS for run in all_runs)
    automated = {"dagster/sensor_name", "dagster/schedule_name"}
    assert not [run.run_id for run in all_runs if automated & run.tags.keys()]
    assert len([run for run in all_runs if run.tags.get("dagster/backfill")]) == 2 * len(chosen)

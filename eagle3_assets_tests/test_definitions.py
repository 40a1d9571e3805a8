import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg

from eagle3_assets.definitions import defs

REPO = Path(__file__).resolve().parents[1]


def test_definitions_load_with_the_expected_graph():
    definitions = defs()
    dg.Definitions.validate_loadable(definitions)
    graph = definitions.resolve_asset_graph()
    keys = {key.to_user_string() for key in graph.get_all_asset_keys()}
    assert keys == {
        "vllm_server",
        "served_target",
        "drafter_checkpoint",
        "synthetic_generations",
        "hidden_states",
        "eagle3_drafter",
        "drafter_evaluation",
        "promoted_drafter",
        "served_drafter",
    }
    assert graph.get(dg.AssetKey("promoted_drafter")).parent_keys == {
        dg.AssetKey("drafter_evaluation")
    }
    assert graph.get(dg.AssetKey("served_drafter")).parent_keys == {dg.AssetKey("promoted_drafter")}
    assert definitions.resolve_job_def(
        "serve_promoted_drafter"
    ).asset_layer.selected_asset_keys == {dg.AssetKey("served_drafter")}
    window = definitions.resolve_schedule_def("serving_maintenance_schedule")
    assert (window.cron_schedule, window.job_name) == ("0 3 * * *", "serve_promoted_drafter")
    assert graph.get(dg.AssetKey("eagle3_drafter")).parent_keys == {
        dg.AssetKey("drafter_checkpoint"),
        dg.AssetKey("hidden_states"),
    }
    hidden_states = graph.get(dg.AssetKey("hidden_states"))
    assert hidden_states.parent_keys == {
        dg.AssetKey("synthetic_generations"),
        dg.AssetKey("drafter_checkpoint"),
    }
    assert (
        hidden_states.partitions_def
        == graph.get(dg.AssetKey("synthetic_generations")).partitions_def
    )
    assert graph.get(dg.AssetKey("drafter_evaluation")).parent_keys == {
        dg.AssetKey("eagle3_drafter"),
        dg.AssetKey("drafter_checkpoint"),
    }
    automation = definitions.resolve_sensor_def("drafter_automation")
    assert automation.default_status == dg.DefaultSensorStatus.STOPPED  # opt-in
    automated = {"hidden_states", "eagle3_drafter", "drafter_evaluation"}
    assert {key.to_user_string() for key in automation.asset_selection.resolve(graph)} == automated
    for key in automated | {"promoted_drafter"}:
        assert graph.get(dg.AssetKey(key)).automation_condition is not None
    promotion = definitions.resolve_sensor_def("promotion_automation")
    assert promotion.default_status == dg.DefaultSensorStatus.STOPPED  # with the drafter steps
    assert promotion.asset_selection.resolve(graph) == {dg.AssetKey("promoted_drafter")}
    # a refusal fails the run (its check is blocking) and is not run again; a dead worker is
    assert promotion.run_tags == {"dagster/retry_on_asset_or_op_failure": "false"}
    assert not graph.get(dg.AssetKey("vllm_server")).is_materializable  # external: observed only
    assert graph.get(dg.AssetKey("served_target")).parent_keys == {dg.AssetKey("vllm_server")}
    assert definitions.resolve_job_def("launch").asset_layer.selected_asset_keys == {
        dg.AssetKey("drafter_checkpoint"),
        dg.AssetKey("synthetic_generations"),
    }
    sensor = definitions.resolve_sensor_def("vllm_readiness_sensor")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    assert sensor.job_name == "launch"


def test_dg_check_defs_passes(dagster_home):
    dg_cli = Path(sys.executable).parent / "dg"
    result = subprocess.run(
        [str(dg_cli), "check", "defs"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All definitions loaded successfully" in result.stdout + result.stderr


GRAPH_IN_A_FRESH_PROCESS = """
import json
import dagster as dg
from eagle3_assets.definitions import defs
definitions = defs()
graph = definitions.resolve_asset_graph()
drafter = graph.get(dg.AssetKey("eagle3_drafter"))
automation = definitions.resolve_sensor_def("drafter_automation")
print(json.dumps({
    "parents": sorted(k.to_user_string() for k in drafter.parent_keys),
    "automated": sorted(k.to_user_string() for k in automation.asset_selection.resolve(graph)),
    "description": drafter.description,
}))
"""


def test_streamed_mode_makes_the_drafter_depend_on_the_generations(tmp_path):
    """The mode is read when the code location loads (a fresh process, as Dagster loads it):
    streamed, the drafter reads the generations and automation never stores hidden states;
    a bad value fails the load naming the variable."""

    def load(mode: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "EAGLE3_HIDDEN_STATES_MODE": mode, "DAGSTER_HOME": str(tmp_path)}
        command = [sys.executable, "-c", GRAPH_IN_A_FRESH_PROCESS]
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)

    streamed = json.loads(load("streamed").stdout)
    assert streamed["parents"] == ["drafter_checkpoint", "synthetic_generations"]
    assert streamed["automated"] == ["drafter_evaluation", "eagle3_drafter"]
    assert streamed["description"].endswith(
        "Hidden states streamed: extracted from every batch of generations while it trains, "
        "at most EAGLE3_STREAM_WINDOW_MB on disk."
    )
    stored = json.loads(load("stored").stdout)
    assert stored["parents"] == ["drafter_checkpoint", "hidden_states"]
    assert stored["automated"] == ["drafter_evaluation", "eagle3_drafter", "hidden_states"]
    bad = load("lazy")
    assert bad.returncode != 0
    assert "EAGLE3_HIDDEN_STATES_MODE: expected 'stored' or 'streamed', found 'lazy'" in bad.stderr

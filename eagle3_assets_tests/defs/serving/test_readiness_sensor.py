"""The readiness sensor against a fault-injecting server: the edges real vLLM can't show."""

import json

import dagster as dg
import pytest

from eagle3_assets.defs.serving.resources import VLLMServer
from eagle3_assets.defs.serving.sensors import vllm_readiness_sensor
from eagle3_assets_tests.fault_server import FaultServer, closed_port_url

MODEL = "tiny-target"


class Ticker:
    """Evaluates successive sensor ticks the way the daemon does: cursor carried over."""

    def __init__(self, instance: dg.DagsterInstance, vllm: VLLMServer) -> None:
        self.instance, self.vllm, self.cursor = instance, vllm, None

    def tick(self) -> dg.SensorResult:
        context = dg.build_sensor_context(
            instance=self.instance, cursor=self.cursor, resources={"vllm": self.vllm}
        )
        result = vllm_readiness_sensor(context)
        self.cursor = result.cursor
        return result


@pytest.fixture
def instance():
    with dg.instance_for_test() as instance:
        yield instance


def states(result: dg.SensorResult) -> list[str]:
    return [event.metadata["state"].value for event in result.asset_events]


def test_wrong_model_never_launches(instance):
    with FaultServer() as server:
        server.behaviour.models = ["some-other-model"]
        ticker = Ticker(instance, VLLMServer(base_urls=[server.base_url], served_model_name=MODEL))
        first = ticker.tick()
        assert states(first) == ["wrong_model"]
        assert "expected 'tiny-target'" in first.asset_events[0].metadata["detail"].value
        assert first.run_requests == []
        assert ticker.tick().asset_events == []  # unchanged: nothing new to record


def test_unhealthy_then_healthy_launches_once_per_server_start(instance):
    with FaultServer() as server:
        server.behaviour.health_status = 503
        ticker = Ticker(instance, VLLMServer(base_urls=[server.base_url], served_model_name=MODEL))
        assert states(ticker.tick()) == ["dead"]
        server.behaviour.health_status = 200
        ready = ticker.tick()
        assert states(ready) == ["ready"]
        metadata = ready.asset_events[0].metadata
        assert metadata["max_model_len"].value == 512
        assert metadata["vllm_version"].value == "0.0.fault"
        assert metadata["instance_id"].value == f"{server.base_url}@1700000000"
        (launch,) = ready.run_requests
        assert launch.partition_key == "batch-00000"  # registered in the same tick:
        assert [list(r.partition_keys) for r in ready.dynamic_partitions_requests] == [
            ["batch-00000"]
        ]
        run_key = launch.run_key
        assert ticker.tick().run_requests == []
        # The same process answering 503 and recovering is still the same start: no relaunch.
        server.behaviour.health_status = 503
        assert states(ticker.tick()) == ["dead"]
        server.behaviour.health_status = 200
        assert ticker.tick().run_requests == []
        # A restart (new process start time) is a new server start: one new launch.
        server.behaviour.start_time += 60
        server.behaviour.health_status = 503
        ticker.tick()
        server.behaviour.health_status = 200
        relaunch = ticker.tick().run_requests
        assert len(relaunch) == 1 and relaunch[0].run_key != run_key


def test_stalled_server_is_unresponsive_not_dead(instance):
    with FaultServer() as server:
        server.behaviour.delay_s = 1.0
        vllm = VLLMServer(base_urls=[server.base_url], served_model_name=MODEL, probe_timeout_s=0.2)
        result = Ticker(instance, vllm).tick()
        assert states(result) == ["unresponsive"]
        assert result.run_requests == []


def test_loading_deadline_overrun_is_reported(instance):
    url = closed_port_url()  # connections refused, as while vLLM loads
    vllm = VLLMServer(base_urls=[url], served_model_name=MODEL, load_deadline_s=0.0)
    ticker = Ticker(instance, vllm)
    first = ticker.tick()
    assert states(first) == ["loading"]
    cursor = json.loads(ticker.cursor)
    cursor["servers"][url]["loading_since"] -= 5  # five seconds of loading
    ticker.cursor = json.dumps(cursor)
    late = ticker.tick()
    assert states(late) == ["loading"]
    assert late.asset_events[0].metadata["overdue"].value is True
    assert late.asset_events[0].metadata["loading_for_s"].value >= 5
    assert ticker.tick().asset_events == []  # reported once


def test_replicas_launch_when_all_are_ready(instance):
    with FaultServer() as a, FaultServer() as b:
        b.behaviour.health_status = 503
        vllm = VLLMServer(base_urls=[a.base_url, b.base_url], served_model_name=MODEL)
        ticker = Ticker(instance, vllm)
        partial = ticker.tick()
        assert sorted(states(partial)) == ["dead", "ready"]
        assert partial.run_requests == []
        b.behaviour.health_status = 200
        full = ticker.tick()
        assert states(full) == ["ready"]  # only b changed
        assert len(full.run_requests) == 1
        tags = full.run_requests[0].tags["eagle3/server_instances"]
        assert a.base_url in tags and b.base_url in tags


def test_launch_takes_the_next_pending_batch_or_only_the_download(instance):
    instance.add_dynamic_partitions("sample_batches", ["batch-00000", "batch-00001"])
    instance.report_runless_asset_event(
        dg.AssetMaterialization(asset_key="synthetic_generations", partition="batch-00000")
    )
    with FaultServer() as server:
        ticker = Ticker(instance, VLLMServer(base_urls=[server.base_url], served_model_name=MODEL))
        (launch,) = ticker.tick().run_requests
        assert launch.partition_key == "batch-00001"
        instance.report_runless_asset_event(
            dg.AssetMaterialization(asset_key="synthetic_generations", partition="batch-00001")
        )
        server.behaviour.start_time += 1  # a restarted server: a new launch
        server.behaviour.health_status = 503
        ticker.tick()
        server.behaviour.health_status = 200
        (download_only,) = ticker.tick().run_requests
        assert download_only.partition_key is None
        assert download_only.asset_selection == [dg.AssetKey("drafter_checkpoint")]

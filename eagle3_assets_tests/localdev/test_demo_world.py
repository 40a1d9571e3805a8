"""`make demo WORLD=...`: one data directory holds the story of one world."""

import json

from eagle3_assets.localdev.demo import DEMO_WORLDS, claim_data, write_traffic
from eagle3_assets.localdev.prompts import DATA_MODEL_TOPICS
from eagle3_assets.localdev.world import SIZES


def test_the_demo_worlds_are_built_worlds():
    assert DEMO_WORLDS == {"kimi": "kimi-demo", "llama": "demo"}
    assert SIZES["kimi-demo"].family == "kimi" and SIZES["demo"].family == "llama"


def test_a_data_directory_refuses_another_worlds_story(tmp_path):
    data = tmp_path / "data"
    assert claim_data(data, "kimi-demo") is None  # fresh: claimed
    assert claim_data(data, "kimi-demo") is None  # the same world resumes
    assert claim_data(data, "demo") == "kimi-demo"  # another world is refused, by name
    assert (data / "demo-world").read_text() == "kimi-demo\n"  # and the claim is unchanged


def test_the_second_act_brings_a_kind_of_prompt_the_first_never_asked(test_world, tmp_path):
    """The demo's traffic: the first act's pool holds no data-model question; the two inbox
    files hold only those, none of them in the fixed held-out set (it asks both kinds from the
    start, so the served acceptance on the new kind is measured on prompts never trained on);
    and nothing of the world's pool is lost."""
    traffic = write_traffic(test_world, tmp_path / "traffic", tmp_path / "inbox")
    rows = {path.name: read(path) for path in (traffic.pool, *traffic.arrivals)}
    pool, first, second = rows.values()
    heldout = read(test_world.heldout_prompts)
    assert {r["source"] for r in first + second} <= DATA_MODEL_TOPICS
    assert not {r["source"] for r in pool} & DATA_MODEL_TOPICS
    assert len(first) == (len(first) + len(second)) * 3 // 4
    ids = [r["prompt_id"] for r in pool + first + second]
    assert len(ids) == len(set(ids))  # each prompt once
    assert {r["prompt_id"] for r in read(test_world.prompts)} <= set(ids)
    assert not set(ids) & {r["prompt_id"] for r in heldout}
    assert traffic.of_the_new_kind == [
        r["messages"] for r in heldout if r["source"] in DATA_MODEL_TOPICS
    ]
    before = {name: (tmp_path / "traffic" / name).stat().st_mtime_ns for name in rows}
    write_traffic(test_world, tmp_path / "traffic", tmp_path / "inbox")  # the demo again
    after = {name: (tmp_path / "traffic" / name).stat().st_mtime_ns for name in rows}
    assert after == before  # the same bytes are not written again


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]

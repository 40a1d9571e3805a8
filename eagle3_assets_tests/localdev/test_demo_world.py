"""`make demo WORLD=...`: one data directory holds the story of one world."""

from eagle3_assets.localdev.demo import DEMO_WORLDS, claim_data
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

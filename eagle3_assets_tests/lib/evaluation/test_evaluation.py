"""The evaluation's arithmetic and verdicts on hand-made counter deltas (real vLLM numbers:
defs/evaluation/test_whole_graph.py)."""

import json
import shlex
from pathlib import Path

import pytest

from eagle3_assets.definitions import resources_from_env
from eagle3_assets.lib.evaluation.acceptance import Acceptance
from eagle3_assets.lib.evaluation.evaluate import (
    BASELINE,
    COMPARISON_COLUMNS,
    Contender,
    Measurement,
    comparison_rows,
    comparison_table,
    per_position_chart,
    served_aux_layers,
    serving_spec,
    speedup,
    verdict,
)
from eagle3_assets.lib.evaluation.settings import EvaluationSettings
from eagle3_assets.lib.serving.vllm_launcher import VLLMLaunchSpec, build_command, serve_line

LAYERS = (2, 4, 5)


def measured(name: str, drafts: float, accepted: list[float], tokens: float, seconds: float = 10):
    counted = Acceptance(
        drafts=drafts,
        draft_tokens=3 * drafts,
        accepted=sum(accepted),
        accepted_per_position=accepted,
        output_tokens=tokens,
        seconds=seconds,
    )
    layers = None if name == BASELINE else LAYERS
    return Measurement(name, "held-out", 5, counted, layers)


@pytest.fixture
def measurements() -> list[Measurement]:
    return [
        measured(BASELINE, 0, [], 1000),
        measured("warm start", 100, [20, 5, 1], 800),
        measured("finetuned", 100, [60, 30, 10], 1500),
    ]


def test_rates_lengths_and_speedup(measurements):
    baseline, _, finetuned = measurements
    assert finetuned.acceptance.mean_length == pytest.approx(2.0)  # 1 + 100 / 100
    assert finetuned.acceptance.per_position == [0.6, 0.3, 0.1]
    assert finetuned.acceptance_rate == pytest.approx(100 / 300)
    assert finetuned.tokens_per_s == 150 and baseline.tokens_per_s == 100
    assert speedup(measurements, "finetuned", "held-out") == pytest.approx(1.5)
    assert speedup(measurements, "warm start", "held-out") == pytest.approx(0.8)


def test_table_has_a_row_per_server_with_its_numbers(measurements):
    rows = comparison_rows(measurements)
    assert [tuple(row) for row in rows] == [tuple(COMPARISON_COLUMNS)] * 3
    assert rows[0] == {
        "prompt set": "held-out",
        "server": "without drafter",
        "prompts": 5,
        "mean acceptance length": 1.0,
        "acceptance rate": None,
        "per position": "",
        "output tokens/s": 100.0,
        "speedup": 1.0,
    }
    assert rows[2]["per position"] == "0.600, 0.300, 0.100"
    assert (rows[2]["acceptance rate"], rows[2]["speedup"]) == (0.333, 1.5)
    # the terminal's markdown (the demo prints it) keeps its digits
    lines = comparison_table(rows).splitlines()
    assert len(lines) == 2 + 3
    assert lines[0] == (
        "| prompt set | server | prompts | mean acceptance length | acceptance rate "
        "| per position | output tokens/s | speedup |"
    )
    assert lines[2] == "| held-out | without drafter | 5 | 1.000 | - | - | 100.0 | 1.00x |"
    assert lines[4] == (
        "| held-out | finetuned | 5 | 2.000 | 0.333 | 0.600, 0.300, 0.100 | 150.0 | 1.50x |"
    )
    chart = per_position_chart(measurements, "held-out")
    assert chart.startswith("![per-position acceptance on held-out](data:image/svg+xml;base64,")


def test_verdicts(measurements):
    _, warm, finetuned = measurements
    assert verdict(warm, finetuned, LAYERS, 0.05) is None
    assert "does not beat the warm start" in verdict(finetuned, warm, LAYERS, 0.05)
    wrong = Measurement(**{**finetuned.__dict__, "aux_layers": (0, 1, 3)})
    assert "layers [0, 1, 3], it was trained on [2, 4, 5]" in verdict(warm, wrong, LAYERS, 0.05)
    near_zero = measured("finetuned", 100, [2, 0, 0], 900)
    assert "near zero" in verdict(warm, near_zero, LAYERS, 0.05)
    silent = measured("finetuned", 0, [], 900)
    assert "no drafts" in verdict(warm, silent, LAYERS, 0.05)


def test_the_layers_fed_to_the_drafter_come_from_vllms_last_start_or_its_config(tmp_path: Path):
    log = tmp_path / "server.log"
    log.write_text(
        "(Worker pid=1) INFO [gpu_model_runner.py:5243] Using auxiliary layers from speculative "
        "config: (2, 4, 5)\n=== restart\n(Worker pid=2) INFO Using auxiliary layers from "
        "speculative config: (0, 1, 3)\n"
    )
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}')
    assert served_aux_layers(log, drafter) == (0, 1, 3)
    log.write_text("no such line\n")  # a vLLM that does not say: the ids it reads
    assert served_aux_layers(log, drafter) == (2, 4, 5)


def test_prompt_sets_come_by_name_and_a_bad_item_is_named():
    env = {"EAGLE3_EVAL_PROMPT_SETS": "mt-bench=/p/mt.jsonl, gsm8k=hf://datasets/o/g/t.jsonl"}
    evaluation = resources_from_env(env)["evaluation"]
    assert evaluation.prompt_sets == {
        "mt-bench": "/p/mt.jsonl",
        "gsm8k": "hf://datasets/o/g/t.jsonl",
    }
    with pytest.raises(
        ValueError, match=r"EAGLE3_EVAL_PROMPT_SETS: expected name=path items.*'humaneval'"
    ):
        resources_from_env({"EAGLE3_EVAL_PROMPT_SETS": "mt-bench=/p/mt.jsonl,humaneval"})


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_the_serve_line_serves_the_drafter_as_it_was_measured(tmp_path: Path, trust_remote_code):
    """The same drafter config as the measured server, and the target's code trusted exactly
    when the measurement trusted it (Kimi's tokenizer is remote code: without the flag the
    printed line would not start)."""
    spec = VLLMLaunchSpec(
        model="/m/target",
        python=Path("/v/bin/python"),
        run_dir=tmp_path,
        trust_remote_code=trust_remote_code,
    )
    settings = EvaluationSettings(num_speculative_tokens=5)
    served = serving_spec(spec, Contender("finetuned", Path("/d/export")), settings)
    line = serve_line(
        "/m/target", Path("/d/export"), settings.num_speculative_tokens, trust_remote_code
    )
    command, _, rest = line.partition(" --speculative-config ")
    config, *flags = shlex.split(rest)
    assert command == "vllm serve /m/target"
    assert (
        json.loads(config)
        == served.speculative_config
        == {
            "method": "eagle3",
            "model": "/d/export",
            "num_speculative_tokens": 5,
        }
    )
    assert flags == (["--trust-remote-code"] if trust_remote_code else [])
    assert ("--trust-remote-code" in build_command(served)) == trust_remote_code

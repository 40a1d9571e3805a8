"""trust_remote_code reaches every step that loads the target or its tokenizer once the user
sets EAGLE3_TRUST_REMOTE_CODE, and nowhere otherwise. The target's tokenizer here loads ONLY
with trust_remote_code (a class in a module inside the folder, mapped by auto_map, as Kimi's
tokenization_kimi.py), with Kimi's chat template, whose default is thinking mode.

Each step goes through the code the pipeline runs, from the resources the environment
configures: the tokenizer both hidden_states and drafter_evaluation load
(`TargetModel.tokenizer`), the sequences extraction builds with it (through the rendering
check the evaluation shares), and the vLLM command lines of the extraction server, the
evaluation servers and the serve line the evaluation reports. No server starts here; real
vLLM servers get the flag in lib/hidden_states/test_mla_extraction_parity.py (the extraction
server, through open_backend) and lib/serving/test_eagle3_on_mla.py, and
localdev/test_world_kimi.py shows the serving venv refusing the tokenizer untrusted.
"""

import shlex
from pathlib import Path

import pytest

from eagle3_assets.definitions import resources_from_env
from eagle3_assets.lib.evaluation.evaluate import Contender, serving_spec
from eagle3_assets.lib.hidden_states.backends import extraction_spec
from eagle3_assets.lib.hidden_states.token_sequences import (
    TemplateMismatchError,
    build_sequences,
)
from eagle3_assets.lib.serving.vllm_launcher import build_command, serve_line
from eagle3_assets.localdev.greedy import greedy_generation_rows

FLAG = "--trust-remote-code"


@pytest.fixture(scope="module")
def target(kimi_world) -> Path:
    return kimi_world.target_v2


def resources(target: Path, trust: bool) -> dict:
    env = {"EAGLE3_TARGET_PATH": str(target), "EAGLE3_HIDDEN_BACKEND": "vllm"}
    return resources_from_env({**env, "EAGLE3_TRUST_REMOTE_CODE": "1"} if trust else env)


def test_off_the_tokenizer_is_refused_naming_the_setting_and_no_command_trusts(target, tmp_path):
    configured = resources(target, trust=False)
    assert configured["target"].trust_remote_code is False  # the default: never implied
    with pytest.raises(ValueError) as refused:
        configured["target"].tokenizer()
    assert str(refused.value) == (
        f"EAGLE3_TRUST_REMOTE_CODE: expected 1 to load the target's tokenizer in {target}, "
        "which is code shipped with the target (auto_map), found it off; set it only if you "
        "trust that code"
    )
    assert "trust_remote_code=True" in str(refused.value.__cause__)  # transformers' own word
    for command in commands(configured, tmp_path):
        assert FLAG not in command


def test_on_every_step_loads_and_renders_with_the_targets_code(kimi_world, target, tmp_path):
    configured = resources(target, trust=True)
    tokenizer = configured["target"].tokenizer()
    assert type(tokenizer).__name__ == "KimiMiniTokenizer"  # the folder's class, not a built-in
    assert type(tokenizer).__module__.endswith("tokenization_kimi_mini")

    # extraction: the sequences of the target's greedy answers in instant mode, rendered as
    # generation asks the server to (the world's kwargs)
    kwargs = kimi_world.spec.chat_template_kwargs
    assert kwargs == {"thinking": False}
    rows = greedy_generation_rows(
        target, kimi_world.prompts, 3, 8, chat_template_kwargs=kwargs, trust_remote_code=True
    )
    assert tokenizer.decode(rows[0]["prompt_token_ids"]).endswith("<|im_middle|><think></think>")
    sequences = build_sequences(rows, tokenizer, kwargs)
    assert [s.input_ids.tolist() for s in sequences] == [
        [*r["prompt_token_ids"], *r["token_ids"]] for r in rows
    ]
    # the template's default is thinking mode: extraction without the kwargs is refused
    with pytest.raises(TemplateMismatchError) as mismatch:
        build_sequences(rows, tokenizer)
    assert str(mismatch.value).splitlines()[1:3] == [
        "  vLLM rendered:               '</think>'",  # instant mode: the think block closed
        "  the local template rendered: ''",  # thinking mode: left open
    ]

    for command in commands(configured, tmp_path):
        assert command.count(FLAG) == 1


def commands(configured: dict, run_dir: Path) -> list[list[str]]:
    """Every vLLM command line the pipeline builds for the target: the extraction server, the
    evaluation servers (the plain one and one with a drafter) and the serve line the
    evaluation reports."""
    target = configured["target"]
    extraction = extraction_spec(
        configured["hidden"], "cpu", target.path, target.trust_remote_code, run_dir
    )
    recipe = configured["evaluation"]
    evaluation = recipe.launch_spec(target, run_dir, "kimi")
    drafter = serving_spec(
        evaluation, Contender("finetuned", run_dir / "export"), recipe.settings(None)
    )
    line = serve_line(target.path, run_dir / "export", 3, target.trust_remote_code)
    return [*map(build_command, (extraction, evaluation, drafter)), shlex.split(line)]

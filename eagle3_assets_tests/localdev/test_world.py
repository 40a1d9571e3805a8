"""The test-size miniature world, built once for this module: what later stages rely on."""

import json
import math
import re
import string
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM

from eagle3_assets.lib.generation.conversations import prompt_id_for
from eagle3_assets.localdev import targets
from eagle3_assets.localdev import world as world_module
from eagle3_assets.localdev.prompts import HELDOUT_EVERY, candidate_conversations, topics
from eagle3_assets.localdev.world import SIZES, World, build_world
from eagle3_assets_tests.templates import CONVERSATION

SPECIAL_IDS = {"<|system|>": 0, "<|user|>": 1, "<|assistant|>": 2, "<|end|>": 3, "<|pad|>": 4}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world(tmp_path_factory.mktemp("world"), "test", log=lambda _: None)


@pytest.fixture(scope="module")
def tokenizer(world: World):
    return AutoTokenizer.from_pretrained(world.tokenizer)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_special_tokens_have_fixed_ids(tokenizer) -> None:
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_IDS)) == list(SPECIAL_IDS.values())
    assert tokenizer.eos_token == "<|end|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.bos_token is None
    assert len(tokenizer) == SIZES["test"].vocab_size


def test_tokenizer_round_trips_any_text(tokenizer) -> None:
    text = topics()["for"] + "\n\tnaïve café — 你好 🙂  two  spaces\n"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode()) / 2  # the merges compress English text


def test_chat_template_renders_exactly(tokenizer) -> None:
    messages = CONVERSATION
    expected = (
        "<|system|>\nBe brief.<|end|>\n"
        "<|user|>\nWhat is a loop?<|end|>\n"
        "<|assistant|>\nA repeated block.<|end|>\n"
        '<|user|>\nAnd "for"?<|end|>\n'
    )
    render = tokenizer.apply_chat_template
    assert render(messages, tokenize=False) == expected
    prompt = render(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == expected + "<|assistant|>\n"
    ids = tokenizer.encode(prompt)
    assert ids[0] == SPECIAL_IDS["<|system|>"]  # no BOS
    assert ids.count(SPECIAL_IDS["<|end|>"]) == 4  # tags are single tokens


@pytest.mark.parametrize("name", ["target_v1", "target_v2"])
def test_targets_fit_vllm_cpu(world: World, tokenizer, name: str) -> None:
    model_dir = getattr(world, name)
    config = AutoConfig.from_pretrained(model_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.head_dim in (32, 64)
    assert config.head_dim * config.num_attention_heads == config.hidden_size
    assert config.num_hidden_layers == 8
    layers = config.num_hidden_layers
    assert len({2, layers // 2, layers - 3}) == 3  # vLLM's default EAGLE-3 aux layers
    assert config.tie_word_embeddings is False
    assert config.vocab_size == len(tokenizer)
    assert config.max_position_embeddings == 2048
    assert config.eos_token_id == SPECIAL_IDS["<|end|>"]
    assert GenerationConfig.from_pretrained(model_dir).eos_token_id == SPECIAL_IDS["<|end|>"]
    with safe_open(model_dir / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
        assert {weights.get_tensor(n).dtype for n in names} == {torch.float32}
    assert "lm_head.weight" in names
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (model_dir / file).read_bytes() == (world.tokenizer / file).read_bytes()


@pytest.fixture(scope="module")
def models(world: World) -> dict[str, LlamaForCausalLM]:
    return {
        name: LlamaForCausalLM.from_pretrained(getattr(world, name)).eval()
        for name in ("target_v1", "target_v2")
    }


def test_targets_predict_topic_text_and_differ(world: World, tokenizer, models) -> None:
    rows = [tokenizer.encode(text)[:64] for text in topics(world.spec.topic_keys()).values()]
    batch = torch.tensor([row for row in rows if len(row) == 64])
    with torch.no_grad():
        logits = {name: model(input_ids=batch).logits for name, model in models.items()}
    for name, values in logits.items():
        loss = torch.nn.functional.cross_entropy(
            values[:, :-1].flatten(0, 1), batch[:, 1:].flatten()
        )
        assert loss < math.log(len(tokenizer)) - 2.0, name  # uniform would be log(vocab)
    assert (logits["target_v1"] - logits["target_v2"]).abs().mean() > 0.1


@pytest.mark.parametrize("name", ["target_v1", "target_v2"])
def test_greedy_answer_is_text_and_ends(world: World, tokenizer, models, name: str) -> None:
    messages = [{"role": "user", "content": 'Tell me about the "for" statement.'}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    inputs = torch.tensor([prompt["input_ids"]])
    output = models[name].generate(inputs, max_new_tokens=100, do_sample=False)
    answer = output[0, inputs.shape[1] :].tolist()
    assert answer[-1] == SPECIAL_IDS["<|end|>"], tokenizer.decode(answer)
    text = tokenizer.decode(answer[:-1])
    assert set(text) <= set(string.printable), text
    assert len(re.findall(r"[A-Za-z]{2,}", text)) >= 3, text  # words, however odd at this size


def test_prompt_pool(world: World) -> None:
    pool, heldout = _read_jsonl(world.prompts), _read_jsonl(world.heldout_prompts)
    assert len(pool) + len(heldout) == world.spec.num_prompts
    assert 0 < len(heldout) < len(pool) / 4
    # held out by id hash, the same split on every machine; the pool never holds one of them
    assert all(int(row["prompt_id"], 16) % HELDOUT_EVERY == 0 for row in heldout)
    assert all(int(row["prompt_id"], 16) % HELDOUT_EVERY != 0 for row in pool)
    ids = [row["prompt_id"] for row in pool + heldout]
    assert len(set(ids)) == len(ids)
    keys = set(world.spec.topic_keys())
    multi_turn = 0
    for row in pool + heldout:
        messages = row["messages"]
        assert row["prompt_id"] == prompt_id_for(messages)  # a content hash: survives reordering
        assert row["source"] in keys
        assert [m["role"] for m in messages] == ["user", "assistant", "user"][: len(messages)]
        if len(messages) == 3:  # the assistant turn quotes the topic it follows up on
            multi_turn += 1
            assert messages[1]["content"] in topics((row["source"],))[row["source"]]
    # the smallest ids among every templated conversation, one multi-turn per topic among them
    candidates = candidate_conversations(world.spec.topic_keys())
    chosen = sorted(candidates, key=lambda c: c["prompt_id"])[: world.spec.num_prompts]
    assert sorted(ids) == [c["prompt_id"] for c in chosen]
    assert multi_turn == sum(len(c["messages"]) == 3 for c in chosen) > 0


def test_world_record(world: World) -> None:
    record = json.loads((world.root / "world.json").read_text())
    assert record["hash"] == world.spec.digest()
    assert set(record["seconds"]) >= {"tokenizer", "target-v1", "target-v2", "prompts", "total"}
    assert record["final_loss"]["target-v2"] < record["final_loss"]["target-v1"]
    assert record["special_token_ids"] == SPECIAL_IDS


def test_second_build_is_cached(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cached world is returned as it is: nothing is built, written or touched."""

    def files() -> dict[str, int]:
        return {
            str(path.relative_to(world.root.parent)): path.stat().st_mtime_ns
            for path in world.root.parent.rglob("*")
            if path.is_file()
        }

    def no_build(*args, **kwargs) -> dict:
        raise AssertionError("the cached world was built again")

    before = files()
    monkeypatch.setattr(world_module, "_build", no_build)
    messages: list[str] = []
    again = build_world(world.root.parent, "test", log=messages.append)
    assert again == world
    assert files() == before  # same files (no staging left), none rewritten
    assert messages == [f"world 'test' cached at {world.root}"]


def test_unknown_size_names_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"valid sizes: test, demo, kimi-test, kimi-demo$"):
        build_world(tmp_path, "huge")
    assert not list(tmp_path.iterdir())


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs) -> float:
        raise RuntimeError("killed")

    monkeypatch.setattr(targets, "train", fail)
    with pytest.raises(RuntimeError, match="killed"):
        build_world(tmp_path, "test", log=lambda _: None)
    assert [p.name for p in tmp_path.iterdir()] == [".test.lock"]  # the builders' lock, empty
    assert (tmp_path / ".test.lock").stat().st_size == 0


def test_build_is_deterministic_and_leaves_torch_alone(world: World, tmp_path: Path) -> None:
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    other = build_world(tmp_path, "test", log=lambda _: None)
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), rng)
    for relative in (
        "tokenizer/tokenizer.json",
        "target-v1/model.safetensors",
        "target-v2/model.safetensors",
        "prompts.jsonl",
        "prompts-heldout.jsonl",
    ):
        assert (other.root / relative).read_bytes() == (world.root / relative).read_bytes()

"""Hidden-state extraction on the test-size target: exact layers, exact masks, every format
round-trips, fp8 within its bound, the storage budget, and resume after kill -9."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3_assets.lib.core.atomic_files import file_sha256
from eagle3_assets.lib.core.layer_ids import aux_layer_ids
from eagle3_assets.lib.hidden_states.backends import open_backend
from eagle3_assets.lib.hidden_states.extract import (
    MANIFEST,
    PROGRESS,
    ExtractionSettings,
    ExtractionSummary,
    LayerSelection,
    StorageBudgetError,
    extract_batch,
    human_bytes,
    read_manifest,
    verify_batch,
)
from eagle3_assets.lib.hidden_states.hf_backend import HFTarget, length_buckets
from eagle3_assets.lib.hidden_states.settings import HiddenStatesSettings
from eagle3_assets.lib.hidden_states.shard_format import (
    FP8_RELATIVE_ERROR,
    FP8_SUBNORMAL_ERROR,
    ShardFile,
    ShardFormat,
    candidate_formats,
    dequantize_fp8,
    quantize_fp8,
)
from eagle3_assets.lib.hidden_states.shard_reader import ShardReader
from eagle3_assets.lib.hidden_states.token_sequences import TemplateMismatchError, build_sequences
from eagle3_assets.lib.hidden_states.vllm_backend import extraction_spec, read_connector_file
from eagle3_assets.lib.serving.vllm_launcher import VLLMLaunchSpec, build_command
from eagle3_assets.localdev.greedy import greedy_generation_rows
from eagle3_assets_tests.conftest import vllm_extraction
from eagle3_assets_tests.templates import KWARGS, THINKING_TEMPLATE

N_LAYERS = 8  # the test-size target
LAYERS = LayerSelection(aux=(2, 4, 5), final=N_LAYERS, source="test")


@pytest.fixture(scope="module")
def rows(test_world) -> list[dict]:
    return greedy_generation_rows(
        test_world.target_v2, test_world.prompts, count=12, max_new_tokens=40
    )


@pytest.fixture(scope="module")
def tokenizer(test_world):
    return AutoTokenizer.from_pretrained(test_world.target_v2)


@pytest.fixture(scope="module")
def sequences(rows, tokenizer):
    return build_sequences(rows, tokenizer)  # every prompt renders here as it was served


@pytest.fixture(scope="module")
def hf_model(test_world):
    return AutoModelForCausalLM.from_pretrained(test_world.target_v2, dtype=torch.float32).eval()


def extract_hf(world, sequences, out_dir: Path, fmt: str, shard_bytes: int, **settings):
    """extract_batch with the hf backend on the test-size target in float32."""
    return extract_batch(
        sequences,
        out_dir,
        lambda: HFTarget(world.target_v2, LAYERS.ids, dtype="float32", device="cpu"),
        LAYERS,
        64,
        ExtractionSettings(ShardFormat.parse(fmt), shard_bytes=shard_bytes, **settings),
        {"target": "test-v2"},
    )


def plain_forward(model, input_ids: np.ndarray):
    """transformers' own view of one unpadded sequence: all hidden states and the logits."""
    with torch.inference_mode():
        out = model(torch.from_numpy(input_ids)[None], output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.logits[0]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# --- capture: the right layers, equal to a plain forward -------------------------------------


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_captured_layers_equal_hf_output_hidden_states(
    test_world, hf_model, sequences, dtype, tolerance
):
    """vLLM id i is HF output_hidden_states[i]; id N is the last layer's output before the final
    norm (HF's hidden_states[N] is after it), so norm(final) and lm_head(norm(final)) must match
    HF's last entry and logits. Capture runs padded length buckets; HF runs each sequence alone."""
    target = HFTarget(test_world.target_v2, LAYERS.ids, dtype=dtype, device="cpu")
    captured = dict(target.capture(sequences, batch_tokens=256))
    assert sorted(captured) == list(range(len(sequences)))
    assert len(length_buckets([len(s) for s in sequences], 256)) < len(sequences)  # padding ran
    for index, sequence in enumerate(sequences):
        hidden, logits = plain_forward(hf_model, sequence.input_ids)
        states = captured[index]
        assert states.shape == (len(sequence), 4, 64)
        for column, layer_id in enumerate(LAYERS.aux):
            assert relative_error(states[:, column], hidden[layer_id]) < tolerance
        final = states[:, -1].float()
        assert relative_error(final, hidden[N_LAYERS]) > 0.1  # HF's last entry is post-norm
        with torch.inference_mode():
            normed = hf_model.model.norm(final)
            assert relative_error(normed, hidden[N_LAYERS]) < tolerance
            assert relative_error(hf_model.lm_head(normed), logits) < tolerance


def test_sglang_ids_capture_the_same_tensors_as_vllm_ids(test_world, sequences):
    """A SpecForge config's nested [1, 3, 4] (SGLang) means vLLM [2, 4, 5]; read as vLLM ids
    they would be other layers, which is the silent wrong-layers failure."""
    nested = aux_layer_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, 8)
    top = aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, 8)
    assert nested.vllm == top.vllm == (2, 4, 5)
    sample = sequences[:3]

    def states(ids):
        target = HFTarget(test_world.target_v2, ids, dtype="float32", device="cpu")
        return dict(target.capture(sample, batch_tokens=1024))

    from_nested, from_top, misread = states(nested.vllm), states(top.vllm), states((1, 3, 4))
    for index in range(len(sample)):
        assert torch.equal(from_nested[index], from_top[index])
        assert relative_error(misread[index], from_top[index]) > 0.1


def test_layer_ids_outside_the_target_are_refused(test_world):
    with pytest.raises(ValueError, match=r"layer ids \[0, 9\]: expected vLLM ids in \[1, 8\]"):
        HFTarget(test_world.target_v2, (0, 4, 9), dtype="float32", device="cpu")


# --- sequences and loss mask ------------------------------------------------------------------


def test_loss_mask_covers_exactly_the_response_tokens(rows, tokenizer, sequences):
    for row, sequence in zip(rows, sequences, strict=True):
        messages = json.loads(row["messages"])
        prompt_text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        conversation = [*messages, {"role": "assistant", "content": row["response"]}]
        full_text = tokenizer.apply_chat_template(conversation, tokenize=False)
        masked = sequence.input_ids[sequence.loss_mask].tolist()
        unmasked = sequence.input_ids[~sequence.loss_mask].tolist()
        assert tokenizer.decode(unmasked) == prompt_text
        response = tokenizer.decode(masked)
        ended = masked[-1] == tokenizer.eos_token_id
        assert response == row["response"] + ("<|end|>" if ended else "")
        if ended:  # the template renders a finished turn as prompt + response + <|end|>\n
            assert full_text == prompt_text + response + "\n"
        first = len(row["prompt_token_ids"])
        assert np.flatnonzero(sequence.loss_mask).tolist() == list(range(first, len(sequence)))
        # the prediction of the first response token is made at the prompt's last token
        assert sequence.teacher_positions.tolist() == list(range(first - 1, len(sequence) - 1))


def test_truncation_and_missing_ids(rows, tokenizer):
    sequences = build_sequences(rows[:3], tokenizer, max_length=24)
    for row, sequence in zip(rows[:3], sequences, strict=True):
        full = len(row["prompt_token_ids"]) + len(row["token_ids"])
        assert len(sequence) == min(full, 24) and sequence.truncated == (full > 24)
    with pytest.raises(ValueError, match=r"has no token ids.*return_token_ids"):
        build_sequences([dict(rows[0], token_ids=None)], tokenizer)


def test_a_prompt_rendered_otherwise_than_served_is_an_error_naming_both(
    test_world, rows, tokenizer
):
    """The rows' prompts were rendered without kwargs. A local template that reads `thinking`
    renders them alike without it (or with thinking on) and otherwise in instant mode: an
    error naming the kwargs, how many prompts differ, and the first one's two renderings,
    decoded, from the first differing token on."""
    thinking = AutoTokenizer.from_pretrained(test_world.target_v2)
    thinking.chat_template = THINKING_TEMPLATE
    assert len(build_sequences(rows, thinking)) == len(rows)
    assert len(build_sequences(rows, thinking, {"thinking": True})) == len(rows)

    with pytest.raises(TemplateMismatchError) as mismatch:
        build_sequences(rows, thinking, KWARGS)
    served = rows[0]["prompt_token_ids"]
    assert str(mismatch.value).splitlines()[:3] == [
        f"{len(rows)} of {len(rows)} prompts render differently with the local chat template "
        f'and chat_template_kwargs {{"thinking": false}} than vLLM rendered them; first, '
        f"{rows[0]['sample_id']}, from token {len(served)} on "
        f"(after {tokenizer.decode(served[-12:])!r}):",
        "  vLLM rendered:               ''",
        "  the local template rendered: '<think></think>'",
    ]
    assert mismatch.value.total == len(rows) == len(mismatch.value.mismatches)

    # a server that rendered other tokens mid-prompt: the text from there on, both ways
    drifted = dict(
        rows[0],
        prompt_token_ids=[*served[:5], *tokenizer.encode("Hello", add_special_tokens=False)],
    )
    with pytest.raises(TemplateMismatchError) as mismatch:
        build_sequences([drifted], tokenizer)
    (found,) = mismatch.value.mismatches
    assert (found.position, found.before, found.served) == (
        5,
        tokenizer.decode(served[:5]),
        "Hello",
    )
    assert found.rendered == tokenizer.decode(served[5:17])


# --- formats ----------------------------------------------------------------------------------


def test_fp8_error_within_its_bound(test_world, sequences):
    """Each value within 2^-4 of itself plus 2^-10 of its token's scale; RMS under 3%."""
    target = HFTarget(test_world.target_v2, LAYERS.ids, dtype="float32", device="cpu")
    states = torch.cat([s for _, s in target.capture(sequences, batch_tokens=4096)])
    spiky = torch.randn(64, 3, 256) * torch.logspace(-3, 3, 256)  # 6 decades within a token
    for x in (states, spiky):
        values, scale = quantize_fp8(x)
        restored = dequantize_fp8(values, scale, torch.float32)
        bound = FP8_RELATIVE_ERROR * x.abs() + FP8_SUBNORMAL_ERROR * scale.unsqueeze(-1)
        assert bool(((restored - x).abs() <= bound * (1 + 1e-6)).all())
        assert relative_error(restored, x) < 0.03


def test_format_names_and_sizes():
    assert ShardFormat.parse("fp8+top64") == ShardFormat("fp8", "top64")
    assert ShardFormat().name == "fp8+fp8"
    for bad, field in [("fp16+bf16", "aux"), ("bf16+top0", "final"), ("bf16", "format")]:
        with pytest.raises(ValueError, match=field):
            ShardFormat.parse(bad)
    # Kimi-K2.5: H 7168, 3 aux layers; bf16 aux + bf16 final everywhere is 57,344 B/token
    kimi = {name: ShardFormat.parse(name) for name in ("bf16+bf16", "fp8+fp8", "fp8+top64")}
    assert kimi["bf16+bf16"].estimate(1, 1, 0, 7168, 3) - 5 - 16 == 57_344
    assert kimi["fp8+fp8"].token_bytes(7168, 3) == 5 + 3 * 7168 + 12
    # the default at an 80% response share: 0.48x of bf16 x 4 layers, 25K x 4K fits 2.9 TB
    assert round(kimi["fp8+fp8"].bytes_per_token(7168, 3, 0.8)) == 27_259


@pytest.mark.parametrize("fmt", [f.name for f in candidate_formats(topk=8)])
def test_every_format_round_trips(test_world, hf_model, sequences, tmp_path, fmt):
    shard_format = ShardFormat.parse(fmt)
    summary = extract_hf(test_world, sequences, tmp_path, fmt, 40_000, batch_tokens=512)
    manifest = read_manifest(tmp_path)
    assert summary.shards == len(manifest["shards"]) > 1
    assert summary.samples == len(sequences) and summary.nonfinite == 0
    assert summary.tokens == sum(len(s) for s in sequences)
    assert summary.bytes == sum(p.stat().st_size for p in tmp_path.glob("shard-*"))
    by_id = {s.sample_id: s for s in sequences}
    seen = []
    for name, entry in manifest["shards"].items():
        assert file_sha256(tmp_path / name) == entry["sha256"]
        shard = ShardFile(tmp_path / name)
        assert shard.sample_ids == entry["samples"]
        for index, sample_id in enumerate(shard.sample_ids):
            sample, sequence = shard.sample(index), by_id[sample_id]
            seen.append(sample_id)
            hidden, logits = plain_forward(hf_model, sequence.input_ids)
            teacher = torch.from_numpy(sequence.teacher_positions)
            assert sample.input_ids.tolist() == sequence.input_ids.tolist()
            assert sample.loss_mask.tolist() == sequence.loss_mask.tolist()
            aux = torch.stack([hidden[i] for i in LAYERS.aux], dim=1)
            tolerance = {"bf16": 5e-3, "fp8": 0.03}
            assert relative_error(sample.aux, aux) < tolerance[shard_format.aux]
            if shard_format.topk:
                best = logits[teacher].topk(8, dim=-1)
                assert sample.topk_ids.tolist() == best.indices.tolist()
                assert relative_error(sample.topk_logits, best.values) < 5e-3
                assert sample.final is None
            else:
                final = plain_forward_final(hf_model, sequence.input_ids)[teacher]
                assert relative_error(sample.final, final) < tolerance[shard_format.final]
    assert sorted(seen) == sorted(by_id)


def plain_forward_final(model, input_ids: np.ndarray) -> torch.Tensor:
    """The last decoder layer's output (pre-norm), from a hook-free HF forward."""
    outputs = {}
    handle = model.model.layers[-1].register_forward_hook(
        lambda module, args, output: outputs.setdefault("final", output)
    )
    try:
        with torch.inference_mode():
            model(torch.from_numpy(input_ids)[None])
    finally:
        handle.remove()
    return outputs["final"][0]


# --- storage budget ---------------------------------------------------------------------------


def test_budget_cap_fails_before_any_work(sequences, tmp_path):
    def never() -> None:
        raise AssertionError("the target must not load when the batch cannot fit")

    (tmp_path / "batch-00000").mkdir()
    (tmp_path / "batch-00000" / "shard-00000.safetensors").write_bytes(b"x" * 300_000)
    tokens = sum(len(s) for s in sequences)
    teacher = sum(len(s.teacher_positions) for s in sequences)
    size = {f.name: f.estimate(tokens, teacher, len(sequences), 64, 3) for f in candidate_formats()}
    cap = 300_000 + (size["fp8+fp8"] + size["fp8+bf16"]) // 2  # fp8+fp8 fits, fp8+bf16 not
    out_dir = tmp_path / "batch-00001"
    with pytest.raises(StorageBudgetError) as error:
        settings = ExtractionSettings(ShardFormat("bf16", "bf16"), cap_bytes=cap)
        extract_batch(sequences, out_dir, never, LAYERS, 64, settings, {})
    message = str(error.value)
    needed = human_bytes(size["bf16+bf16"])
    assert f"batch-00001: needs {needed}, and other batches use 300 KB of the " in message
    assert f"Formats that would fit: fp8+fp8 ({human_bytes(size['fp8+fp8'])})" in message
    assert "fp8+bf16" not in message and "fp8+top64" not in message  # 64 x 6 B > H 64 + 4 B
    assert list(out_dir.iterdir()) == []


# --- resume after kill -9 ---------------------------------------------------------------------

DRIVER = """
import json, sys, time
from pathlib import Path
from transformers import AutoTokenizer
from eagle3_assets.lib.hidden_states.hf_backend import HFTarget
from eagle3_assets.lib.hidden_states.extract import (
    ExtractionSettings, LayerSelection, extract_batch)
from eagle3_assets.lib.hidden_states.shard_format import ShardFormat
from eagle3_assets.lib.hidden_states.token_sequences import build_sequences
from eagle3_assets.lib.hidden_states.vllm_backend import extraction_server
from eagle3_assets.lib.serving.vllm_launcher import VLLMLaunchSpec
from eagle3_assets.localdev.greedy import greedy_generation_rows
from eagle3_assets_tests.conftest import free_port

target, rows_path, out_dir, pause = sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])
rows = json.loads(Path(rows_path).read_text())
sequences = build_sequences(rows, AutoTokenizer.from_pretrained(target))
layers = LayerSelection((2, 4, 5), 8, "test")
extract_batch(
    sequences, out_dir, lambda: HFTarget(target, layers.ids, dtype="bfloat16", device="cpu"),
    layers, 64, ExtractionSettings(ShardFormat("fp8", "fp8"), shard_bytes=6_000, batch_tokens=256),
    {"target": "test-v2"}, lambda message: time.sleep(pause),
)
"""


def run_driver(test_world, rows_path: Path, out_dir: Path, pause: float) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            DRIVER,
            str(test_world.target_v2),
            str(rows_path),
            str(out_dir),
            str(pause),
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )


def shard_state(out_dir: Path) -> dict[str, tuple[int, str]]:
    return {p.name: (p.stat().st_mtime_ns, file_sha256(p)) for p in out_dir.glob("shard-*")}


def test_kill_9_mid_batch_then_resume_is_identical(test_world, rows, tmp_path):
    rows_path = tmp_path / "rows.json"
    rows_path.write_text(json.dumps(rows))
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert run_driver(test_world, rows_path, reference, 0).wait(timeout=300) == 0

    worker = run_driver(test_world, rows_path, resumed, 1.0)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and worker.poll() is None:
        progress = (
            json.loads((resumed / PROGRESS).read_text()) if (resumed / PROGRESS).exists() else {}
        )
        if len(progress.get("shards", {})) >= 2:
            break
        time.sleep(0.05)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    assert not (resumed / MANIFEST).exists()
    finished = shard_state(resumed)
    total = len(read_manifest(reference)["shards"])
    assert 2 <= len(finished) < total

    assert run_driver(test_world, rows_path, resumed, 0).wait(timeout=300) == 0
    after = shard_state(resumed)
    assert {name: after[name] for name in finished} == finished  # untouched: mtime and sha
    assert {n: s for n, (_, s) in after.items()} == {
        n: s for n, (_, s) in shard_state(reference).items()
    }
    ours, theirs = read_manifest(resumed), read_manifest(reference)
    assert ours["shards"] == theirs["shards"] and ours["fingerprint"] == theirs["fingerprint"]

    # a shard that rots on disk is found by its checksum and re-extracted, alone
    victim = sorted(after)[1]
    (resumed / victim).write_bytes(b"rotten")
    assert run_driver(test_world, rows_path, resumed, 0).wait(timeout=300) == 0
    again = shard_state(resumed)
    assert again[victim][1] == after[victim][1] and again[victim][0] != after[victim][0]
    assert all(again[n] == after[n] for n in after if n != victim)


# --- streaming reader -------------------------------------------------------------------------


def test_reader_streams_shuffles_and_splits_for_ddp(test_world, sequences, tmp_path):
    batch_dirs = [tmp_path / "batch-00000", tmp_path / "batch-00001"]
    for batch_dir, part in zip(batch_dirs, (sequences[:7], sequences[7:]), strict=True):
        extract_hf(test_world, part, batch_dir, "bf16+bf16", 20_000)
    single = ShardReader(batch_dirs, seed=3, shuffle_buffer=4)
    everything = [s.sample_id for s in single.samples(epoch=0)]
    assert sorted(everything) == sorted(s.sample_id for s in sequences)
    assert everything == [s.sample_id for s in single.samples(epoch=0)]  # deterministic
    assert everything != [s.sample_id for s in single.samples(epoch=1)]  # reshuffled per epoch
    assert [s.sample_id for s in single.samples(epoch=0, start=5)] == everything[5:]

    ranks = [ShardReader(batch_dirs, seed=3, rank=r, world_size=5) for r in range(5)]
    taken = [[s.sample_id for s in reader.samples(epoch=0)] for reader in ranks]
    assert {len(t) for t in taken} == {len(sequences) // 5}
    flat = [sample_id for t in taken for sample_id in t]
    assert len(flat) == len(set(flat)) == 5 * (len(sequences) // 5)

    by_id = {s.sample_id: s for s in sequences}
    sample = next(single.samples(epoch=0))
    assert sample.input_ids.tolist() == by_id[sample.sample_id].input_ids.tolist()
    assert sample.aux.dtype == torch.float32 and sample.final.shape[1] == 64


# --- checks read back from the files ----------------------------------------------------------


def test_verify_batch_finds_rot_foreign_tokens_and_missing_samples(
    test_world, rows, sequences, tmp_path
):
    extract_hf(test_world, sequences, tmp_path, "fp8+fp8", 10_000)
    expected = {r["sample_id"]: [*r["prompt_token_ids"], *r["token_ids"]] for r in rows}
    clean = verify_batch(tmp_path, expected)
    assert clean.bad_shards == clean.token_mismatches == clean.missing_samples == []
    assert clean.nonfinite == 0 and clean.samples_without_loss == 0
    responses = sum(len(r["token_ids"]) for r in rows)
    assert clean.loss_tokens == responses and clean.tokens == sum(len(s) for s in sequences)

    first = rows[0]["sample_id"]
    changed = dict(expected, **{first: [9, *expected[first][1:]]}, extra=[1, 2])
    found = verify_batch(tmp_path, changed)
    assert found.token_mismatches == [first] and found.missing_samples == ["extra"]
    victim = sorted(tmp_path.glob("shard-*"))[0]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    assert verify_batch(tmp_path, expected).bad_shards == [victim.name]


# --- the vllm backend, on the CPU build with the project's connector -------------------------


def test_a_connector_file_with_fewer_rows_than_tokens_is_refused(tmp_path):
    """vLLM issue 44485: a prefix served from the cache has no states in the file."""
    path = tmp_path / "request-0.safetensors"
    save_file({"hidden_states": torch.ones(3, 2, 4), "token_ids": torch.arange(5)}, path)
    with pytest.raises(ValueError, match=r"request-0\.safetensors: hidden_states has 3 rows for 5"):
        read_connector_file(path, range(5))
    assert path.exists()  # kept for a look
    save_file({"hidden_states": torch.ones(5, 2, 4), "token_ids": torch.arange(5)}, path)
    assert read_connector_file(path, range(5)).shape == (5, 2, 4) and not path.exists()


def test_the_extraction_server_never_caches_prefixes(tmp_path):
    """Off even when the user's own vLLM arguments turn it on (the last flag wins)."""
    serving = VLLMLaunchSpec(
        "target", Path("python"), tmp_path, extra_args=("--enable-prefix-caching",)
    )
    for cpu_build in (True, False):
        command = build_command(extraction_spec(serving, (2, 4), tmp_path, cpu_build))
        flags = [arg for arg in command if arg.endswith("enable-prefix-caching")]
        assert flags == ["--enable-prefix-caching", "--no-enable-prefix-caching"]


@pytest.mark.vllm
def test_vllm_backend_captures_what_hf_captures(test_world, serving_python, sequences, tmp_path):
    """One real extraction server (vLLM's extract_hidden_states + our CPU connector), opened
    from plain settings as the asset opens it: its states, converted into shards, equal the hf
    backend's, and the raw files are gone."""
    recipe = HiddenStatesSettings(**vllm_extraction(serving_python))
    layers = LayerSelection(aux=(5, 2, 4), final=N_LAYERS, source="test")  # unsorted on purpose
    settings = ExtractionSettings(ShardFormat("bf16", "bf16"), shard_bytes=20_000)

    def extract(backend: str) -> ExtractionSummary:
        return extract_batch(
            sequences,
            tmp_path / backend,
            lambda: open_backend(
                recipe.model_copy(update={"backend": backend}),
                "cpu",
                str(test_world.target_v2),
                False,
                layers.ids,
                64,
                tmp_path / "server",
            ),
            layers,
            64,
            settings,
            {},
        )

    via_vllm = extract("vllm")
    assert via_vllm.samples == len(sequences) and via_vllm.nonfinite == 0
    assert list((tmp_path / "server" / "hidden_states").iterdir()) == []  # raw files removed
    argv = json.loads((tmp_path / "server" / "launch.json").read_text())["argv"]
    assert argv[argv.index("--model") + 1] == str(test_world.target_v2)
    assert argv[argv.index("--max-model-len") + 1] == "512" and "--enforce-eager" in argv
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert "CpuHiddenStatesConnector" in argv[argv.index("--kv-transfer-config") + 1]
    extract("hf")
    for name in read_manifest(tmp_path / "hf")["shards"]:
        ours, theirs = ShardFile(tmp_path / "vllm" / name), ShardFile(tmp_path / "hf" / name)
        assert ours.sample_ids == theirs.sample_ids
        for index in range(len(ours)):
            a, b = ours.sample(index), theirs.sample(index)
            assert torch.equal(a.input_ids, b.input_ids)
            assert relative_error(a.aux, b.aux) < 5e-3  # both stored in bf16
            assert relative_error(a.final, b.final) < 5e-3


def test_nonfinite_states_are_counted_and_found_again(test_world, rows, sequences, tmp_path):
    def poisoned() -> HFTarget:
        target = HFTarget(test_world.target_v2, LAYERS.ids, dtype="float32", device="cpu")
        with torch.no_grad():
            target.decoder.layers[4].mlp.down_proj.weight[0, 0] = float("nan")
        return target

    settings = ExtractionSettings(ShardFormat("bf16", "fp8"), shard_bytes=10_000)
    summary = extract_batch(sequences[:3], tmp_path, poisoned, LAYERS, 64, settings, {})
    expected = {r["sample_id"]: [*r["prompt_token_ids"], *r["token_ids"]] for r in rows[:3]}
    # layer 4's MLP writes NaN into channel 0 of the residual: aux id 5 holds 1 NaN a token;
    # layer 5's norm spreads it, so the final state (id 8) is NaN in all 64 channels
    tokens = sum(len(s) for s in sequences[:3])
    teacher = sum(len(s.teacher_positions) for s in sequences[:3])
    assert summary.nonfinite == tokens * (1 + 64)
    # stored: aux in bf16 at every token; the final state in fp8 at the teacher positions,
    # its 64 values and its per-token scale
    assert verify_batch(tmp_path, expected).nonfinite == tokens + teacher * (64 + 1)

"""Download an EAGLE-3 drafter from the Hugging Face hub and check it fits the target.

The download runs `snapshot_download` in-process into the hub cache, then copies only
config.json and safetensors into `local_dir`: offline, the client returns the cached snapshot
folder as it is (its `allow_patterns` only filter what is fetched), and a SpecForge repo also
holds a pickled `training_state.pt`, which is never fetched, copied or unpickled here.

Validation reads config.json and the safetensors headers (plus the small d2t/t2d tensors) and
reports every problem at once as "field: expected X, found Y", before anything trains on it.
"""

import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx2
import numpy as np
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import filter_repo_objects
from safetensors import safe_open

from eagle3_assets.lib.core.hub_files import hub_cache_dir, hub_offline
from eagle3_assets.lib.core.layer_ids import LayerIdSource, aux_layer_ids
from eagle3_assets.lib.core.target import TargetShape

ALLOW_PATTERNS = ["config.json", "*.safetensors", "*.safetensors.index.json"]
PICKLE_SUFFIXES = {".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt"}
ARCHITECTURE = "LlamaForCausalLMEagle3"  # vLLM's and SpecForge's name for the drafter
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}

_logger = logging.getLogger(__name__)


class DrafterDownloadError(RuntimeError):
    """The drafter could not be downloaded; the message names the repo and revision."""


class DrafterValidationError(ValueError):
    """The drafter does not fit the target; one line per problem."""


# ---------------------------------------------------------------------------------- download


def _causes(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _is_transient(error: BaseException) -> bool:
    """Connection errors, timeouts and 408/429/5xx anywhere in the chain (the client often
    wraps them in a LocalEntryNotFoundError); never a missing repo, revision or offline mode."""
    chain = _causes(error)
    if any(isinstance(e, RepositoryNotFoundError | RevisionNotFoundError) for e in chain):
        return False
    if any(isinstance(e, OfflineModeIsEnabled) for e in chain):
        return False
    for e in chain:
        if isinstance(e, HfHubHTTPError):
            return e.response is not None and e.response.status_code in TRANSIENT_STATUS
        if isinstance(e, httpx2.TransportError | ConnectionError | TimeoutError) and not isinstance(
            e, httpx2.UnsupportedProtocol | httpx2.ProxyError
        ):
            return True
    return False


def download_drafter(
    repo_id: str,
    revision: str,
    local_dir: Path,
    token: str | None = None,
    cache_dir: Path | None = None,
    retries: int = 5,
    backoff_s: float = 2.0,
    log: Callable[[str], None] = _logger.warning,
) -> tuple[Path, str]:
    """Fetch config.json and safetensors of `repo_id` at `revision` into `local_dir` (replaced
    whole) and return it with the resolved commit sha. Transient errors are retried `retries`
    times, waiting backoff_s * 2**attempt; a missing repo or revision (offline: one not in the
    cache) fails at once. HF_HUB_OFFLINE, HF_HUB_CACHE and HF_HOME are read at call time."""
    where = f"drafter {repo_id!r} at revision {revision!r}"
    offline, cache = hub_offline(), cache_dir or hub_cache_dir()
    for attempt in range(retries + 1):
        try:
            snapshot = Path(
                snapshot_download(
                    repo_id,
                    revision=revision,
                    cache_dir=cache,
                    allow_patterns=ALLOW_PATTERNS,
                    token=token,
                    local_files_only=offline,
                )
            )
            break
        except (RepositoryNotFoundError, RevisionNotFoundError) as error:
            raise DrafterDownloadError(
                f"{where} was not found on the hub (or is private or gated and the token does "
                f"not grant access): {error}"
            ) from error
        except Exception as error:
            if not _is_transient(error):
                if isinstance(error, EntryNotFoundError) and offline:
                    raise DrafterDownloadError(
                        f"{where} is not in the hub cache {cache or '(default)'} "
                        f"and HF_HUB_OFFLINE is set: {error}"
                    ) from error
                if isinstance(error, HfHubHTTPError | EntryNotFoundError):
                    raise DrafterDownloadError(f"{where}: {error}") from error
                raise
            if attempt == retries:
                raise DrafterDownloadError(
                    f"{where}: gave up after {retries + 1} attempts: {error}"
                ) from error
            wait_s = backoff_s * 2**attempt
            log(f"{where}: {type(error).__name__}: {error}; retrying in {wait_s:.0f}s")
            time.sleep(wait_s)

    # The cache keeps every revision in snapshots/<commit sha>, online and offline alike.
    sha = snapshot.name
    files = sorted(
        filter_repo_objects(
            [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()],
            allow_patterns=ALLOW_PATTERNS,
        )
    )
    partial = local_dir.with_name(f".{local_dir.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for name in files:
        (partial / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(snapshot / name, partial / name)  # follows the cache's blob symlinks
    shutil.rmtree(local_dir, ignore_errors=True)
    partial.rename(local_dir)
    return local_dir, sha


# -------------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class DrafterInfo:
    """A validated drafter, as downstream steps and the asset's metadata need it."""

    architectures: list[str]
    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids_vllm: tuple[int, ...]
    aux_layer_ids_sglang: tuple[int, ...]
    aux_layer_ids_source: LayerIdSource
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_parameters: int
    bytes_on_disk: int
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)


def _read_headers(path: Path, problems: list[str]) -> dict[str, tuple[str, tuple[int, ...], Path]]:
    """name -> (dtype, shape, file) from every safetensors file's header; no weights are read."""
    tensors: dict[str, tuple[str, tuple[int, ...], Path]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in tensors:
                    problems.append(
                        f"{name}: expected in one file, found in {tensors[name][2].name} "
                        f"and {file.name}"
                    )
                part = f.get_slice(name)
                tensors[name] = (part.get_dtype(), tuple(part.get_shape()), file)
    return tensors


def check_vocab_maps(d2t: np.ndarray, t2d: np.ndarray, draft_vocab: int) -> list[str]:
    """t2d marks draft_vocab target ids; draft id i maps to the i-th of them in increasing
    order (target id = i + d2t[i]), the order lm_head's rows were trained in."""
    if int(t2d.sum()) != draft_vocab:
        return [f"t2d: expected {draft_vocab} true entries (draft_vocab_size), found {t2d.sum()}"]
    expected = np.flatnonzero(t2d)
    found = np.arange(draft_vocab) + d2t
    wrong = np.flatnonzero(found != expected)
    if len(wrong) == 0:
        return []
    i = int(wrong[0])
    return [
        f"d2t: expected draft id + d2t to be the ids where t2d is true, in increasing order; "
        f"found {len(wrong)} draft ids off, first draft id {i}: expected target id "
        f"{expected[i]}, found {found[i]}"
    ]


def validate_drafter(path: Path, target: TargetShape) -> DrafterInfo:
    """Check that the drafter in `path` is an EAGLE-3 drafter vLLM can load for `target`:
    config fields, every tensor's shape and dtype, d2t/t2d consistency, aux layer ids in range,
    no pickles. Raise DrafterValidationError listing every problem."""
    problems: list[str] = []

    def expect(field: str, expected: object, found: object, where: str, why: str = "") -> None:
        if expected != found:
            problems.append(f"{field}: expected {expected}{why}, found {found} in {where}")

    pickles = sorted(p.name for p in path.rglob("*") if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        problems.append(f"files: expected no pickles, found {', '.join(pickles)}")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise DrafterValidationError(f"config.json: expected a JSON file, found {error}") from error

    architectures = config.get("architectures") or []
    if ARCHITECTURE not in architectures:
        problems.append(f"architectures: expected {ARCHITECTURE}, found {architectures}")
    hidden = config.get("hidden_size")
    vocab = config.get("vocab_size")
    expect("hidden_size", target.hidden_size, hidden, "config.json", " (target)")
    expect("vocab_size", target.vocab_size, vocab, "config.json", " (target)")
    expect("num_hidden_layers", 1, config.get("num_hidden_layers"), "config.json")

    def int_field(field: str, default: int | None = None) -> int:
        value = config.get(field)
        value = default if value is None else value
        if type(value) is not int:
            problems.append(f"{field}: expected an int, found {value!r} in config.json")
            return 0
        return value

    draft_vocab = int_field("draft_vocab_size")
    heads = int_field("num_attention_heads")
    kv_heads = int_field("num_key_value_heads", heads)
    head_dim = int_field("head_dim", target.hidden_size // max(heads, 1))
    intermediate = int_field("intermediate_size")

    layers = None
    try:
        layers = aux_layer_ids(config, target.num_hidden_layers)
    except ValueError as error:
        problems.append(str(error))
    # vLLM captures id i before running layer i: ids 1..N-1 exist (0 has no residual yet).
    if layers and not all(1 <= i < target.num_hidden_layers for i in layers.vllm):
        problems.append(
            f"aux layer ids: expected vLLM ids in [1, {target.num_hidden_layers - 1}] "
            f"(target has {target.num_hidden_layers} layers), found {list(layers.vllm)} "
            f"from {layers.source}"
        )

    H, n_aux = target.hidden_size, len(layers.vllm) if layers else 3
    shapes = {
        "fc.weight": (H, n_aux * H),  # the concatenated aux states -> H
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * H),  # [embed, hidden] in
        "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": (intermediate, H),
        "midlayer.mlp.up_proj.weight": (intermediate, H),
        "midlayer.mlp.down_proj.weight": (H, intermediate),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (draft_vocab, H),
        "d2t": (draft_vocab,),
        "t2d": (target.vocab_size,),
        # Optional: vLLM loads it when present, else shares the target's embeddings.
        "embed_tokens.weight": (target.vocab_size, H),
    }
    dtypes = {"d2t": "I64", "t2d": "BOOL"}
    tensors = _read_headers(path, problems)
    if not tensors:
        problems.append("tensors: expected *.safetensors files, found none")
    for name, shape in shapes.items():
        if name not in tensors:
            if tensors and name != "embed_tokens.weight":
                problems.append(f"{name}: expected a tensor, found none in *.safetensors")
            continue
        found_dtype, found_shape, file = tensors[name]
        expect(name, f"shape {list(shape)}", f"shape {list(found_shape)}", file.name)
        if name in dtypes:
            expect(name, f"dtype {dtypes[name]}", f"dtype {found_dtype}", file.name)
    unexpected = sorted(set(tensors) - set(shapes))
    if unexpected:
        problems.append(f"tensors: expected only EAGLE-3 drafter names, found {unexpected}")

    if all(tensors.get(name, ())[:2] == (dtypes[name], shapes[name]) for name in dtypes):
        with safe_open(tensors["d2t"][2], framework="np") as f:
            d2t = f.get_tensor("d2t")
        with safe_open(tensors["t2d"][2], framework="np") as f:
            t2d = f.get_tensor("t2d")
        problems += check_vocab_maps(d2t, t2d, draft_vocab)

    if problems:
        raise DrafterValidationError(f"drafter in {path}:\n" + "\n".join(problems))
    return DrafterInfo(
        architectures=architectures,
        hidden_size=hidden,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layer_ids_vllm=layers.vllm,
        aux_layer_ids_sglang=layers.sglang,
        aux_layer_ids_source=layers.source,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        num_parameters=sum(  # weights only: d2t and t2d are index buffers
            math.prod(shape)
            for name, (_, shape, _) in tensors.items()
            if name not in ("d2t", "t2d")
        ),
        bytes_on_disk=sum(p.stat().st_size for p in path.rglob("*") if p.is_file()),
        tensors={name: (dtype, shape) for name, (dtype, shape, _) in tensors.items()},
    )

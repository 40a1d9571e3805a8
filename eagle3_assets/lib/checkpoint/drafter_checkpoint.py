"""Download an EAGLE-3 drafter from the Hugging Face hub.

The download runs `snapshot_download` in-process into the hub cache, then copies only
config.json and safetensors into `local_dir`: offline, the client returns the cached snapshot
folder as it is (its `allow_patterns` only filter what is fetched), and a SpecForge repo also
holds a pickled `training_state.pt`, which is never fetched, copied or unpickled here.

Whether it fits the target is `drafter_io.validate_drafter`'s to say: the same check training
and export run, so a drafter passes at download exactly when they can use it.
"""

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx2
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import filter_repo_objects

from eagle3_assets.lib.core.hub_files import hub_cache_dir, hub_offline

ALLOW_PATTERNS = ["config.json", "*.safetensors", "*.safetensors.index.json"]
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}

_logger = logging.getLogger(__name__)


class DrafterDownloadError(RuntimeError):
    """The drafter could not be downloaded; the message names the repo and revision."""


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

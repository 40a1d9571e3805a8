"""Lossless, resumable storage of one batch of generations.

Hours of generation must survive a crash, a kill -9 or a cancelled run, so completed rows go
to small part files as they finish, each written atomically (tmp file, fsync, rename): a part
is either whole or absent. A restart asks only for the sample ids no part holds. The batch's
final Parquet appears, by one atomic rename, only once every sample is there, with exactly one
row per sample; a partial batch is never visible under the final name.

Layout under the batch directory: `parts/part-*.parquet` while generating, then
`generations.parquet` (parts are removed once it exists).
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_assets.lib.core.atomic_files import write_atomically

FINAL_NAME = "generations.parquet"
SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),  # prompt id + a hash of the generation settings
        ("prompt_id", pa.string()),
        ("messages", pa.string()),  # JSON: the conversation sent, [{"role", "content"}]
        ("response", pa.string()),
        ("reasoning", pa.string()),  # null when the model did not think aloud
        ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("prompt_token_ids", pa.list_(pa.int64())),  # null unless the server returned them
        ("token_ids", pa.list_(pa.int64())),
        ("model", pa.string()),
        ("seed", pa.int64()),
        ("latency_s", pa.float64()),
    ]
)
_part_numbers = itertools.count()


class GenerationStore:
    def __init__(self, batch_dir: str | Path) -> None:
        self.batch_dir = Path(batch_dir)
        self.parts_dir = self.batch_dir / "parts"
        self.final_path = self.batch_dir / FINAL_NAME

    def write_part(self, rows: list[dict]) -> Path | None:
        """Persist `rows` (dicts with SCHEMA's columns) as one new part; None when empty."""
        if not rows:
            return None
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        name = f"part-{time.time_ns()}-{os.getpid()}-{next(_part_numbers)}.parquet"
        path = self.parts_dir / name
        _write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)
        return path

    def completed_ids(self) -> set[str]:
        """Sample ids already persisted, in parts or in a final file from an earlier run."""
        ids: set[str] = set()
        for path in self._files():
            ids.update(pq.read_table(path, columns=["sample_id"]).column(0).to_pylist())
        return ids

    def select(self, sample_ids: list[str], columns: list[str] | None = None) -> pa.Table:
        """One row per id of `sample_ids` that has a row, in that order.

        A sample written twice (two runs racing on one batch) counts once; rows of other ids
        (earlier settings, prompts no longer in the batch) are left out.
        """
        names = SCHEMA.names if columns is None else list(dict.fromkeys(["sample_id", *columns]))
        tables = [pq.read_table(path, columns=names) for path in self._files()]
        table = pa.concat_tables(tables) if tables else SCHEMA.empty_table().select(names)
        first: dict[str, int] = {}
        for index, sample_id in enumerate(table.column("sample_id").to_pylist()):
            first.setdefault(sample_id, index)
        return table.take(pa.array([first[i] for i in sample_ids if i in first], pa.int64()))

    def finalize(self, sample_ids: list[str]) -> Path:
        """Write the final Parquet, exactly one row per id of `sample_ids`, in that order.

        Raises if any id has no row, so an incomplete batch never gets the final name.
        """
        table = self.select(sample_ids)
        if table.num_rows != len(sample_ids):
            have = set(table.column("sample_id").to_pylist())
            missing = [sample_id for sample_id in sample_ids if sample_id not in have]
            raise ValueError(
                f"{self.batch_dir}: {len(missing)} of {len(sample_ids)} samples have no row "
                f"(first: {missing[:3]}); the batch is not complete"
            )
        _write_table(table, self.final_path)
        shutil.rmtree(self.parts_dir, ignore_errors=True)  # all in the final file now
        return self.final_path

    def _files(self) -> list[Path]:
        parts = sorted(self.parts_dir.glob("part-*.parquet")) if self.parts_dir.exists() else []
        return ([self.final_path] if self.final_path.exists() else []) + parts


def _write_table(table: pa.Table, path: Path) -> None:
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    write_atomically(path, buffer.getvalue().to_pybytes())

"""The token lists of a build: decoded once with pyarrow, file by file, copied only into the output.

Token ids are nearly all the bytes of a span store (a 1M-span store holds ~250M of them), so
they never pass through SQL. A :class:`Reader` decodes the token columns of the files likely
to be wanted in a thread pool (pyarrow releases the GIL) while DuckDB decides over the light
columns which spans are wanted; :meth:`Reader.read` then keeps the decoded files that hold
wanted spans, as decoded, and the output takes the rows it emits straight from those buffers
(:meth:`Tokens.take`). A row is addressed by ``hpos``: its file's first row in the
concatenation of the files kept, plus its row number in the file.

Memory: the decoded token columns of every file that holds a wanted span stay in memory until
the output is written (≈ 4 bytes a token id or logprob).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lightspan import store

COLUMNS = ("prompt_token_ids", "completion_token_ids", "completion_logprobs")
_SCHEMA = pa.schema([store.SPAN_SCHEMA.field(c) for c in COLUMNS])


class Tokens:
    """The token columns of the files read, one record batch per decoded chunk, as decoded."""

    def __init__(self, batches: list[pa.RecordBatch]):
        self.batches = batches
        self.base = np.concatenate([[0], np.cumsum([b.num_rows for b in batches])]).astype(np.int64)

    def take(self, column: str, hpos: np.ndarray) -> pa.ChunkedArray:
        """Rows ``hpos`` of ``column``, in that order. Ascending ``hpos`` costs one copy of the
        rows; any other order a second one."""
        hpos = np.asarray(hpos, dtype=np.int64)
        ascending = bool(np.all(hpos[1:] >= hpos[:-1]))
        order = None if ascending else np.argsort(hpos, kind="stable")
        wanted = hpos if ascending else hpos[order]
        bounds = np.searchsorted(wanted, self.base)
        parts = [_take(self.batches[b].column(column), wanted[bounds[b]:bounds[b + 1]] - self.base[b])
                 for b in range(len(self.batches)) if bounds[b + 1] > bounds[b]]
        out = pa.chunked_array(parts, _SCHEMA.field(column).type)
        if ascending:
            return out
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return pa.chunked_array([out.combine_chunks().take(pa.array(inverse))])

    def flat(self, column: str, dtype) -> list[tuple[np.ndarray, np.ndarray]]:
        """(offsets, values) of ``column`` per batch, for code that walks the token ids itself."""
        out = []
        for batch in self.batches:
            array = batch.column(column)
            values = array.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
            out.append((np.asarray(array.offsets, dtype=np.int64),
                        np.ascontiguousarray(values if len(values) else np.zeros(1, dtype))))
        return out


def _take(array: pa.ListArray, rows: np.ndarray) -> pa.ListArray:
    """``array.take(rows)`` for ascending ``rows``; without a copy when no row skipped in between
    holds a list (spans without tokens are null, with no values): the usual case."""
    offsets = np.asarray(array.offsets, dtype=np.int64)
    contiguous = (len(rows) > 0 and bool(np.all(offsets[rows[1:]] == offsets[rows[:-1] + 1]))
                  and (array.null_count == 0 or bool(np.all(array.is_valid().to_numpy(zero_copy_only=False)[rows]))))
    if not contiguous:
        return array.take(pa.array(rows))
    return pa.ListArray.from_arrays(pa.array(np.append(offsets[rows], offsets[rows[-1] + 1]), pa.int32()),
                                    array.values)


def _decode(path: str) -> tuple[list[pa.RecordBatch], list[np.ndarray]]:
    """The token columns of one file, whole, and their list lengths (NaN: no list)."""
    pf = pq.ParquetFile(store.open_input(path), memory_map=True)   # a local file mapped; an object read as it is
    present = [c for c in COLUMNS if c in pf.schema_arrow.names]
    table = pf.read(columns=present, use_threads=False) if present else pa.table({})
    for name in COLUMNS:
        if name not in present:      # an older file without the column: all null
            table = table.append_column(name, pa.nulls(pf.metadata.num_rows, _SCHEMA.field(name).type))
    table = table.select(list(COLUMNS)).cast(_SCHEMA)
    lengths = [pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False).astype(np.float64)
               for c in COLUMNS]
    return table.to_batches(), lengths


class Reader:
    """Decodes token columns file by file in a thread pool, from the moment it is told which
    files will probably be wanted (:meth:`prefetch`) — while DuckDB works on the light columns —
    to :meth:`read`, which waits for the files really wanted and drops the others unread."""

    def __init__(self, files: list[str]):
        self.files = files
        self.pool = ThreadPoolExecutor(max(1, min(pa.cpu_count(), len(files))), thread_name_prefix="lrl-tokens")
        self.jobs: dict[int, object] = {}

    def prefetch(self, wanted) -> None:
        for f in wanted:
            if f not in self.jobs:
                self.jobs[f] = self.pool.submit(_decode, self.files[f])

    def read(self, fidx: np.ndarray, frow: np.ndarray) -> tuple[Tokens, pa.Table]:
        """The token lists of the spans at (``fidx``, ``frow``), sorted by file then row.

        Returns the :class:`Tokens` and a light table (fidx, frow, hpos, plen, clen, llen) of
        those spans that have a token list, for SQL.
        """
        starts = np.searchsorted(fidx, np.arange(len(self.files) + 1))
        needed = [f for f in range(len(self.files)) if starts[f + 1] > starts[f]]
        for f in set(self.jobs) - set(needed):
            self.jobs.pop(f).cancel()    # not started yet: never decoded; started: result dropped
        self.prefetch(needed)
        batches, base, light = [], 0, {k: [] for k in ("fidx", "frow", "hpos", "plen", "clen", "llen")}
        for f in needed:
            file_batches, lengths = self.jobs[f].result()
            rows = frow[starts[f]:starts[f + 1]].astype(np.int64)
            rows = rows[~np.all([np.isnan(length[rows]) for length in lengths], axis=0)]
            light["fidx"].append(np.full(len(rows), f, dtype=np.int64))
            light["frow"].append(rows)
            light["hpos"].append(base + rows)
            for key, length in zip(("plen", "clen", "llen"), lengths):
                light[key].append(np.nan_to_num(length[rows]).astype(np.int64))
            batches += file_batches
            base += sum(b.num_rows for b in file_batches)
        table = pa.table({k: pa.array(np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in light.items()})
        return Tokens(batches), table

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def read(files: list[str], fidx: np.ndarray, frow: np.ndarray) -> tuple[Tokens, pa.Table]:
    """:meth:`Reader.read` without a prefetch."""
    reader = Reader(files)
    try:
        return reader.read(fidx, frow)
    finally:
        reader.close()

"""Token lists read with pyarrow and taken without copies where possible (lightningrl/tokens.py)."""

import numpy as np
import pyarrow as pa

from lightspan import store
from lightspan.lightningrl import tokens


def _batch(prompts):
    n = len(prompts)
    return pa.record_batch([pa.array(prompts, pa.list_(pa.int32())), pa.nulls(n, pa.list_(pa.int32())),
                            pa.nulls(n, pa.list_(pa.float32()))], names=list(tokens.COLUMNS))


def test_take_in_any_order_across_batches():
    t = tokens.Tokens([_batch([[1, 2], None, [3], [4, 5, 6]]), _batch([None, [7], [8, 9]])])
    assert t.take("prompt_token_ids", np.array([0, 2, 3])).to_pylist() == [[1, 2], [3], [4, 5, 6]]   # no copy
    assert t.take("prompt_token_ids", np.array([0, 3, 5])).to_pylist() == [[1, 2], [4, 5, 6], [7]]   # a gap
    assert t.take("prompt_token_ids", np.array([6, 0, 5, 2])).to_pylist() == [[8, 9], [1, 2], [7], [3]]


def test_contiguous_rows_share_the_decoded_buffer():
    batch = _batch([[1, 2], None, [3], [4, 5, 6]])
    taken = tokens.Tokens([batch]).take("prompt_token_ids", np.array([0, 2, 3])).chunk(0)
    assert taken.values.buffers()[1].address == batch.column(0).values.buffers()[1].address


def test_read_keeps_only_spans_with_lists_and_their_lengths(tmp_path):
    rows = [{f.name: None for f in store.SPAN_SCHEMA} | {"trace_id": "t", "span_id": str(i)} for i in range(4)]
    rows[1] |= {"prompt_token_ids": [1, 2, 3], "completion_token_ids": [4], "completion_logprobs": [-1.0]}
    rows[3] |= {"prompt_token_ids": [5], "completion_token_ids": [6, 7], "completion_logprobs": [-1.0]}
    path = store.write_table(tmp_path, "spans", pa.Table.from_pylist(rows, schema=store.SPAN_SCHEMA))
    reader = tokens.Reader([str(path)])
    reader.prefetch([0])
    found, light = reader.read(np.zeros(3, np.int64), np.array([0, 1, 3]))    # row 2 is not wanted
    reader.close()
    assert light.to_pydict() == {"fidx": [0, 0], "frow": [1, 3], "hpos": [1, 3], "plen": [3, 1],
                                 "clen": [1, 2], "llen": [1, 1]}
    assert found.take("completion_token_ids", np.array([1, 3])).to_pylist() == [[4], [6, 7]]

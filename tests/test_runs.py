"""A demo or experiment wipes only a data directory that an earlier demo or experiment made."""

import pytest

from lightspan.core.config import ConfigError
from lightspan.runs import RUN_MARKER, fresh_data_dir


def test_a_new_directory_is_made_and_marked_then_wiped_by_the_next_run(tmp_path):
    data = fresh_data_dir(str(tmp_path / "run"), "demo")
    assert (data / "logs").is_dir() and (data / RUN_MARKER).is_file()
    (data / "spans").mkdir()
    again = fresh_data_dir(str(data), "experiment")
    assert again == data and not (data / "spans").exists() and (data / RUN_MARKER).is_file()


def test_a_directory_it_did_not_make_is_refused_and_left_alone(tmp_path):
    store = tmp_path / "lightspan-data"
    (store / "spans").mkdir(parents=True)
    (store / "spans" / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError) as err:
        fresh_data_dir(str(store), "experiment")
    assert err.value.field == "experiment.data_dir"
    assert (store / "spans" / "x.parquet").read_bytes() == b"PAR1"

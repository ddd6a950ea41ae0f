"""A rank that raises: the job exits non-zero within a bounded time and shows that rank's error.

The failure is real and local to one rank: a sample that rank 2 alone cannot read (as if a file
were missing on one node). Every rank packs the same global stream of rows, so rank 2 fails while
building the third row, when the other ranks are by then blocked in a collective and must be
stopped by the launcher.
"""

import time

import pytest

from cpvlm.train.command import main as train_main


@pytest.mark.launch  # the local launcher's processes: it must stop the ranks blocked behind rank 2
def test_a_rank_that_raises_stops_the_job_with_its_error(tmp_path, capsys):
    flags = ["--cp", "2", "--dp", "2", "--seq-len", "64", "--steps", "6"]
    flags += ["--data", "_train_sources:unreadable_on_rank2", "--out", str(tmp_path / "run")]
    start = time.monotonic()
    assert train_main(flags) == 1
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert "cpvlm train: rank 2 of 4 failed:" in err, err
    assert "OSError: sample 5: cannot read shard-00005 on this node" in err
    assert "Traceback" in err
    # Start-up and two steps take a few seconds; stopping the blocked ranks takes 1-2 s more.
    assert elapsed < 60, elapsed

"""A rank that raises: the job exits non-zero within a bounded time and shows that rank's error.

The failure is real: bad user data that only one DP replica reads (an image token without an
image, in the third sample of DP rank 1). Its two CP ranks raise while building their second row;
the ranks of DP replica 0 are by then blocked in a collective and must be stopped by the launcher.
"""

import re
import time

from cpvlm.train.command import main as train_main


def test_a_rank_that_raises_stops_the_job_with_its_error(tmp_path, capsys):
    flags = ["--cp", "2", "--dp", "2", "--seq-len", "64", "--steps", "6"]
    flags += ["--data", "_train_sources:broken_on_dp1", "--out", str(tmp_path / "run")]
    start = time.monotonic()
    assert train_main(flags) == 1
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert re.search(r"cpvlm train: rank [23] of 4 failed:", err), err
    assert "ValueError: sample 5: 1 image tokens (id 502) need both pixel_values" in err
    assert "Traceback" in err
    # Start-up and one step take a few seconds; stopping the blocked ranks takes 1-2 s more.
    assert elapsed < 60, elapsed

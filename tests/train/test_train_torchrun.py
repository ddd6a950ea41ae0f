"""Under torchrun, ``python -m cpvlm.train`` uses the launcher's ranks: dp = world / cp."""

import json
import subprocess
import sys


def test_torchrun_ranks_with_dp_from_the_world(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["-m", "cpvlm.train", "--cp", "1", "--steps", "2", "--seq-len", "160"]
    cmd += ["--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    # Each rank destroys its process group before exit (see tests/test_readme.py).
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    assert "cp 1 x dp 2 = 2 ranks" in done.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["ranks"] for r in records] == [2, 2]
    assert (out / "checkpoints" / "step_00000002" / "meta.json").is_file()

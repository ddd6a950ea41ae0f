"""``cpvlm train --model <family>-tiny`` works for every family: the launcher's checks, then the
training loop on 2 real gloo ranks (CP 2, FSDP2, synthetic data), 2 steps each; and one family
end to end through the command.

The loop is run directly on the pooled ranks of ``run_distributed`` (as the local launcher runs it
on its processes) so that every family costs seconds, not a process launch.
"""

import json

import pytest
import torch

pytest.importorskip("transformers")

from hf_families import FAMILIES  # noqa: E402

from cpvlm.testing import run_distributed  # noqa: E402
from cpvlm.train import TrainConfig, launcher  # noqa: E402
from cpvlm.train.command import main as train_main  # noqa: E402


def _train(rank, world_size, config):
    from cpvlm.train.loop import train_rank

    return train_rank(config, torch.device("cpu"))


@pytest.mark.parametrize("name", FAMILIES)
def test_train_runs_on_every_family(tmp_path, name):
    config = TrainConfig().replace(
        model={"name": name},
        parallel={"cp": 2},
        data={"seq_len": 160},
        run={"steps": 2, "out": str(tmp_path)},
    )
    config = launcher.prepare(config, world_size=2)
    summary = run_distributed(_train, 2, config, timeout=300)[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["ranks"] == 2 and r["grad_norm"] > 0 for r in records)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert summary is not None


def test_train_command_on_an_moe_family(tmp_path):
    """The command users run, with the router loss on (the tiny Qwen3-VL-MoE's default)."""
    flags = ["--model", "qwen3-vl-moe-tiny", "--cp", "2", "--steps", "2", "--seq-len", "160"]
    assert train_main(["--out", str(tmp_path), *flags]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["tokens"] > 0 for r in records)

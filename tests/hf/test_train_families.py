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

from hf_families import FAMILIES, TILED  # noqa: E402

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
        data={"seq_len": 176 if name in TILED else 160, "num_workers": 0},  # pooled: daemons
        run={"steps": 2, "out": str(tmp_path)},
    )
    config, _, _ = launcher.prepare(config, world_size=2)  # (config, resume point, lines)
    summary = run_distributed(_train, 2, config, timeout=300)[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["ranks"] == 2 and r["grad_norm"] > 0 for r in records)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert summary is not None


@pytest.mark.launch  # the local launcher's processes, as a user's command starts them
def test_train_command_on_an_moe_family(tmp_path):
    """The command users run, with the router loss on (the tiny Qwen3-VL-MoE's default)."""
    flags = ["--model", "qwen3-vl-moe-tiny", "--cp", "2", "--steps", "2", "--seq-len", "160"]
    assert train_main(["--out", str(tmp_path), *flags]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["tokens"] > 0 for r in records)


@pytest.mark.parametrize("name", FAMILIES)
def test_synthetic_samples_pass_the_data_path_of_every_family(name):
    """The data path counts placeholders by the family's token-type rule: GLM-4V's video frames
    are image tokens inside video markers, which an id-only rule would reject as bad samples."""
    from cpvlm.data import check_tokens, plan_tokenized
    from cpvlm.hf import TINY_MODELS, adapter_for
    from cpvlm.train.loader import token_ids
    from cpvlm.train.synthetic import SyntheticVLMData

    config = TINY_MODELS[name]()
    source, ids = SyntheticVLMData(config, seed=0), token_ids(config)
    rows = adapter_for(config).item_sizes  # pixel rows of a grid, by the family's rule
    videos, tiles = 0, 0
    for i in range(40):
        raw = source[i]
        plan = plan_tokenized(raw, ids, i, "synthetic")  # raises DataError on a mismatch
        check_tokens(plan, ids)
        videos += len(plan.videos)
        tiles = max([tiles] + [it.grid[0] for it in plan.images])
        assert sum(rows(it.grid, "video")[0] for it in plan.videos) == (
            raw["pixel_values_videos"].shape[0] if plan.videos else 0
        )
    if name in TILED:  # images of several tiles (or crops) occur
        assert tiles > 1
    if name == "internvl-tiny":  # its video frames are one-tile images
        assert videos == 0
    else:
        assert videos > 0 or not adapter_for(config).takes_videos

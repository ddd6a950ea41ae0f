"""Per-document positions of text documents: the array path equals the per-document one."""

from types import SimpleNamespace

import pytest
import torch

from cpvlm import ShardPlan
from cpvlm.hf import inputs
from cpvlm.hf.adapter import ModulePaths

ADAPTER = SimpleNamespace(modules=ModulePaths())  # text documents only: nothing else is asked


@pytest.mark.parametrize("mrope", [False, True])
def test_text_documents_get_the_positions_of_each_document_alone(mrope):
    lens = [5, 1, 9, 3]
    model = SimpleNamespace(model=SimpleNamespace(get_rope_index=print) if mrope else None)
    ids = torch.zeros(2, sum(lens), dtype=torch.long)
    plan = ShardPlan(sum(lens), 2, doc_lens=lens)
    fast = inputs._positions(ADAPTER, model, ids, ids, None, ([], [], []), {}, plan, lens)
    slow = torch.cat(
        [
            inputs._document_positions(
                ADAPTER, model, ids[:, :n], ids[:, :n], None, ([], [], []), {}
            )
            for n in lens
        ],
        dim=-1,
    )
    row = torch.cat([torch.arange(n) for n in lens])
    expected = row.expand(*((3,) if mrope else ()), 2, -1)
    assert torch.equal(fast, expected) and torch.equal(slow, expected)

"""Host objects between the DP ranks of one CP slice: what splitting data planning exchanges.

Each DP rank plans part of a packing window; the ranks then need everyone's sample sizes (a few
ints per sample: ``gather``) and, once the rows are dealt, the planned samples of their own rows
that another rank planned (``swap``: each plan travels once, from its planner to its row's
owner, point to point; ``pack_plans`` first: a plan's ids as numpy arrays pickle ten times
faster than as tensors). The group should be a gloo group of the ranks that share a CP rank
(``dist.new_group(ranks, backend="gloo")``): these are host objects, kept off the accelerator's
group and its stream.
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import torch
import torch.distributed as dist

from cpvlm.data.sample import SamplePlan


def pack_plans(plans: dict[int, SamplePlan]) -> dict[int, SamplePlan]:
    """``plans`` with ids and labels as numpy arrays, to pickle (``unpack_plans`` undoes it)."""
    return {
        p: replace(s, input_ids=s.input_ids.numpy(), labels=s.labels.numpy())
        for p, s in plans.items()
    }


def unpack_plans(plans: dict[int, SamplePlan]) -> dict[int, SamplePlan]:
    return {
        p: replace(s, input_ids=torch.from_numpy(s.input_ids), labels=torch.from_numpy(s.labels))
        for p, s in plans.items()
    }


class DPExchange:
    """``gather`` and ``swap`` over ``group`` (see the module docstring)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def swap(self, outgoing: list) -> list:
        """``outgoing[d]``: the object for rank ``d`` (None: nothing); returns what each rank
        sent here (None where nothing). One all-gather of the byte sizes, then point to point."""
        payload = [
            b"" if o is None or d == self.rank else pickle.dumps(o) for d, o in enumerate(outgoing)
        ]
        sizes = torch.tensor([len(b) for b in payload], dtype=torch.long)
        table = [torch.zeros_like(sizes) for _ in range(self.size)]
        dist.all_gather(table, sizes, group=self.group)
        works, inbox, sent = [], {}, []
        for d in range(self.size):
            if d == self.rank:
                continue
            peer = dist.get_global_rank(self.group, d)
            if int(table[d][self.rank]):
                inbox[d] = torch.empty(int(table[d][self.rank]), dtype=torch.uint8)
                works.append(dist.irecv(inbox[d], src=peer, group=self.group))
            if payload[d]:
                sent.append(torch.frombuffer(bytearray(payload[d]), dtype=torch.uint8))
                works.append(dist.isend(sent[-1], dst=peer, group=self.group))
        for work in works:
            work.wait()
        return [
            pickle.loads(inbox[d].numpy().tobytes()) if d in inbox else None
            for d in range(self.size)
        ]

"""The training state the regroup workers share: a step and a value, snapshotted as a dict.

``ACCUMULATOR_STATE`` is source for a worker script, pasted after its ``import elastic``
and ``import torch.distributed as dist``; the script subclasses ``AccumulatorState`` with
its own ``sync`` (which rank's state wins after a membership change, and what the script
records of it, differ by test), most of them starting from ``gather_snapshots``.
"""

from __future__ import annotations

ACCUMULATOR_STATE = """
class AccumulatorState(elastic.State):
    def __init__(self):
        self.step, self.value = 0, 0

    def capture_snapshot(self):
        return {"step": self.step, "value": self.value}

    def apply_snapshot(self, snapshot):
        self.step, self.value = snapshot["step"], snapshot["value"]

    def gather_snapshots(self, world_size):
        every = [None] * world_size
        dist.all_gather_object(every, self.capture_snapshot())
        return every

"""

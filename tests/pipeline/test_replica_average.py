"""The emulator's replica averaging: the last replica to arrive averages for all.

Covers: pipeswap/pipeline/replica_average.py.
"""

from __future__ import annotations

import torch

from pipeswap.pipeline.replica_average import EmulatedReplicas


class _Stage:
    def __init__(self, replica: int, grads: list[torch.Tensor]) -> None:
        self.stage, self.replica, self.grads, self.finished = 1, replica, grads, 0

    def gradients(self) -> list[torch.Tensor]:
        return self.grads

    def after_average(self) -> None:
        self.finished += 1


def test_the_last_replica_averages_every_replicas_gradients_in_replica_order() -> None:
    average = EmulatedReplicas(3)
    values = [torch.tensor([1.0, 2.0]), torch.tensor([0.1, 0.2]), torch.tensor([1e8, -3.0])]
    stages = [_Stage(d, [v.clone(), v.clone() * 2]) for d, v in enumerate(values)]
    # Arrival order need not be replica order; the sum is.
    assert average(5, stages[2]) is False  # type: ignore[arg-type]
    assert average(5, stages[0]) is False  # type: ignore[arg-type]
    assert stages[2].grads[0].equal(values[2])  # nothing changes before the last arrives
    assert average(5, stages[1]) is True  # type: ignore[arg-type]
    want = ((values[0] + values[1]) + values[2]) / 3
    for stage in stages:
        assert torch.equal(stage.grads[0], want)  # bit for bit
        assert torch.equal(stage.grads[1], ((2 * values[0] + 2 * values[1]) + 2 * values[2]) / 3)
    # The waiting replicas finish their backward; the caller finishes its own.
    assert [s.finished for s in stages] == [1, 0, 1]

"""The planning problem: a workload on some GPUs of a topology, within a memory budget."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from pipeswap.hardware.topology import Topology
from pipeswap.swap.plan.channels import representative_group
from pipeswap.swap.plan.scoring import Assignment, Scored, score
from pipeswap.swap.plan.tensors import SavedTensorAt
from pipeswap.swap.plan.workload import Workload

__all__ = ["Case", "all_tensors"]

T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    """One planning problem: the workload on ``gpus`` of ``topology`` within a budget.

    ``topology`` carries ``budget_bytes`` as every GPU's memory, so simulating the
    exported graph on it reproduces the planner's numbers. Scores are remembered per
    assignment, so a policy's final plan is not simulated twice.
    """

    workload: Workload
    topology: Topology
    gpus: tuple[str, ...]
    budget_bytes: int
    sync_every: int
    bucket_bytes: int
    _scored: dict[Any, Scored] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )
    # Results of whole policies on this case (the MIP's outcome per time limit), so that
    # ``auto`` after ``mip`` on one case does not solve the MIP again.
    memo: dict[Any, Any] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def score(self, assignment: Assignment) -> Scored:
        key = _assignment_key(assignment, self.gpus)
        if key not in self._scored:
            self._scored[key] = score(
                self.workload,
                self.topology,
                self.gpus,
                assignment,
                sync_every=self.sync_every,
                bucket_bytes=self.bucket_bytes,
            )
        return self._scored[key]

    def remembered(self, key: Any, make: Callable[[], T]) -> T:
        """``make()``, made once per case and ``key`` (a policy's plan, the bounds, ...)."""
        if key not in self.memo:
            self.memo[key] = make()
        value: T = self.memo[key]
        return value

    def reduced(self) -> Case:
        """The same problem on one channel group when every group has one shape: ranking
        candidates there costs a fraction of the full graph. Else the case itself."""
        group = representative_group(self.topology, self.gpus)
        return self if group is None else replace(self, gpus=tuple(group))


def _assignment_key(assignment: Assignment, gpus: Sequence[str]) -> tuple[Any, ...]:
    return tuple(
        (
            gpu,
            tuple(assignment.swaps.get(gpu, ())),
            float(assignment.offsets_s.get(gpu, 0.0)),
            tuple(sorted(assignment.recomputed(gpu))),
            tuple(sorted(assignment.selective)),
        )
        for gpu in gpus
    )


def all_tensors(workload: Workload) -> list[SavedTensorAt]:
    """Every saved tensor a plan could swap (empty ones cannot help; a recomputed layer
    has none), in forward order."""
    return [
        SavedTensorAt(layer, index, nbytes)
        for layer, tensors in enumerate(workload.swappable)
        for index, nbytes in tensors
        if nbytes > 0
    ]

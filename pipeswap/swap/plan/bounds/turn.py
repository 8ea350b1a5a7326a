"""The turn bound: each GPU's bytes leave during its forward and come back during its backward.

docs/concepts.md, "Why the swap bounds are valid" ("Turn bound" and the terms after it),
says why every term holds for every plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeswap.hardware.topology import Topology
from pipeswap.swap.plan.bounds.inputs import BoundInputs
from pipeswap.swap.plan.bounds.recursion import micro_batch_s
from pipeswap.swap.plan.bounds.relief import min_max, recompute_limit_s
from pipeswap.swap.plan.bounds.sharing import channel_terms, sharing_terms
from pipeswap.swap.plan.iteration import gradient_buckets
from pipeswap.swap.plan.workload import Workload

__all__ = ["TurnBound", "turn_bound"]


@dataclass(frozen=True)
class TurnBound:
    """The turn bound (docs/concepts.md): ``bound_s = max_g K * microbatch_s[g] + tail``.

    ``microbatch_s`` is each GPU's shortest possible micro-batch; ``tail_s`` the last
    bucket's all-reduce plus the optimizer step; ``binding`` the GPU that sets the bound.
    """

    bound_s: float
    microbatch_s: dict[str, float]
    tail_s: float
    channel_s: dict[str, float]
    binding: str
    recompute_s: float = 0.0  # T at the bound (docs/concepts.md, "With recomputation")


def turn_bound(
    workload: Workload,
    topology: Topology,
    gpus: Sequence[str],
    budget_bytes: int,
    *,
    sync_every: int = 1,
    bucket_bytes: int | None = None,
    recompute: bool = True,
) -> TurnBound:
    """No plan can run one iteration faster than this (the turn bound).

    ``bucket_bytes`` (the all-reduce bucket size) adds the last bucket's all-reduce to the
    tail; None leaves it out (still a bound, a looser one). Plans that recompute are
    covered by the minimum over their recompute seconds T ("With recomputation");
    ``recompute=False`` gives the bound of plans that only swap.
    """
    inputs = BoundInputs.of(workload, topology, gpus, budget_bytes, sync_every)
    workload = inputs.workload
    tail = workload.optimizer_step_s
    n = len(gpus)
    if n > 1 and bucket_bytes is not None:
        buckets = gradient_buckets(workload, bucket_bytes)
        # Only a bucket closed by layer 0's backward must start after the last backward.
        if buckets and buckets[-1].layer == 0:
            last_bytes = buckets[-1].bytes
            first_hop = min(topology.links[inputs.hops(g)[0][0]].bytes_per_s for g in gpus)
            tail += 2 * (n - 1) * (last_bytes / n) / first_hop
    inputs = BoundInputs(inputs.micro, topology, inputs.gpus, sync_every, tail)
    limit = recompute_limit_s(workload) if recompute else 0.0
    if limit <= 0 or not any(inputs.micro.needs):
        return _turn_bound(inputs)
    chain = sync_every * (sum(workload.forward_s) + sum(workload.backward_s)) + tail
    cache: dict[float, TurnBound] = {}

    def at(seconds: float) -> TurnBound:
        if seconds not in cache:
            cache[seconds] = _turn_bound(inputs.allowing(seconds), seconds)
        return cache[seconds]

    def increasing(seconds: float) -> float:
        return chain + sync_every * seconds

    bound, seconds = min_max(lambda t: at(t).bound_s, increasing, limit)
    found = at(seconds)
    binding = "compute + recompute" if increasing(seconds) >= found.bound_s else found.binding
    return TurnBound(bound, found.microbatch_s, tail, found.channel_s, binding, seconds)


def _turn_bound(inputs: BoundInputs, recompute_s: float = 0.0) -> TurnBound:
    """Every term of the turn bound, with bytes lowered by the inputs' relief (None: no
    plan recomputes)."""
    micro = {gpu: micro_batch_s(inputs.micro, inputs.path_bytes_per_s(gpu)) for gpu in inputs.gpus}
    slowest = max(micro, key=lambda g: micro[g])
    terms = {slowest: inputs.sync_every * micro[slowest] + inputs.tail_s}
    channel = channel_terms(inputs)
    channel.update(sharing_terms(inputs, micro))
    terms.update(channel)
    binding = max(terms, key=lambda name: terms[name])
    return TurnBound(
        bound_s=terms[binding],
        microbatch_s=micro,
        tail_s=inputs.tail_s,
        channel_s=channel,
        binding=binding,
        recompute_s=recompute_s,
    )

"""Swap planning: the SwapPlan contract, the workload model, the policies and their bounds.

``from pipeswap.swap.plan import SwapPlan`` gives the contract; the planner is
:func:`pipeswap.swap.plan.planner.make_plan`. The stage-swap planner is the ``stage_*``
modules: a pipeline stage's costs (``stage_costs``), what one stage swaps or recomputes
(``stage_swap``), every stage's plan coordinated over shared switches (``stage_plans``)
and which GPU each stage sits on (``stage_mapping``).
"""

from pipeswap.swap.plan import contract
from pipeswap.swap.plan.contract import *  # noqa: F403 - the package's face is the contract

__all__ = contract.__all__

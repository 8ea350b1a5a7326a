"""The commands' own settings: what they write, and the options only one command has.

Settings a component owns are its config's fields (TrainConfig, SwapConfig,
PipelineConfig, ProfileConfig, ...), which every command that takes them declares with
:func:`pipeswap.commands.options.add_options`; these are the rest. ``Outputs`` holds the
files and forms a command writes, one field per flag, shared by every command that writes
it (a command words what its ``--out`` holds with ``helps``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeswap.config_fields import option
from pipeswap.hardware.presets import PCIE_GB_PER_S

__all__ = [
    "COMMAND_SETTINGS",
    "GridOptions",
    "Outputs",
    "PlanOptions",
    "SimulateOptions",
    "TopologyOptions",
]


@dataclass(frozen=True, kw_only=True)
class Outputs:
    """What a command writes besides its table."""

    json: bool = option(False, help="print the result as JSON (notes go to stderr)")
    out: str | None = option(None, metavar="PATH", help="where to write the result")
    report: str | None = option(None, metavar="PATH", help="write the pipeswap.train/2 JSON report")
    trace: str | None = option(
        None, metavar="FILE", help="write a Chrome/Perfetto trace (JSON) of the run"
    )
    timeline: str | None = option(None, metavar="FILE", help="write a PNG Gantt chart of the run")
    graph_out: str | None = option(
        None,
        metavar="FILE",
        help="write the exact task graph that was scored (pipeswap.graph/1)",
    )
    layout_out: str | None = option(
        None, metavar="FILE", help="write the best layout (pipeswap.layout/1)"
    )


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """`pipeswap plan`'s own settings: which GPUs, one policy or all, or every layout."""

    gpus: int | None = option(
        None, metavar="N", help="data-parallel degree: the first N GPUs (default: all)"
    )
    compare: bool = option(False, help="run every policy and print one table")
    layouts: bool = option(
        False,
        help="search data parallel, pipelines, pipelines that swap and pipeline x data "
        "parallel, simulated, and print the fastest that fits the budget",
    )


@dataclass(frozen=True, kw_only=True)
class GridOptions:
    """`pipeswap schedule show`'s own settings: the pipeline's size and the grid's ticks."""

    grid_stages: int | None = option(None, metavar="STAGES", help="pipeline stages (ranks)")
    forward_cost: int = option(1, help="ticks per forward")
    backward_cost: int = option(1, help="ticks per backward")
    actions: bool = option(False, help="also print each rank's actions")


@dataclass(frozen=True, kw_only=True)
class SimulateOptions:
    """`pipeswap simulate`'s input."""

    graph: str | None = option(
        None, metavar="FILE", help="task graph JSON (format pipeswap.graph/1)"
    )


@dataclass(frozen=True, kw_only=True)
class TopologyOptions:
    """`pipeswap topology`'s own settings: a preset's PCIe generation, a quick calibration."""

    pcie: str | None = option(
        None,
        choices=tuple(PCIE_GB_PER_S),
        help="PCIe generation of a preset's links (default gen3; measured x16 bandwidth)",
    )
    quick: bool = option(False, help="small sizes, few repeats (tests)")


# Every config of this module, for the tests that walk the flag table.
COMMAND_SETTINGS: tuple[type, ...] = (
    Outputs,
    PlanOptions,
    GridOptions,
    SimulateOptions,
    TopologyOptions,
)

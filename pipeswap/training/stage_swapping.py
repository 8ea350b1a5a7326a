"""Old name of :mod:`pipeswap.training.pipeline_stage_swaps`, kept until its last importers move (then deleted)."""

import sys

from pipeswap.training import pipeline_stage_swaps as _target
from pipeswap.training.pipeline_stage_swaps import *  # noqa: F403

sys.modules[__name__] = _target

"""Old name of :mod:`pipeswap.training.pipeline_parallel`, kept until its last importers move (then deleted)."""

import sys

from pipeswap.training import pipeline_parallel as _target
from pipeswap.training.pipeline_parallel import *  # noqa: F403

sys.modules[__name__] = _target

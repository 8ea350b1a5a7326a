"""Old name of :mod:`pipeswap.schedule.pipeline_config`, kept until its last importers move (then deleted)."""

import sys

from pipeswap.schedule import pipeline_config as _target
from pipeswap.schedule.pipeline_config import *  # noqa: F403

sys.modules[__name__] = _target

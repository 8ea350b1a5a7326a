"""Old name of :mod:`pipeswap.profiling.profile`, kept until its last importers move (then deleted)."""

import sys

from pipeswap.profiling import profile as _target
from pipeswap.profiling.profile import *  # noqa: F403

sys.modules[__name__] = _target

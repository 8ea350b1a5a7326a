"""Old name of :mod:`pipeswap.swap.swap_config`, kept until its last importers move (then deleted)."""

import sys

from pipeswap.swap import swap_config as _target
from pipeswap.swap.swap_config import *  # noqa: F403

sys.modules[__name__] = _target

"""Old name of :mod:`pipeswap.config_fields`, kept until its last importers move (then deleted)."""

import sys

from pipeswap import config_fields as _target
from pipeswap.config_fields import *  # noqa: F403

sys.modules[__name__] = _target

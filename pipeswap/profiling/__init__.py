"""Per-layer costs of a training step: the Profile contract and how it is measured or estimated.

The package imports nothing when it is imported, so that reading a profile
(:mod:`pipeswap.profiling.profile`) loads no torch: the schedule and the planner read
profiles and need none. The modules: ``profile`` (the pipeswap.profile/1 contract),
``measure`` (on a device), ``estimate`` (on meta), ``saved`` (which tensors autograd
saves, named), ``table`` (a profile as text), ``profile_config`` (the ``profile``
command's settings), and the meters of a step's memory and time.
"""

__all__: list[str] = []

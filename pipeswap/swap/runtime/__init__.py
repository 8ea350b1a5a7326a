"""The swap runtime: a SwapPlan applied to a real model's training steps (CPU or CUDA)."""

__all__: list[str] = []

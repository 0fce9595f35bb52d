"""Moved to clover/sizes.py (torch-free, so `clover info --preset` answers without torch); re-exported."""

from ..sizes import (DIFFUSION_EXTRAS, GIB, RUNTIME_OVERHEAD_BYTES, activation_bytes_per_token,  # noqa: F401
                     int4_memory_plan, model_stats, param_shapes, serve_memory_plan, train_memory_plan)

"""Numerical kernels. Each op has `naive.py` (plain loops: the specification) and a fast version
tested against it (`tests/test_ops.py`)."""

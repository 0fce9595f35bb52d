"""Inference back ends besides PyTorch: GGUF export (`gguf_export`) and llama.cpp (`llamacpp`).

Nothing here is imported by the rest of Clover unless asked for: `gguf` and the llama.cpp build are
optional (docs/llamacpp.md).
"""

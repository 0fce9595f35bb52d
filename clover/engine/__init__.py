"""Decoding: fill policies, sampling and the batched block-diffusion / AR / self-speculative engine."""

from .engine import MODES, DecodeConfig, Engine
from .policies import Policy, make_policy
from .sampling import SamplingParams, sample
from .sequence import Sequence

__all__ = ["MODES", "DecodeConfig", "Engine", "Policy", "SamplingParams", "Sequence", "make_policy", "sample"]

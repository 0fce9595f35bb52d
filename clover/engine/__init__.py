"""Decoding: fill policies, sampling and the batched block-diffusion / AR / self-speculative engine."""

from .engine import DEFAULTS, MODES, DecodeConfig, Engine
from .policies import Policy, make_policy
from .sampling import SamplingParams, sample
from .sequence import Sequence

__all__ = ["DEFAULTS", "MODES", "DecodeConfig", "Engine", "Policy", "SamplingParams", "Sequence", "make_policy", "sample"]

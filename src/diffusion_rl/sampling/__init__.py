"""Samplers shared by serving and rollout (capture=True records a trace)."""

from .token import TokenSample, TokenSamplerConfig, sample_tokens

__all__ = ["TokenSample", "TokenSamplerConfig", "sample_tokens"]

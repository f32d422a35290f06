"""Samplers shared by serving and rollout (capture=True records a trace): the token world's
block sampler and the flow world's ODE / SDE sampler."""

from .flow import FlowSample, FlowSamplerConfig, flow_sigmas, sample_flow
from .token import TokenSample, TokenSamplerConfig, sample_tokens

__all__ = [
    "FlowSample",
    "FlowSamplerConfig",
    "TokenSample",
    "TokenSamplerConfig",
    "flow_sigmas",
    "sample_flow",
    "sample_tokens",
]

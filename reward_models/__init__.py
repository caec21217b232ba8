"""Reward models: scalar and generative reward models, rule verifiers, the colocated reward pool."""

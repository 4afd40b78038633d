"""Measurements of a model run by the engine (``drift``: how far each recurrent-state dtype moves the logprobs)."""

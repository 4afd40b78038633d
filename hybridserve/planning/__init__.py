"""``hybridserve plan``'s package: a model's cache and weight bytes planned from its config and checkpoint headers,
with the engine's own layout and capacity arithmetic (``cache/``) and the families' specs (``models/``)."""

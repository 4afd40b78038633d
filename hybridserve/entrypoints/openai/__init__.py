"""The OpenAI-compatible HTTP server (``hybridserve serve``); needs the ``server`` extra (fastapi, uvicorn)."""

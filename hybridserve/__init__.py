"""hybridserve: serving engine for hybrid attention/recurrent language models."""

from hybridserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from hybridserve.entrypoints.llm import LLM

        return LLM
    if name == "EngineConfig":
        from hybridserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)

"""Tidal's inference engine: a vLLM-compatible engine small enough to read in an afternoon."""

from tidal_engine.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported lazily so `import tidal_engine` stays cheap (no torch model code).
    if name == "LLM":
        from tidal_engine.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]

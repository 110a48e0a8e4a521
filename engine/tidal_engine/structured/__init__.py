"""Structured outputs: constrain sampling to a JSON schema, regex, choice list or EBNF grammar.

``StructuredOutputsParams`` (vLLM's field names) is validated on construction; the engine compiles
it once per request through its ``GrammarCompilerCache`` (xgrammar backend, vLLM's default) and
gives every sample its own ``GrammarMatcher``. The sampler masks disallowed tokens with the
matcher's bitmask; the engine advances the matcher with each sampled token.
"""

from tidal_engine.structured.backend import GrammarCompilerCache, GrammarMatcher, apply_bitmasks
from tidal_engine.structured.params import MAX_SCHEMA_DEPTH, StructuredOutputsParams

__all__ = [
    "MAX_SCHEMA_DEPTH",
    "GrammarCompilerCache",
    "GrammarMatcher",
    "StructuredOutputsParams",
    "apply_bitmasks",
]

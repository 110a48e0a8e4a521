"""The LLMService API: typed spec models and validation beyond the CRD schema."""

from .types import LLMServiceSpec, OperatorConfig
from .validation import ValidationProblem, parse_spec, validate_spec

__all__ = ["LLMServiceSpec", "OperatorConfig", "ValidationProblem", "parse_spec", "validate_spec"]

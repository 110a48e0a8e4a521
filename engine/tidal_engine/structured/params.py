"""Validated request-side description of an output constraint (vLLM's ``StructuredOutputsParams``)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr


def xgrammar() -> Any:
    """The xgrammar module, imported on the first structured request: engines that never get
    one (benchmarks, GPU images without it) start without it."""
    import xgrammar as module

    return module



# vLLM (0.32+) rejects JSON schemas nested deeper than this; so do we. Objects and arrays of the
# schema document both count as a level, so the check also guards the converter's recursion.
MAX_SCHEMA_DEPTH = 64

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None  # a JSON schema (dict or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's GBNF dialect), root rule `root`
    json_object: bool | None = None  # any JSON object
    # xgrammar's structural tag (JSON text): free text with constrained regions, e.g. the tool
    # calls of a strict function in tool_choice "auto" (server/tool_parsers/strict.py).
    structural_tag: str | None = None
    # The parsed grammar, kept so the engine compiles without parsing twice; not part of equality.
    _grammar: xgr.Grammar | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if not given:
            raise ValueError(f"structured outputs need one of: {', '.join(_KINDS)}")
        if len(given) > 1:
            raise ValueError(f"structured outputs take exactly one kind of constraint, got {', '.join(given)}")
        self._grammar = self._parse(given[0])

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        """A hashable key: equal constraints compile to the same grammar."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)

    @property
    def parsed_grammar(self) -> xgr.Grammar:
        assert self._grammar is not None
        return self._grammar

    def _parse(self, kind: str) -> xgr.Grammar:
        if kind == "json_object":
            if self.json_object is not True:
                raise ValueError(f"json_object must be true, got {self.json_object!r}")
            # OpenAI's JSON mode promises an object, not any JSON value.
            return xgrammar().Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            depth = _depth(schema)
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"the JSON schema is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed")
            # Compact output: a tiny model given free whitespace can loop on it forever.
            return _convert("JSON schema", xgrammar().Grammar.from_json_schema, json.dumps(schema), any_whitespace=False)
        if kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError("regex must be a non-empty string")
            return _convert("regex", xgrammar().Grammar.from_regex, self.regex)
        if kind == "choice":
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError("choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("every choice must be a non-empty string")
            # JSON string literals are valid EBNF literals (same escapes).
            ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
            return _convert("choice", xgrammar().Grammar.from_ebnf, ebnf)
        if kind == "structural_tag":
            if not isinstance(self.structural_tag, str) or not self.structural_tag.strip():
                raise ValueError("structural_tag must be a non-empty JSON string")
            return _convert("structural tag", xgrammar().Grammar.from_structural_tag, self.structural_tag)
        if not isinstance(self.grammar, str) or not self.grammar.strip():
            raise ValueError("grammar must be a non-empty EBNF string")
        return _convert("grammar", xgrammar().Grammar.from_ebnf, self.grammar)


def _depth(value: Any) -> int:
    """Nesting depth of a JSON document, iteratively (a hostile schema must not blow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest  # enough to reject
        stack.extend((child, level + 1) for child in children)
    return deepest


# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: "; the caller needs only the rest.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _convert(what: str, convert: Any, source: str, **kwargs: Any) -> xgr.Grammar:
    try:
        return convert(source, **kwargs)
    except (RuntimeError, ValueError, TypeError) as exc:
        message = _XGR_PREFIX.sub("", str(exc).strip()).splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"invalid {what}: {message}") from None

"""What kube-apiserver does with a custom resource's structural schema on every write:
default, prune, validate, and run the CEL rules (x-kubernetes-validations).

- Defaults fill absent fields top-down (a defaulted object is then defaulted inside).
- Pruning drops fields the schema doesn't declare, unless x-kubernetes-preserve-unknown-fields
  says to keep them (metadata is left to the server; apiVersion and kind are always kept).
- Validation covers type (with x-kubernetes-int-or-string and nullable), enum, minimum and
  maximum (with exclusiveMinimum/Maximum), minLength, maxLength, pattern, minItems, maxItems,
  required, and the CEL rules. CEL needs cel-python (`pip install tidal-operator[dev]`, and a
  test dependency); without it the rules are skipped and the server logs that once.

Errors read like kube-apiserver's: `spec.replicas: Invalid value: -1: should be greater than
or equal to 0`.
"""

from __future__ import annotations

import copy
import functools
import logging
import re
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
Obj = dict[str, Any]
_TOP_KEEP = ("apiVersion", "kind", "metadata")


@dataclass(frozen=True)
class FieldError:
    path: str
    value: Any
    message: str

    def __str__(self) -> str:
        shown = self.value if isinstance(self.value, (int, float, bool)) or self.value is None else repr(self.value)
        return f"{self.path}: Invalid value: {shown}: {self.message}"


def _type_ok(schema: Obj, value: Any) -> bool:
    if value is None:
        return bool(schema.get("nullable"))
    if schema.get("x-kubernetes-int-or-string"):
        return (isinstance(value, int) and not isinstance(value, bool)) or isinstance(value, str)
    kind = schema.get("type")
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    return True  # no type: only x-kubernetes-preserve-unknown-fields nodes


def default_and_prune(schema: Obj, value: Any, *, top: bool = False) -> Any:
    """`value` with the schema's defaults filled in and undeclared fields removed."""
    if isinstance(value, dict) and schema.get("type") == "object":
        props: Obj = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") is True
        out: Obj = {}
        for key, item in value.items():
            if top and key in _TOP_KEEP:
                out[key] = item
            elif key in props:
                out[key] = default_and_prune(props[key], item)
            elif isinstance(extra, dict):
                out[key] = default_and_prune(extra, item)
            elif keep_unknown or extra is True:
                out[key] = item
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = default_and_prune(sub, copy.deepcopy(sub["default"]))
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [default_and_prune(schema["items"], item) for item in value]
    return value


def _check(schema: Obj, value: Any, path: str, errors: list[FieldError], cel: Any) -> None:
    if not _type_ok(schema, value):
        wanted = "integer or string" if schema.get("x-kubernetes-int-or-string") else schema.get("type")
        errors.append(FieldError(path, value, f"must be of type {wanted}"))
        return
    if value is None:
        return
    if "enum" in schema and value not in schema["enum"]:
        listed = ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in schema["enum"])
        errors.append(FieldError(path, value, f"supported values: {listed}"))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and (value <= low if schema.get("exclusiveMinimum") else value < low):
            errors.append(FieldError(path, value, f"should be greater than {'' if schema.get('exclusiveMinimum') else 'or equal to '}{low}"))
        if high is not None and (value >= high if schema.get("exclusiveMaximum") else value > high):
            errors.append(FieldError(path, value, f"should be less than {'' if schema.get('exclusiveMaximum') else 'or equal to '}{high}"))
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(FieldError(path, value, f"should be at least {schema['minLength']} chars long"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(FieldError(path, value, f"may not be more than {schema['maxLength']} chars long"))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(FieldError(path, value, f"should match '{schema['pattern']}'"))
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(FieldError(path, len(value), f"should have at least {schema['minItems']} items"))
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(FieldError(path, len(value), f"must have at most {schema['maxItems']} items"))
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                _check(schema["items"], item, f"{path}[{i}]", errors, cel)
    if isinstance(value, dict):
        for key in schema.get("required") or []:
            if key not in value:
                errors.append(FieldError(f"{path}.{key}" if path else key, None, "Required value"))
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key) if key in props else (extra if isinstance(extra, dict) else None)
            if sub is not None and not (path == "" and key == "metadata"):
                _check(sub, item, f"{path}.{key}" if path else key, errors, cel)
    for rule in schema.get("x-kubernetes-validations") or []:
        if cel is not None and not cel(rule["rule"], schema, value):
            where = path + (rule.get("fieldPath") or "")
            errors.append(FieldError(where or "<root>", value if not isinstance(value, (dict, list)) else "object",
                                     rule.get("message") or f"failed rule: {rule['rule']}"))


@functools.lru_cache(maxsize=1)
def _cel_evaluator() -> Any:
    """A function (rule, schema, value) -> bool over cel-python (compiled rules cached), or
    None without it."""
    try:
        import celpy  # cel-python: an optional dependency (tidal-operator[dev])
    except ImportError:
        log.warning("cel-python is not installed: CRD x-kubernetes-validations rules are not checked")
        return None
    env = celpy.Environment()
    programs: dict[str, Any] = {}

    def as_cel(schema: Obj, value: Any) -> Any:
        # Kubernetes hands `type: number` fields to CEL as doubles.
        if schema.get("type") == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, dict):
            props = schema.get("properties") or {}
            return {k: as_cel(props.get(k, {}), v) for k, v in value.items()}
        if isinstance(value, list) and isinstance(schema.get("items"), dict):
            return [as_cel(schema["items"], v) for v in value]
        return value

    def evaluate(rule: str, schema: Obj, value: Any) -> bool:
        if rule not in programs:
            programs[rule] = env.program(env.compile(rule))
        try:
            result = programs[rule].evaluate({"self": celpy.json_to_cel(as_cel(schema, value))})
        except Exception:  # noqa: BLE001 - a rule that can't evaluate on this value fails it
            return False
        return bool(result) and not isinstance(result, Exception)

    return evaluate


def admit(schema: Obj, obj: Obj) -> tuple[Obj, list[FieldError]]:
    """The object as it would be stored (defaulted, pruned) and what is wrong with it."""
    stored = default_and_prune(schema, obj, top=True)
    errors: list[FieldError] = []
    _check(schema, stored, "", errors, _cel_evaluator())
    return stored, errors

"""Strict schemas: a JSON schema closed to what it declares, for tool arguments and ``json_schema`` outputs.

JSON Schema allows any property an object schema does not name, and any item after an array's
``prefixItems``, unless the schema says otherwise. A grammar compiled from it lets a small model add keys of
its own: SmolLM2 asked for the weather wrote ``{"city": "Paris", "unit": "celsius", "required": ["city"]}``
(valid, useless to the caller). vLLM's default grammar backend compiles schemas in a strict mode that allows
only what is declared unless the schema opts in; so do we, unless ``--disable-strict-schemas``:

- an object schema that declares ``properties`` or ``patternProperties`` and says nothing of
  ``additionalProperties`` or ``unevaluatedProperties`` gets ``"additionalProperties": false``. An object
  schema that declares no properties at all (``{"type": "object"}``, ``json_object`` mode) stays open: it
  names nothing to close it to.
- an array schema with ``prefixItems`` and no ``items``/``unevaluatedItems`` gets ``"items": false``; one
  with the older array form of ``items`` and no ``additionalItems`` gets ``"additionalItems": false``.
- the direct members of an ``allOf`` stay as written: each names only part of the properties, and closing
  each would make their intersection refuse every object (their own subschemas are still closed). For the
  same reason a schema combined with others at its own level (``allOf``, ``anyOf``, ``oneOf``, ``$ref``,
  ``if``, ``dependentSchemas`` beside its ``properties``) stays open: the others may name more properties.

A schema that sets any of these keywords keeps its choice. Outputs stay valid under the schema as written
(a strict schema allows a subset of what it allows).
"""

from __future__ import annotations

# keywords whose values are data, not schemas: never walked
_DATA = ("const", "enum", "default", "examples", "required", "x-guidance")
# keywords whose values map names (not keywords) to schemas
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_OBJECT = ("additionalProperties", "unevaluatedProperties")
_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas")


def _close(schema: dict) -> dict:
    """``schema``'s own keywords made strict (its subschemas are not touched here)."""
    out = dict(schema)
    if (("properties" in out or "patternProperties" in out)
            and not any(k in out for k in _OPEN_OBJECT + _COMBINED)):
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
    if isinstance(out.get("items"), list) and "additionalItems" not in out:
        out["additionalItems"] = False
    return out


def strict_schema(schema, *, close: bool = True):
    """``schema`` with every object and tuple schema in it closed as the module says; a new value, the
    argument is not changed. ``close`` False leaves this schema's own keywords (a member of ``allOf``)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA:
            pass
        elif key in _MAPS and isinstance(value, dict):
            value = {name: strict_schema(v) for name, v in value.items()}
        elif key == "allOf" and isinstance(value, list):
            value = [strict_schema(v, close=False) for v in value]
        else:
            value = strict_schema(value)
        out[key] = value
    return _close(out) if close else out

"""JSON schemas and regexes of many shapes, with a prompt for each: what the structured-output tests (and
benchmarks/structured_output.py) ask SmolLM2 for. Strings and numbers carry the bounds a real API schema
would (a 135M model left free in a string may ramble until it runs out of tokens)."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 30}
SHORT = {"type": "string", "maxLength": 40}

SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "Describe a person as JSON with their name and age.",
     {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
      "required": ["name", "age"]}),
    ("enum", "Pick a colour for a car.",
     {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("nested", "Give the address of a museum.",
     {"type": "object", "properties": {"museum": NAME, "address": {
         "type": "object", "properties": {"street": SHORT, "city": NAME,
                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
         "required": ["street", "city", "zip"], "additionalProperties": False}},
      "required": ["museum", "address"], "additionalProperties": False}),
    ("string-array", "List up to three fruits.",
     {"type": "object", "properties": {"fruits": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
      "required": ["fruits"]}),
    ("object-array", "List two tasks with an id and a tag.",
     {"type": "object", "properties": {"tasks": {"type": "array", "maxItems": 3, "items": {
         "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "tag": NAME},
         "required": ["id", "tag"], "additionalProperties": False}}}, "required": ["tasks"],
      "additionalProperties": False}),
    ("bounded-numbers", "Price a sandwich.",
     {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100},
                                       "quantity": {"type": "integer", "minimum": 1, "maximum": 10}},
      "required": ["price", "quantity"], "additionalProperties": False}),
    ("optional-fields", "Describe a book.",
     {"type": "object", "properties": {"title": NAME, "subtitle": SHORT,
                                       "pages": {"type": "integer", "minimum": 1, "maximum": 2000}},
      "required": ["title"], "additionalProperties": False}),
    ("booleans", "Is the sky blue and is grass red?",
     {"type": "object", "properties": {"sky_is_blue": {"type": "boolean"}, "grass_is_red": {"type": "boolean"}},
      "required": ["sky_is_blue", "grass_is_red"], "additionalProperties": False}),
    ("ref", "Describe a customer and where they live.",
     {"$defs": {"place": {"type": "object", "properties": {"city": NAME, "country": NAME},
                          "required": ["city", "country"], "additionalProperties": False}},
      "type": "object", "properties": {"customer": NAME, "home": {"$ref": "#/$defs/place"}},
      "required": ["customer", "home"], "additionalProperties": False}),
    ("any-of", "Give an identifier, as a number or a word.",
     {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999},
                                                        NAME]}},
      "required": ["id"], "additionalProperties": False}),
    ("top-level-array", "List some small prime numbers.",
     {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 1, "maxItems": 5}),
    ("top-level-enum", "Is water wet? Answer yes or no.", {"enum": ["yes", "no"]}),
    ("pattern", "When was the moon landing? Give the date.",
     {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
      "required": ["date"], "additionalProperties": False}),
    ("const", "Describe a concert as an event.",
     {"type": "object", "properties": {"kind": {"const": "event"}, "name": NAME}, "required": ["kind", "name"],
      "additionalProperties": False}),
    ("nested-arrays", "Write a 2x2 matrix of small integers.",
     {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
         "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}},
      "required": ["matrix"], "additionalProperties": False}),
    ("nullable", "Describe a user who may have a nickname.",
     {"type": "object", "properties": {"user": NAME, "nickname": {"type": ["string", "null"], "maxLength": 20}},
      "required": ["user", "nickname"], "additionalProperties": False}),
    ("one-of", "Describe a pet.",
     {"type": "object", "properties": {"pet": {"oneOf": [
         {"type": "object", "properties": {"species": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}},
          "required": ["species", "lives"], "additionalProperties": False},
         {"type": "object", "properties": {"species": {"const": "dog"}, "breed": NAME},
          "required": ["species", "breed"], "additionalProperties": False}]}},
      "required": ["pet"], "additionalProperties": False}),
    ("string-lengths", "Give a short code word.",
     {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 8}},
      "required": ["code"], "additionalProperties": False}),
    ("exclusive-bounds", "Rate a film from 0 to 10.",
     {"type": "object", "properties": {"film": NAME, "rating": {"type": "number", "exclusiveMinimum": 0,
                                                                "exclusiveMaximum": 10}},
      "required": ["film", "rating"], "additionalProperties": False}),
    ("deep", "Describe a company with its CEO and headquarters.",
     {"type": "object", "properties": {"company": {"type": "object", "properties": {
         "name": NAME, "ceo": {"type": "object", "properties": {"name": NAME, "age": {
             "type": "integer", "minimum": 18, "maximum": 99}}, "required": ["name", "age"],
                               "additionalProperties": False},
         "hq": {"type": "object", "properties": {"city": NAME}, "required": ["city"], "additionalProperties": False}},
         "required": ["name", "ceo", "hq"], "additionalProperties": False}},
      "required": ["company"], "additionalProperties": False}),
]

# (name, prompt, regex): each in the syntax Python's re and Rust's regex read alike
REGEXES: list[tuple[str, str, str]] = [
    ("phone", "Give a phone number.", r"[0-9]{3}-[0-9]{3}-[0-9]{4}"),
    ("yes-no", "Is the earth round?", r"(yes|no)"),
    ("full-name", "Name a famous scientist.", r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}"),
    ("iso-date", "When did the second world war end?", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    ("email", "Give an email address.", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org|net)"),
]

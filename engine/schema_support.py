"""Which JSON Schema keywords the grammar enforces, and a clear refusal of every other one.

xgrammar turns a JSON schema into a grammar, but some keywords it drops with at most a
warning on stderr (`not`, `if`/`then`/`else`, `multipleOf` on numbers, a lookahead in a
`pattern`, keywords beside `enum`, `$ref` or `anyOf`, ...), and others give a grammar that
writes values the schema forbids (`required` naming a property without a `properties`
entry, `maxLength` on a schema without `"type": "string"`, ...). A request with such a schema
would "succeed" with output that breaks it. `check_enforceable` walks a schema before it is
compiled and raises a ValueError naming the first keyword outside what the grammar
enforces, and where it is; whatever it lets through, the grammar enforces (see
tests/test_schema_support.py, which checks each case against the jsonschema library).

Unknown keywords are annotations in JSON Schema (they constrain nothing) and pass, as do the
annotation keywords below. The walk is iterative: schema depth is caller-controlled.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
# What xgrammar checks beside `"format"` (every other format it lets any string through).
FORMATS = frozenset(
    {"date", "date-time", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
     "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer"}
)  # fmt: skip
_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRING = ("minLength", "maxLength", "pattern", "format")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_ENFORCED = frozenset(
    {"type", "enum", "const", *_NUMERIC, *_STRING, "items", "prefixItems", "minItems",
     "maxItems", "properties", "required", "additionalProperties", "minProperties",
     "maxProperties", "anyOf", "oneOf", "allOf", "$ref"}
)  # fmt: skip
# Keywords that constrain a value but that the grammar does not enforce, and what to do.
_REFUSED = {
    "not": "the grammar cannot exclude values matching a schema",
    "if": "conditional schemas (if/then/else) are not enforced",
    "then": "conditional schemas (if/then/else) are not enforced",
    "else": "conditional schemas (if/then/else) are not enforced",
    "dependentRequired": "dependencies between properties are not enforced",
    "dependentSchemas": "dependencies between properties are not enforced",
    "dependencies": "dependencies between properties are not enforced",
    "patternProperties": "properties named by a pattern are not enforced; list them in properties",
    "propertyNames": "constraints on property names are not enforced; list the names in properties",
    "contains": "array contains is not enforced",
    "minContains": "array contains is not enforced",
    "maxContains": "array contains is not enforced",
    "uniqueItems": "unique array items are not enforced",
    "unevaluatedProperties": "only false (the default here) is enforced",
    "unevaluatedItems": "only false is enforced",
    "additionalItems": "use prefixItems for the first items and items for the rest",
    "$anchor": "only $ref to a '#/...' pointer is supported",
    "$dynamicRef": "only $ref to a '#/...' pointer is supported",
    "$dynamicAnchor": "only $ref to a '#/...' pointer is supported",
    "$recursiveRef": "only $ref to a '#/...' pointer is supported",
    "$recursiveAnchor": "only $ref to a '#/...' pointer is supported",
    "$vocabulary": "custom vocabularies are not supported",
    "contentEncoding": "string contents are not checked",
    "contentMediaType": "string contents are not checked",
    "contentSchema": "string contents are not checked",
}
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_INT64 = 2**63


def check_enforceable(schema: Any, what: str = "the JSON schema") -> None:
    """ValueError naming the first keyword of `schema` that the grammar would not enforce."""
    _Walk(schema, what).run()


class _Walk:
    def __init__(self, root: Any, what: str) -> None:
        self.root = root
        self.what = what

    def refuse(self, keyword: str, path: str, why: str) -> ValueError:
        return ValueError(
            f"{self.what} uses {keyword!r} at {path or '#'}, which cannot be enforced: {why}"
        )

    def run(self) -> None:
        if not isinstance(self.root, dict):
            raise ValueError(f"{self.what} must be a JSON object")
        stack: list[tuple[Any, str]] = [(self.root, "#")]
        followed: set[str] = set()  # $ref targets already walked
        while stack:
            schema, path = stack.pop()
            if isinstance(schema, bool):
                continue  # true: anything; false: the compiler refuses it
            if not isinstance(schema, dict):
                raise ValueError(
                    f"{self.what}: the schema at {path} must be an object or a boolean"
                )
            for child in self.check_node(schema, path):
                stack.append(child)
            ref = schema.get("$ref")
            if isinstance(ref, str) and ref not in followed:
                followed.add(ref)
                stack.append((self.resolve(ref, path), ref))

    # ------------------------------------------------------------------ one node
    def check_node(self, schema: dict, path: str) -> list[tuple[Any, str]]:
        """Refuse what this node's keywords cannot enforce; return its subschemas."""
        for keyword in schema:
            if keyword in _REFUSED:
                value = schema[keyword]
                if keyword == "uniqueItems" and value is False:
                    continue
                if keyword.startswith("unevaluated") and value is False:
                    continue
                raise self.refuse(keyword, path, _REFUSED[keyword])
            if keyword == "$id" and path != "#":
                raise self.refuse(keyword, path, "$id is supported only at the top of the schema")
        types = self.check_type(schema, path)
        self.check_siblings(schema, path, types)
        self.check_numbers(schema, path, types)
        self.check_strings(schema, path, types)
        self.check_counts(schema, path)
        children: list[tuple[Any, str]] = []
        children += self.check_arrays(schema, path)
        children += self.check_objects(schema, path)
        children += self.check_combinators(schema, path)
        return children

    def check_type(self, schema: dict, path: str) -> set[str] | None:
        if "type" not in schema:
            return None
        value = schema["type"]
        names = [value] if isinstance(value, str) else value
        if (
            not isinstance(names, list)
            or not names
            or len(set(map(str, names))) != len(names)
            or not all(isinstance(n, str) and n in TYPES for n in names)
        ):
            raise self.refuse(
                "type", path, f"type must be one of {list(TYPES)} or a non-empty list of them"
            )
        return set(names)

    def check_siblings(self, schema: dict, path: str, types: set[str] | None) -> None:
        """Beside enum, const, $ref or a combinator the grammar enforces only that keyword."""
        leaders = [k for k in ("enum", "const", "$ref", "anyOf", "oneOf", "allOf") if k in schema]
        if not leaders:
            return
        allowed = {leaders[0]}
        if leaders[0] in ("enum", "const"):
            allowed.add("type")
        others = [k for k in schema if k in _ENFORCED and k not in allowed]
        if others:
            raise self.refuse(
                others[0], path, f"beside {leaders[0]!r} the grammar enforces only "
                f"{leaders[0]!r}; move {others[0]!r} into it or drop it",
            )  # fmt: skip
        if leaders[0] == "enum":
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise self.refuse("enum", path, "enum must be a non-empty array")
        else:
            values = [schema["const"]] if leaders[0] == "const" else []
        for value in values if types is not None else ():
            assert types is not None  # the loop runs only when the schema names types
            if not types & _json_types(value):
                raise self.refuse(
                    leaders[0], path, f"the value {json.dumps(value)[:60]} is not of type "
                    f"{sorted(types)}",
                )  # fmt: skip

    def check_numbers(self, schema: dict, path: str, types: set[str] | None) -> None:
        for keyword in _NUMERIC:
            if keyword not in schema:
                continue
            value = schema[keyword]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise self.refuse(keyword, path, f"{keyword} must be a number")
            if types is None or not types & {"integer", "number"}:
                raise self.refuse(
                    keyword, path, 'it needs "type": "integer" or "number" beside it '
                    "(without it the grammar does not apply it)",
                )  # fmt: skip
            if types & {"integer"} and not types & {"number"} and abs(value) >= _INT64:
                raise self.refuse(keyword, path, "integer bounds must fit in 64 bits")
        if "multipleOf" in schema:
            value = schema["multipleOf"]
            if "number" in (types or ()):
                raise self.refuse(
                    "multipleOf", path, 'it is enforced only on "type": "integer", not on '
                    "numbers with a fraction",
                )  # fmt: skip
            if not (float(value).is_integer() and value > 0):
                raise self.refuse("multipleOf", path, "only a positive whole number is enforced")

    def check_strings(self, schema: dict, path: str, types: set[str] | None) -> None:
        for keyword in _STRING:
            if keyword in schema and "string" not in (types or ()):
                raise self.refuse(
                    keyword, path, 'it needs "type": "string" beside it (without it the '
                    "grammar does not apply it)",
                )  # fmt: skip
        pattern = schema.get("pattern")
        if "pattern" in schema and not isinstance(pattern, str):
            raise self.refuse("pattern", path, "pattern must be a string")
        if isinstance(pattern, str) and has_lookaround(pattern):
            raise self.refuse(
                "pattern", path, "lookahead and lookbehind ((?=, (?!, (?<=, (?<!) are not "
                "enforced; rewrite the pattern without them",
            )  # fmt: skip
        if "format" in schema and schema["format"] not in FORMATS:
            raise self.refuse(
                "format", path, f"the format {schema['format']!r} is not checked; the checked "
                f"formats are {sorted(FORMATS)}",
            )  # fmt: skip

    def check_counts(self, schema: dict, path: str) -> None:
        for keyword in _COUNTS:
            if keyword in schema:
                value = schema[keyword]
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise self.refuse(keyword, path, f"{keyword} must be a non-negative integer")
        for low, high in (("minLength", "maxLength"), ("minItems", "maxItems"),
                          ("minProperties", "maxProperties")):  # fmt: skip
            if low in schema and high in schema and schema[low] > schema[high]:
                raise self.refuse(low, path, f"{low} {schema[low]} exceeds {high} {schema[high]}")

    def check_arrays(self, schema: dict, path: str) -> list[tuple[Any, str]]:
        children = []
        if "items" in schema:
            if not isinstance(schema["items"], dict | bool):
                raise self.refuse(
                    "items", path, "items must be a schema (for a tuple use prefixItems)"
                )
            children.append((schema["items"], f"{path}/items"))
        if "prefixItems" in schema:
            items = schema["prefixItems"]
            if not isinstance(items, list) or not items:
                raise self.refuse("prefixItems", path, "prefixItems must be a non-empty array")
            children += [(item, f"{path}/prefixItems/{i}") for i, item in enumerate(items)]
        return children

    def check_objects(self, schema: dict, path: str) -> list[tuple[Any, str]]:
        properties = schema.get("properties", {})
        if not isinstance(properties, dict):
            raise self.refuse("properties", path, "properties must be an object of schemas")
        required = schema.get("required", [])
        if (
            not isinstance(required, list)
            or not all(isinstance(name, str) for name in required)
            or len(set(required)) != len(required)
        ):
            raise self.refuse("required", path, "required must be an array of distinct names")
        missing = [name for name in required if name not in properties]
        if missing:
            raise self.refuse(
                "required", path, f"it names {missing[0]!r}, which has no entry in properties "
                "(the grammar would never write it); add it to properties",
            )  # fmt: skip
        extra = schema.get("additionalProperties", False)
        if not isinstance(extra, dict | bool):
            raise self.refuse(
                "additionalProperties", path, "additionalProperties must be a schema or a boolean"
            )
        children = [(sub, f"{path}/properties/{_escape(name)}") for name, sub in properties.items()]
        if isinstance(extra, dict):
            children.append((extra, f"{path}/additionalProperties"))
        return children

    def check_combinators(self, schema: dict, path: str) -> list[tuple[Any, str]]:
        children = []
        for keyword in ("anyOf", "oneOf", "allOf"):
            if keyword not in schema:
                continue
            branches = schema[keyword]
            if not isinstance(branches, list) or not branches:
                raise self.refuse(keyword, path, f"{keyword} must be a non-empty array of schemas")
            if keyword == "allOf" and len(branches) > 1:
                raise self.refuse(
                    "allOf", path, "only an allOf of one schema is enforced; merge its schemas "
                    "into one",
                )  # fmt: skip
            if keyword == "oneOf":
                self.check_disjoint(branches, path)
            children += [(b, f"{path}/{keyword}/{i}") for i, b in enumerate(branches)]
        return children

    # -------------------------------------------------------------------- oneOf
    def check_disjoint(self, branches: list, path: str) -> None:
        """The grammar treats oneOf as anyOf: exact only when no value matches two branches."""
        resolved = [self.deref(branch, path) for branch in branches]
        for i, first in enumerate(resolved):
            for j in range(i + 1, len(resolved)):
                if not self.disjoint(first, resolved[j], path, depth=2):
                    raise self.refuse(
                        "oneOf", path, f"branches {i} and {j} may match the same value, and the "
                        "grammar cannot make sure only one matches; use anyOf, or tell the "
                        "branches apart by type, const or enum",
                    )  # fmt: skip

    def disjoint(self, a: Any, b: Any, path: str, depth: int) -> bool:
        if not isinstance(a, dict) or not isinstance(b, dict):
            return False
        types_a, types_b = _possible_types(a), _possible_types(b)
        if types_a is not None and types_b is not None and not types_a & types_b:
            return True
        values_a, values_b = _values(a), _values(b)
        if values_a is not None and values_b is not None and not values_a & values_b:
            return True
        if depth == 0 or types_a != {"object"} or types_b != {"object"}:
            return False
        props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
        shared = set(a.get("required") or ()) & set(b.get("required") or ())
        return any(
            name in props_a
            and name in props_b
            and self.disjoint(
                self.deref(props_a[name], path), self.deref(props_b[name], path), path, depth - 1
            )
            for name in shared
        )

    # ---------------------------------------------------------------------- $ref
    def deref(self, schema: Any, path: str) -> Any:
        for _ in range(32):  # a chain of $refs; a loop of them is the compiler's to refuse
            if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
                return schema
            schema = self.resolve(schema["$ref"], path)
        return schema

    def resolve(self, ref: str, path: str) -> Any:
        if not ref.startswith("#"):
            raise self.refuse("$ref", path, f"only local references ('#/...') work, not {ref!r}")
        node: Any = self.root
        for part in (p for p in ref[1:].split("/") if p) if ref != "#" else ():
            key = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                raise self.refuse("$ref", path, f"{ref!r} does not point into the schema")
        return node


def _json_types(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def _possible_types(schema: dict) -> set[str] | None:
    """The JSON types a value of `schema` can have, or None when any."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list):
        found: set[str] = set()
        for value in values:
            found |= _json_types(value)
        return found
    names = schema.get("type")
    if names is None:
        return None
    names = {names} if isinstance(names, str) else set(names)
    if "number" in names:
        names.add("integer")  # every integer is a number
    return names


def _values(schema: dict) -> set[str] | None:
    """The values `schema` allows (canonical JSON), when it lists them."""
    if "const" in schema:
        return {json.dumps(schema["const"], sort_keys=True)}
    if isinstance(schema.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in schema["enum"]}
    return None


def has_lookaround(pattern: str) -> bool:
    """True when the regex has (?=, (?!, (?<= or (?<! outside escapes and character classes."""
    plain, i, in_class = [], 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            plain.append("  ")
            i += 2
            continue
        if in_class:
            in_class = char != "]"
            plain.append(" ")
        else:
            in_class = char == "["
            plain.append(" " if in_class else char)
        i += 1
    return _LOOKAROUND.search("".join(plain)) is not None


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")

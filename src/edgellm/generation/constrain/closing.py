"""The shortest way to finish a JSON output that its budget is about to cut: from the text so far (a
valid prefix, the grammar saw to that) and the schema, the characters that close it validly. An open
string is closed where it stands (an unfinished escape completed first), a number or literal
finished, each open object given the required properties it lacks (by their shortest valid values)
and closed, each array given the items its minItems asks and closed. The generation checks the
result against the grammar before it forces it (generator.py), so a schema this cannot follow (a
pattern, a format) only means no early closing, never an invalid output."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_DEPTH = 32  # of $refs and nesting followed when making a shortest value


class CannotClose(ValueError):
    """No closing this module can make (the grammar decides; the output may then be cut)."""


@dataclass
class _Frame:
    kind: str  # "object" or "array"
    schema: dict
    keys: list[str] = field(default_factory=list)  # an object's keys so far
    items: int = 0  # an array's values so far
    state: str = "start"  # object: start, key, colon, value, after; array: start, value, after


class JsonCloser:
    def __init__(self, schema: dict | None):
        self.root = schema if isinstance(schema, dict) else {}

    # -- shortest values ------------------------------------------------------------------

    def _resolve(self, schema: Any, depth: int = 0) -> dict:
        if not isinstance(schema, dict):
            return {}
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/") and depth < MAX_DEPTH:
            target: Any = self.root
            for part in ref[2:].split("/"):
                target = target.get(part, {}) if isinstance(target, dict) else {}
            return self._resolve(target, depth + 1)
        for combined in ("anyOf", "oneOf"):
            options = schema.get(combined)
            if isinstance(options, list) and options:
                return min((self._resolve(o, depth + 1) for o in options),
                           key=lambda o: len(self.shortest(o, depth + 1)) if depth < MAX_DEPTH else 0)
        if isinstance(schema.get("allOf"), list) and schema["allOf"]:
            merged: dict = {}
            for part in schema["allOf"]:
                merged |= self._resolve(part, depth + 1)
            return merged | {k: v for k, v in schema.items() if k != "allOf"}
        return schema

    def shortest(self, schema: Any, depth: int = 0) -> str:
        """The shortest JSON text valid for `schema` this knows how to make."""
        if depth > MAX_DEPTH:
            raise CannotClose("nested too deep")
        s = self._resolve(schema, depth)
        if "const" in s:
            return json.dumps(s["const"], ensure_ascii=False)
        if isinstance(s.get("enum"), list) and s["enum"]:
            return min((json.dumps(v, ensure_ascii=False) for v in s["enum"]), key=len)
        kind = s.get("type")
        if isinstance(kind, list):
            kind = "null" if "null" in kind else (kind[0] if kind else None)
        if kind == "string":
            if "pattern" in s or "format" in s:
                raise CannotClose("a string with a pattern or format")
            return json.dumps("a" * int(s.get("minLength", 0)))
        if kind in ("integer", "number"):
            return self._number(s)
        if kind == "boolean":
            return "false"
        if kind == "null":
            return "null"
        if kind == "array":
            item = self.shortest(s.get("items", {}), depth + 1) if s.get("minItems", 0) else ""
            return "[" + ",".join([item] * int(s.get("minItems", 0))) + "]"
        if kind == "object" or "properties" in s or kind is None and "required" in s:
            props = s.get("properties", {})
            fields = [f"{json.dumps(k)}:{self.shortest(props.get(k, {}), depth + 1)}" for k in s.get("required", [])]
            return "{" + ",".join(fields) + "}"
        return "null"  # any value

    @staticmethod
    def _number(s: dict) -> str:
        low = s.get("minimum", s.get("exclusiveMinimum"))
        high = s.get("maximum", s.get("exclusiveMaximum"))
        value = 0
        if isinstance(low, (int, float)) and value < low or "exclusiveMinimum" in s and value <= low:
            value = int(low) + 1 if "exclusiveMinimum" in s or int(low) < low else int(low)
        if isinstance(high, (int, float)) and value > high:
            raise CannotClose("no integer in the range")
        return str(value)

    # -- the text so far ------------------------------------------------------------------------

    def closing(self, text: str) -> str:
        """What to append to `text` (a valid prefix of an output of the schema) to end it."""
        stack: list[_Frame] = []
        i, n, tail = 0, len(text), ""
        current = None  # the scalar being written: ("string", start, is_key) or ("number"/"literal", start)
        while i < n:
            c = text[i]
            if current is not None and current[0] == "string":
                if c == "\\":
                    i += 2
                    continue
                if c == '"':
                    self._string_done(stack, text[current[1]:i + 1], current[2])
                    current = None
                i += 1
                continue
            if current is not None:  # a number or literal ends at the first character not its own
                if c in "0123456789+-.eEtruefalsn":
                    i += 1
                    continue
                self._value_done(stack)
                current = None
                continue
            if c in " \t\r\n":
                pass
            elif c == '"':
                current = ("string", i, bool(stack) and stack[-1].kind == "object" and stack[-1].state in ("start", "key"))
            elif c in "{[":
                schema = self._child_schema(stack)
                stack.append(_Frame("object" if c == "{" else "array", self._resolve(schema)))
            elif c in "}]":
                stack.pop()
                self._value_done(stack)
            elif c == ":":
                stack[-1].state = "value"
            elif c == ",":
                stack[-1].state = "key" if stack[-1].kind == "object" else "value"
            else:  # a number or a literal starts
                current = ("scalar", i)
            i += 1
        if current is not None and current[0] == "string":
            tail += self._finish_string(text[current[1]:], current[2], stack)
        elif current is not None:
            tail += self._finish_scalar(text[current[1]:])
            self._value_done(stack)
        if not stack and not text.strip():
            return self.shortest(self.root)
        while stack:
            tail += self._close_frame(stack)
        return tail

    def _child_schema(self, stack: list[_Frame]) -> dict:
        if not stack:
            return self.root
        top = stack[-1]
        if top.kind == "array":
            return top.schema.get("items", {})
        key = top.keys[-1] if top.keys else None
        return top.schema.get("properties", {}).get(key, top.schema.get("additionalProperties", {})) \
            if isinstance(top.schema.get("properties", {}), dict) else {}

    def _string_done(self, stack: list[_Frame], literal: str, is_key: bool) -> None:
        if is_key:
            stack[-1].keys.append(json.loads(literal))
            stack[-1].state = "colon"
        else:
            self._value_done(stack)

    @staticmethod
    def _value_done(stack: list[_Frame]) -> None:
        if stack:
            stack[-1].state = "after"
            stack[-1].items += stack[-1].kind == "array"

    def _finish_string(self, partial: str, is_key: bool, stack: list[_Frame]) -> str:
        """Close a string begun at `partial` (its opening quote included)."""
        end = ""
        escape = _open_escape(partial)
        if escape is not None:
            end = "\\" if escape == "" else "0" * (4 - len(escape))  # \\ or \uXXXX padded
        end += '"'
        if not is_key:
            schema = self._resolve(self._child_schema(stack))
            if "enum" in schema or "const" in schema or "pattern" in schema or "format" in schema:
                raise CannotClose("an open string of an enum, const, pattern or format")
            if len(json.loads(partial + end)) < schema.get("minLength", 0):
                raise CannotClose("an open string shorter than its minLength")
            self._value_done(stack)
            return end
        top = stack[-1]
        begun = json.loads(partial + end)
        names = [k for k in top.schema.get("required", []) if k not in top.keys] + list(top.schema.get("properties", {}))
        name = next((k for k in names if k.startswith(begun) and k not in top.keys), None)
        if name is None and top.schema.get("additionalProperties", True) is False:
            raise CannotClose(f"no property begins with {begun!r}")
        name = begun if name is None else name
        top.keys.append(name)
        top.state = "colon"
        return json.dumps(name)[1 + len(json.dumps(begun)) - 2:] if escape is None else end

    @staticmethod
    def _finish_scalar(partial: str) -> str:
        for literal in ("true", "false", "null"):
            if literal.startswith(partial):
                return literal[len(partial):]
        return "0" if partial[-1] in "-+.eE" else ""

    def _close_frame(self, stack: list[_Frame]) -> str:
        top = stack[-1]
        out = ""
        if top.kind == "array":
            if top.state == "value" and top.items:  # after a comma: one more item
                out += self.shortest(top.schema.get("items", {}))
                top.items += 1
            missing = max(0, int(top.schema.get("minItems", 0)) - top.items)
            item = self.shortest(top.schema.get("items", {})) if missing else ""
            out += "".join(("," if top.items + k else "") + item for k in range(missing)) + "]"
        else:
            props = top.schema.get("properties", {})
            if top.state == "colon":
                out += ":" + self.shortest(props.get(top.keys[-1], {}))
            elif top.state == "value":
                out += self.shortest(props.get(top.keys[-1], {}))
            missing = _in_schema_order(top.schema, [k for k in top.schema.get("required", []) if k not in top.keys])
            if top.state == "key" and not missing:
                raise CannotClose("an object after a comma with no property left to add")
            for k, key in enumerate(missing):
                comma = "" if top.state == "key" and k == 0 or not top.keys and k == 0 else ","
                out += f"{comma}{json.dumps(key)}:{self.shortest(props.get(key, {}))}"
            out += "}"
        stack.pop()
        self._value_done(stack)
        return out


def _in_schema_order(schema: dict, keys: list[str]) -> list[str]:
    """`keys` in the order the schema lists its properties (the grammar's order), others after."""
    order = {k: i for i, k in enumerate(schema.get("properties", {}))}
    return sorted(keys, key=lambda k: order.get(k, len(order)))


def _open_escape(partial: str) -> str | None:
    """An escape the string ends inside: "" after a lone backslash, the hex digits after \\u;
    None when it ends outside one."""
    i = 1
    while i < len(partial):
        if partial[i] == "\\":
            if i + 1 == len(partial):
                return ""
            if partial[i + 1] == "u":
                digits = partial[i + 2:i + 6]
                if len(digits) < 4 and i + 2 + len(digits) == len(partial):
                    return digits
                i += 6
                continue
            i += 2
            continue
        i += 1
    return None


def closer_for(constraint) -> JsonCloser | None:
    """The closer of a JSON constraint (a schema, any JSON object); None for the others."""
    if constraint.kind in ("json_schema", "json"):
        return JsonCloser(constraint.schema)
    return None

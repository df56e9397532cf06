"""Guided decoding (structured outputs) through the official openai client, colocated and P/D.

Every guided answer is checked with the `jsonschema` library (or the regex), so a server that
answered a guided request freely would fail here. Answers are greedy and short to keep CI time low.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import List, Literal, Optional

import jsonschema
import openai
import pydantic
import pytest

from conftest import MODEL_NAME, Server

MAX_TOKENS = 160


@pytest.fixture(scope="module", params=["colocated", "pd"])
def guided_client(request):
    if request.param == "pd":
        s = Server(["--config", "examples/pd.yaml"])
    else:
        s = Server(["--kv-cache-memory", "256MiB"])
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    s.stop()


def obj(props, required=None, **extra):
    """A closed object schema (OpenAI strict style: every property required unless told)."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SHORT = {"type": "string", "maxLength": 12}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
POINT = obj({"x": {"type": "integer", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": -10, "maximum": 10}})

SCHEMAS = {
    "person": obj({"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "enum": obj({"color": {"type": "string", "enum": ["red", "green", "blue"]}}),
    "bool_null": obj({"ok": {"type": "boolean"}, "note": {"type": "null"}}),
    "nested_object": obj({"person": obj({"first": SHORT, "last": SHORT})}),
    "int_array": obj({"nums": {"type": "array", "items": DIGIT, "minItems": 1, "maxItems": 4}}),
    "nested_arrays": obj(
        {"matrix": {"type": "array", "maxItems": 2, "items": {"type": "array", "items": DIGIT, "maxItems": 2}}}
    ),
    "any_of": obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, SHORT]}}),
    "pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    "number_bounds": obj({"score": {"type": "number", "minimum": 0, "maximum": 1}}),
    "exclusive_bounds": obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    "object_array": obj(
        {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": obj({"id": {"type": "integer", "minimum": 1, "maximum": 99}, "label": {"enum": ["a", "b"]}}),
            }
        }
    ),
    "top_level_array": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "minItems": 2, "maxItems": 3},
    "const": obj({"kind": {"const": "point"}, "x": DIGIT, "y": DIGIT}),
    "optional_property": obj({"a": DIGIT, "b": {"type": "string", "maxLength": 5}}, required=["a"]),
    "refs": {
        "$defs": {"point": POINT},
        **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
    },
    "mixed_enum": obj({"level": {"enum": [1, 2, 3, "max"]}}),
    "string_length": obj({"word": {"type": "string", "minLength": 3, "maxLength": 6}}),
    "nullable": obj({"maybe": {"type": ["string", "null"], "maxLength": 6}}),
    "any_of_objects": obj(
        {"shape": {"anyOf": [obj({"circle": DIGIT}), obj({"square": DIGIT})]}}
    ),
    "fixed_array": obj({"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}}),
    "deep": obj({"a": obj({"b": obj({"c": obj({"d": DIGIT})})})}),
    "email_pattern": obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
}


def ask(client, content, **kw):
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        **kw,
    )


def test_json_schemas_are_followed(guided_client):
    def one(item):
        name, schema = item
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        r = ask(guided_client, f"Reply in JSON: an example {name.replace('_', ' ')}.", response_format=fmt)
        return name, schema, r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, SCHEMAS.items()))
    assert len(results) >= 20
    for name, schema, choice in results:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    unit: Literal["celsius", "fahrenheit"]
    temperature: int = pydantic.Field(ge=-50, le=60)
    alerts: List[Literal["wind", "rain", "heat"]] = pydantic.Field(max_length=2)
    note: Optional[str] = pydantic.Field(max_length=10)


def test_parse_returns_a_pydantic_object(guided_client):
    r = guided_client.chat.completions.parse(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "The weather in Paris, as JSON."}],
        response_format=Weather,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Weather), r.choices[0].message.content
    assert -50 <= parsed.temperature <= 60


def test_json_object_and_regex(guided_client):
    # Any object is allowed, so the prompt keeps a small model's object short.
    prompt = 'Repeat exactly this JSON object: {"ok": true, "n": 3}'
    r = ask(guided_client, prompt, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    rx = r"(yes|no), [0-9]{1,3} (apples|pears)"
    r = ask(guided_client, "Do you like fruit?", response_format={"type": "regex", "regex": rx})
    assert re.fullmatch(rx, r.choices[0].message.content), r.choices[0].message.content


def test_constraints_that_do_not_compile_are_400s(guided_client):
    for fmt in [
        {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "frobnicate"}}},
        {"type": "regex", "regex": "(unclosed"},
    ]:
        with pytest.raises(openai.BadRequestError):
            ask(guided_client, "Hi", response_format=fmt)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": obj({"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}}),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": obj({"zone": {"type": "string", "maxLength": 16}}),
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def calls_of(client, tool_choice, stream):
    """The (name, arguments) calls and finish reason of one answer, streamed or not."""
    kw = dict(tools=TOOLS, tool_choice=tool_choice)
    if not stream:
        choice = ask(client, "What is the weather in Oslo?", **kw).choices[0]
        assert not choice.message.content
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls], choice.finish_reason
    calls, finish = {}, None
    for chunk in ask(client, "What is the weather in Oslo?", stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                name, args = calls.get(d.index, ("", ""))
                calls[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
            finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named(guided_client, stream):
    named = {"type": "function", "function": {"name": "get_time"}}
    for tool_choice, allowed in [("required", set(PARAMS)), (named, {"get_time"})]:
        calls, finish = calls_of(guided_client, tool_choice, stream)
        assert finish == "tool_calls", calls
        assert calls, tool_choice
        for name, args in calls:
            assert name in allowed, (tool_choice, name)
            jsonschema.validate(json.loads(args), PARAMS[name])

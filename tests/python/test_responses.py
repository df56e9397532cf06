"""The Responses API (`POST /v1/responses`) through the official `openai` client, colocated and P/D.

Both deployments serve with tests/python/fixtures/hermes_tools.jinja, a ChatML template with
Hermes-style tools (SmolLM2's own template has none), so function calls can be rendered, parsed and
fed back. Requests are greedy and short to keep the run fast.
"""

import json
import pathlib

import openai
import pytest
import requests

from conftest import MODEL_NAME, Server

TEMPLATE = pathlib.Path(__file__).parent / "fixtures" / "hermes_tools.jinja"

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}

DEPLOYMENTS = {
    "colocated": ["--kv-cache-memory", "256MiB"],
    "pd": ["--config", "examples/pd.yaml"],
}


@pytest.fixture(scope="module", params=sorted(DEPLOYMENTS))
def deployment(request):
    s = Server([*DEPLOYMENTS[request.param], "--chat-template", str(TEMPLATE)])
    yield s
    s.stop()


@pytest.fixture
def rclient(deployment):
    return openai.OpenAI(base_url=deployment.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def create(client, **kwargs):
    kwargs.setdefault("temperature", 0)
    return client.responses.create(model=MODEL_NAME, **kwargs)


def test_text_input(rclient):
    r = create(rclient, input="What is the capital of France?", max_output_tokens=24)
    assert r.id.startswith("resp_")
    assert r.object == "response"
    assert r.model == MODEL_NAME
    assert r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text.strip()
    assert r.usage.input_tokens > 0
    assert 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.store is False


def test_instructions_and_item_input(rclient):
    plain = create(rclient, input="Name a colour.", max_output_tokens=8)
    items = create(
        rclient,
        instructions="You are a terse assistant.",
        input=[
            {"role": "developer", "content": "Answer in one word."},
            {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
            {"role": "assistant", "content": "Blue."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Another one."}]},
        ],
        max_output_tokens=8,
    )
    assert items.instructions == "You are a terse assistant."
    assert items.output_text.strip()
    # The instructions and the earlier turns are part of the prompt.
    assert items.usage.input_tokens > plain.usage.input_tokens + 20


def test_max_output_tokens_makes_it_incomplete(rclient):
    r = create(rclient, input="Write a long story about a dragon.", max_output_tokens=5)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5
    assert r.output[0].status == "incomplete"
    assert r.output_text


def test_logprobs_when_included(rclient):
    r = create(
        rclient,
        input="Name a fruit.",
        max_output_tokens=6,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens
    assert "".join(lp.token for lp in part.logprobs).startswith(part.text)
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in part.logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(lp.top_logprobs[0].logprob == lp.logprob for lp in part.logprobs)


def stream_events(client, **kwargs):
    kwargs.setdefault("temperature", 0)
    with client.responses.stream(model=MODEL_NAME, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else None
    return events, final


def check_text_sequence(events):
    types = [e.type for e in events]
    n = types.count("response.output_text.delta")
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        types[-1],
    ], types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    return text


def test_stream_to_completion(rclient):
    events, final = stream_events(rclient, input="Say just the word yes.", max_output_tokens=48)
    assert events[-1].type == "response.completed", [e.type for e in events]
    text = check_text_sequence(events)
    assert text.strip()
    assert final.status == "completed"
    assert final.output_text == text
    assert final.usage.output_tokens > 0


def test_stream_cut_by_max_output_tokens(rclient):
    events, final = stream_events(rclient, input="Write a long story about a dragon.", max_output_tokens=6)
    assert events[-1].type == "response.incomplete"
    text = check_text_sequence(events)
    last = events[-1].response
    assert last.status == "incomplete"
    assert last.incomplete_details.reason == "max_output_tokens"
    assert last.output[0].content[0].text == text
    assert last.usage.output_tokens == 6
    assert final is None


# A few-shot conversation in which the assistant answered weather questions with a call: the small
# model copies the pattern for the next city (it does from three examples on), and the call comes back
# as a function_call item. The examples are themselves function_call / function_call_output items.
def few_shot(ask):
    items = []
    for i, (city, weather) in enumerate(
        [("Paris", "Sunny, 21C"), ("London", "Rainy, 14C"), ("Berlin", "Cloudy, 12C"), ("Madrid", "Hot, 30C")]
    ):
        items += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"type": "function_call", "call_id": f"call_{i}", "name": "get_weather", "arguments": json.dumps({"city": city})},
            {"type": "function_call_output", "call_id": f"call_{i}", "output": weather},
            {"role": "assistant", "content": f"It is {weather} in {city}."},
        ]
    return items + [{"role": "user", "content": f"What is the weather in {ask}?"}]


FEW_SHOT = few_shot("Rome")


def test_function_call_round_trip(rclient):
    first = create(rclient, input=FEW_SHOT, tools=[WEATHER], max_output_tokens=40)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls, first.output
    call = calls[0]
    assert call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Rome"}
    assert first.tools[0].name == "get_weather"

    follow = FEW_SHOT + [
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Cloudy, 18C"},
    ]
    second = create(rclient, input=follow, tools=[WEATHER], max_output_tokens=24)
    assert second.output[0].type == "message"
    assert second.output_text.strip()


def test_function_call_streams_argument_events(rclient):
    events, final = stream_events(rclient, input=FEW_SHOT, tools=[WEATHER], max_output_tokens=40)
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types, types
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args
    assert final is not None and final.output[0].arguments == args
    assert final.output[0].call_id == added.item.call_id


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"extra_body": {"conversation": "conv_1"}}, "conversation"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
            "input[0].content[0].type",
        ),
    ],
)
def test_unsupported_fields_are_400(rclient, kwargs, param):
    kwargs.setdefault("input", "hi")
    with pytest.raises(openai.BadRequestError) as e:
        create(rclient, max_output_tokens=4, **kwargs)
    assert e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error"


def test_responses_are_not_stored(rclient, deployment):
    with pytest.raises(openai.NotFoundError):
        rclient.responses.retrieve("resp_123")
    r = requests.post(
        deployment.url + "/v1/responses",
        json={"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["store"] is False

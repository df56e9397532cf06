"""Reasoning models through the official openai client: `chat_template_kwargs`, `reasoning_content`
(whole and streamed), the Responses `reasoning` item and its events, colocated and P/D.

The model is tests/fixtures/hf/tiny-qwen3 (random weights, the real Qwen3 chat template), so nothing
here checks what the text says: a regex guide forces an output with a `<think>` block where the split
must be exact, and otherwise greedy answers are compared across endpoints and stream modes.
"""

import contextlib
import json
import os
import pathlib
import tempfile

import openai
import pytest
import requests

from conftest import MODEL_NAME, ROOT, Server

QWEN3 = "tests/fixtures/hf/tiny-qwen3"
# A block, then an answer, spelled out byte for byte by the guide.
FORCED = r"<think>\nI ponder\.\n</think>\n\nDone\."
MAX_TOKENS = 48
# The Qwen3 template's tool instructions, as its source spells them.
PREAMBLE = (
    r'"# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'
    r'You are provided with function signatures within <tools></tools> XML tags:\n<tools>"'
)
POSTAMBLE = (
    r'"\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
    r'<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": '
    r'<args-json-object>}\n</tool_call><|im_end|>\n"'
)


@contextlib.contextmanager
def model_from_args():
    """These servers name their model themselves: a $TANDEM_MODEL set for the other tests steps aside."""
    saved = os.environ.pop("TANDEM_MODEL", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TANDEM_MODEL"] = saved


def pd_config() -> str:
    """examples/pd.yaml's shape with the tiny Qwen3: one prefill and one decode worker."""
    doc = f"""model: {QWEN3}
engine: {{kv_cache_memory: 64MiB}}
deployment:
  mode: pd
  prefill: {{replicas: 1, engine: {{threads: 1}}}}
  decode: {{replicas: 1, engine: {{threads: 1}}}}
"""
    f = tempfile.NamedTemporaryFile("w", prefix="tandem-reasoning-", suffix=".yaml", delete=False)
    f.write(doc)
    f.close()
    return f.name


@pytest.fixture(scope="module", params=["colocated", "pd"])
def qwen3(request):
    """A server of the tiny Qwen3 with `--reasoning-parser auto` (its template mentions <think>)."""
    with model_from_args():
        if request.param == "pd":
            s = Server(["--config", pd_config()])
        else:
            s = Server([QWEN3, "--kv-cache-memory", "64MiB"])
    yield s
    s.stop()


def client_of(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], **kw)


def forced(**kw):
    return {"response_format": {"type": "regex", "regex": FORCED}, **kw}


def test_reasoning_content_is_split_off_the_answer(qwen3):
    r = chat(client_of(qwen3), **forced())
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert message.content == "Done."
    assert message.reasoning_content == "I ponder."
    details = r.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.completion_tokens


def test_streamed_deltas_carry_reasoning_then_content(qwen3):
    stream = chat(client_of(qwen3), stream=True, stream_options={"include_usage": True}, **forced())
    reasoning, content, order, usage = "", "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = getattr(choice.delta, "reasoning_content", None)
            if piece:
                reasoning += piece
                order.append("r")
            if choice.delta.content:
                assert "<think>" not in choice.delta.content and "</think>" not in choice.delta.content
                content += choice.delta.content
                order.append("c")
    assert (reasoning, content) == ("I ponder.", "Done.")
    assert order == sorted(order, key=lambda k: k != "r"), "all reasoning before any content"
    assert usage.completion_tokens_details.reasoning_tokens > 0


def test_chat_template_kwargs_reach_the_template(qwen3):
    client = client_of(qwen3)
    on = chat(client, max_tokens=1)
    off = chat(client, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # Qwen3's template closes an empty block in the prompt when thinking is off.
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    tokenized = requests.post(
        qwen3.url + "/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}},
        timeout=30,
    ).json()
    assert tokenized["count"] == off.usage.prompt_tokens
    # Generation starts after the closed block: even a forced block is then plain answer text.
    r = chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **forced())
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    assert r.choices[0].message.content == "<think>\nI ponder.\n</think>\n\nDone."
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=1, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert e.value.body["param"] == "chat_template_kwargs"


@pytest.fixture(scope="module")
def thinking():
    """The tiny Qwen3 behind its template changed to open <think> for the model (as Qwen3 thinking models'
    do) and with the tools preamble cut to fit the fixture's 256-token context."""
    source = json.loads((ROOT / QWEN3 / "tokenizer_config.json").read_text())["chat_template"]
    edits = [
        ("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}"),
        (PREAMBLE, '"<tools>"'),
        (POSTAMBLE, '"\\n</tools><|im_end|>\\n"'),
    ]
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    path = pathlib.Path(tempfile.mkdtemp()) / "thinking.jinja"
    path.write_text(source)
    with model_from_args():
        s = Server([QWEN3, "--kv-cache-memory", "64MiB", "--chat-template", str(path)])
    yield s
    s.stop()


def test_responses_reasoning_item_matches_chat(thinking):
    client = client_of(thinking)
    # Greedy, so both endpoints generate the same tokens from the same prompt.
    c = chat(client, max_tokens=12).choices[0].message
    assert c.reasoning_content is not None, "the prompt opened the block"
    r = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=12, temperature=0)
    assert r.output[0].type == "reasoning"
    assert r.output[0].content[0].type == "reasoning_text"
    assert r.output[0].content[0].text == c.reasoning_content
    messages = [o for o in r.output if o.type == "message"]
    if c.content is None:
        assert messages == []
    else:
        assert messages[0].content[0].text == c.content
    assert r.usage.output_tokens_details.reasoning_tokens > 0

    stream = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=12, temperature=0, stream=True)
    deltas, kinds, final = "", [], None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.reasoning_text.delta":
            deltas += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[2] == "response.output_item.added"
    assert "response.reasoning_text.done" in kinds
    assert deltas == c.reasoning_content
    assert final.output[0].type == "reasoning"
    assert final.output[0].content[0].text == deltas


def test_tool_calls_after_reasoning_still_parse(thinking):
    # The prompt opened the block; the guide closes it and writes a call, which must come back parsed.
    # One small tool, so prompt and answer fit the fixture's 256 positions.
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    regex = r'Hm\.\n</think>\n\n<tool_call>\n\{"name": "now", "arguments": \{"tz": "UTC"\}\}\n</tool_call>'
    r = chat(client_of(thinking), tools=tools, max_tokens=80, response_format={"type": "regex", "regex": regex})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.reasoning_content == "Hm."
    assert not choice.message.content
    assert choice.message.tool_calls[0].function.name == "now"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"tz": "UTC"}


def test_parser_off_leaves_the_tags_in_content():
    with model_from_args():
        s = Server([QWEN3, "--kv-cache-memory", "64MiB", "--reasoning-parser", "off"])
    try:
        r = chat(client_of(s), **forced())
        message = r.choices[0].message
        assert message.content == "<think>\nI ponder.\n</think>\n\nDone."
        assert getattr(message, "reasoning_content", None) is None
        assert r.usage.completion_tokens_details is None
    finally:
        s.stop()

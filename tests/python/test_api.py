"""End-to-end tests of the OpenAI-compatible API with the official `openai` client and raw HTTP."""

import asyncio
import json
import time

import openai
import pytest
import requests

from conftest import API_KEY, MODEL_NAME

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write two sentences about the sea."},
]


def tokenize(server, **body):
    r = requests.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def assert_error_shape(response, status):
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert "param" in err and "code" in err
    return err


# ---------------------------------------------------------------- models, tokenize, health


def test_models_list_and_get(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_health_says_what_answers_and_ids_follow_requests(server):
    r = requests.get(server.url + "/health", timeout=5)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert body["role"] in ("colocated", "head")
    assert body["model"] == MODEL_NAME
    assert r.headers["x-request-id"].startswith("req-")
    r = requests.post(server.url + "/v1/completions", headers={"x-request-id": "py-1"},
                      json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "stream": True}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "py-1"
    r = requests.post(server.url + "/v1/completions", headers={"x-request-id": "x" * 129},
                      json={"model": "nope", "prompt": "Hi"}, timeout=30)
    assert r.status_code == 404 and r.headers["x-request-id"].startswith("req-")


def test_tokenize_round_trip(server):
    text = "Hello, world! Ünïcödé and emoji 🌊 too."
    tok = tokenize(server, prompt=text)
    assert tok["count"] == len(tok["tokens"]) > 0
    assert tok["max_model_len"] > 0
    r = requests.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=30)
    assert r.status_code == 200
    assert r.json()["prompt"] == text


def test_request_id_is_echoed(server):
    r = requests.get(server.url + "/v1/models", headers={"x-request-id": "abc-123"}, timeout=10)
    assert r.headers["x-request-id"] == "abc-123"


# ---------------------------------------------------------------- chat


def test_chat_non_stream(client, server):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0)
    assert r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion"
    assert r.model == MODEL_NAME
    assert r.system_fingerprint
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    prompt_count = tokenize(server, messages=MESSAGES)["count"]
    assert r.usage.prompt_tokens == prompt_count
    assert 1 <= r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_max_tokens_gives_length(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4


def test_n_choices(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=3, max_tokens=5, temperature=1.0, seed=11,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 15
    again = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, n=3, max_tokens=5, temperature=1.0, seed=11,
        extra_body={"ignore_eos": True},
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices], "seeded => reproducible"


def test_stop_strings(client):
    params = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**params).choices[0].message.content
    words = [w for w in full.split(" ")[2:] if len(w) >= 3]
    if not words:
        pytest.skip(f"greedy answer too short to pick a stop string from: {full!r}")
    stop = words[0]
    expected = full[: full.find(stop)]
    r = client.chat.completions.create(**params, stop=[stop, "\u0000never"])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(**params, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0
        assert isinstance(entry.token, str)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        best = max(t.logprob for t in entry.top_logprobs)
        assert entry.logprob == pytest.approx(best, abs=1e-3), "greedy picks the most likely token"


# ---------------------------------------------------------------- completions


def test_completion_string_and_usage(client, server):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0)
    assert r.id.startswith("cmpl-")
    assert r.object == "text_completion"
    assert isinstance(r.choices[0].text, str)
    assert r.usage.prompt_tokens == tokenize(server, prompt=prompt)["count"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_list_and_token_ids(client, server):
    prompts = ["Once upon a time", "1, 2, 3, 4,"]
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    ids = [tokenize(server, prompt=p)["tokens"] for p in prompts]
    assert r.usage.prompt_tokens == sum(len(i) for i in ids)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in sorted(by_ids.choices, key=lambda c: c.index)] == [
        c.text for c in sorted(r.choices, key=lambda c: c.index)
    ]
    single = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=4, temperature=0)
    assert single.choices[0].text == sorted(r.choices, key=lambda c: c.index)[0].text


def test_completion_echo_and_logprobs(client):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs)
    assert len(lp.tokens) == r.usage.prompt_tokens + r.usage.completion_tokens
    generated = lp.token_logprobs[r.usage.prompt_tokens:]
    assert all(v is not None and v <= 0 for v in generated)
    assert lp.text_offset == sorted(lp.text_offset)
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0)
    assert c.text == prompt + plain.choices[0].text
    # The prompt is scored too: null for its first token only (nothing precedes it), as OpenAI does.
    scored = lp.token_logprobs[: r.usage.prompt_tokens]
    assert scored[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in scored[1:])
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    # Streamed, the scored echo rides on the first chunk: the same text and logprobs in the end.
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_echo_scores_match_generation(client, server):
    """Scoring prompt + generated token (echo with logprobs, as lm-eval does) gives the logprob that the
    generation reported for that token."""
    prompt = "The capital of France is"
    gen = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    piece = gen.choices[0].text
    ids = tokenize(server, prompt=prompt)["tokens"]
    both = tokenize(server, prompt=prompt + piece)["tokens"]
    assert both[: len(ids)] == ids and len(both) == len(ids) + 1, "the piece must re-tokenize as one token"
    echo = client.completions.create(
        model=MODEL_NAME, prompt=prompt + piece, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    lp = echo.choices[0].logprobs
    assert echo.usage.prompt_tokens == len(both)
    scored = lp.token_logprobs[len(ids)]
    assert abs(scored - gen.choices[0].logprobs.token_logprobs[0]) < 1e-2


def test_completion_max_tokens_length(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt="Count: 1 2 3", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


# ---------------------------------------------------------------- errors


def test_errors_400(client, server):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=5)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=10_000_000)
    r = requests.post(
        server.url + "/v1/chat/completions",
        data="{not json",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert_error_shape(r, 400)
    r = requests.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": MESSAGES, "top_p": "high"},
        timeout=10,
    )
    assert_error_shape(r, 400)
    r = requests.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": MESSAGES, "temperature": -1},
        timeout=10,
    )
    assert assert_error_shape(r, 400)["param"] == "temperature"


def test_error_404_model(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)


def test_error_401_api_key(auth_server):
    bad = openai.OpenAI(base_url=auth_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = requests.get(auth_server.url + "/v1/models", timeout=10)
    assert_error_shape(r, 401)
    good = openai.OpenAI(base_url=auth_server.url + "/v1", api_key=API_KEY, max_retries=0)
    r = good.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    assert r.usage.completion_tokens >= 1
    assert requests.get(auth_server.url + "/health", timeout=5).status_code == 200


# ---------------------------------------------------------------- raw SSE framing


def test_sse_framing(server):
    body = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_content(chunk_size=None)).decode("utf-8")
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    events = events[:-1]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        assert event.startswith("data: "), repr(event)
        assert "\n" not in event
        json.loads(event[len("data: "):])
    assert json.loads(events[-2][len("data: "):])["usage"]["completion_tokens"] >= 1

    with requests.post(
        server.url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4, "stream": True},
        stream=True,
        timeout=120,
    ) as r:
        raw = b"".join(r.iter_content(chunk_size=None)).decode("utf-8")
    events = raw.split("\n\n")[:-1]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[len("data: "):])["object"] == "text_completion" for e in events[:-1])


# ---------------------------------------------------------------- metrics


def test_metrics(client, server):
    client.completions.create(model=MODEL_NAME, prompt="Metrics please", max_tokens=2)
    m = server.metrics()
    for name in [
        "tandem:num_requests_running",
        "tandem:num_requests_waiting",
        "tandem:kv_cache_usage_perc",
        "tandem:kv_blocks_used",
        "tandem:kv_blocks_total",
        "tandem:prompt_tokens_total",
        "tandem:generation_tokens_total",
        "tandem:prefix_cache_queries_total",
        "tandem:prefix_cache_hits_total",
        "tandem:time_to_first_token_seconds_count",
        "tandem:inter_token_latency_seconds_count",
        "tandem:e2e_request_latency_seconds_count",
    ]:
        assert name in m, name
    assert m["tandem:kv_blocks_total"] > 0
    assert m["tandem:prompt_tokens_total"] > 0
    assert m["tandem:generation_tokens_total"] > 0
    assert m["tandem:time_to_first_token_seconds_count"] >= 1
    assert sum(v for k, v in m.items() if k.startswith("tandem:request_success_total{")) >= 1


# ---------------------------------------------------------------- concurrency and disconnects


def test_64_concurrent_streams_with_disconnects(async_client, server):
    n_clients = 64

    async def one(i):
        stream = await async_client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"Tell me fact number {i} about rivers."}],
            max_tokens=16,
            temperature=0.8,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        if i % 3 == 0:
            async for _ in stream:
                break
            await stream.close()
            return None
        finish = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return finish

    async def main():
        return await asyncio.gather(*(one(i) for i in range(n_clients)))

    results = asyncio.run(main())
    completed = [r for i, r in enumerate(results) if i % 3 != 0]
    assert len(completed) == n_clients - len(range(0, n_clients, 3))
    assert all(r == "length" for r in completed), results

    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        if m["tandem:num_requests_running"] == 0 and m["tandem:kv_blocks_used"] == 0:
            break
        assert time.monotonic() < deadline, f"engine did not drain: {m}"
        time.sleep(0.2)
    assert m["tandem:num_requests_waiting"] == 0

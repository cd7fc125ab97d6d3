"""colibri serve against the official `openai` Python client."""

import threading

import httpx
import openai
import pytest

from conftest import API_KEY


def client(server, key=API_KEY):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0, timeout=60)


def model_id(server):
    return client(server).models.list().data[0].id


def test_models_lists_the_demo_model_as_random(server):
    models = client(server).models.list().data
    assert len(models) == 1
    assert models[0].id == "colibri-demo-random"
    assert "RANDOM" in models[0].owned_by


def test_chat_completion(server):
    r = client(server).chat.completions.create(
        model=model_id(server), messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        max_tokens=12, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str) and len(c.message.content) > 0
    assert c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_model_may_be_omitted_via_raw_request(server):
    r = httpx.post(server.base + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert r.status_code == 200


def test_completions_text_and_tokens(server):
    c = client(server)
    r = c.completions.create(model=model_id(server), prompt="Once upon", max_tokens=8, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Once upon")
    r = c.completions.create(model=model_id(server), prompt=[79, 110, 99, 101], max_tokens=5, temperature=0,
                             logprobs=2)
    assert len(r.choices[0].logprobs.tokens) == 5
    assert all(len(t) == 2 for t in r.choices[0].logprobs.top_logprobs)


def stream_text(chunks):
    text, usage, n = "", None, 0
    for ch in chunks:
        n += 1
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            text += choice.delta.content or ""
    return text, usage, n


def test_streaming_with_and_without_usage(server):
    c = client(server)
    msgs = [{"role": "user", "content": "Stream please"}]
    full = c.chat.completions.create(model=model_id(server), messages=msgs, max_tokens=16, temperature=0)
    text, usage, n = stream_text(c.chat.completions.create(
        model=model_id(server), messages=msgs, max_tokens=16, temperature=0, stream=True))
    assert text == full.choices[0].message.content
    assert usage is None
    assert n >= 10, "one chunk per token"
    text, usage, _ = stream_text(c.chat.completions.create(
        model=model_id(server), messages=msgs, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert text == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 16


def test_stop_sequences_are_not_emitted(server):
    c = client(server)
    msgs = [{"role": "user", "content": "Say something"}]
    text = c.chat.completions.create(model=model_id(server), messages=msgs, max_tokens=30, temperature=0) \
        .choices[0].message.content
    stop = text[6:9]
    r = c.chat.completions.create(model=model_id(server), messages=msgs, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed, _, _ = stream_text(c.chat.completions.create(
        model=model_id(server), messages=msgs, max_tokens=30, temperature=0, stop=stop, stream=True))
    assert streamed == text[:text.index(stop)]


def test_logprobs(server):
    r = client(server).chat.completions.create(
        model=model_id(server), messages=[{"role": "user", "content": "lp"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=4)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for tok in content:
        assert tok.logprob <= 0
        assert len(tok.top_logprobs) == 4
        assert tok.top_logprobs[0].logprob == tok.logprob  # greedy takes the most probable


def test_same_seed_same_text(server):
    c = client(server)

    def run(seed):
        return c.chat.completions.create(model=model_id(server), messages=[{"role": "user", "content": "seed"}],
                                         max_tokens=20, temperature=1.0, seed=seed).choices[0].message.content
    assert run(11) == run(11)
    assert run(11) != run(12)


def test_errors(server, tiny_server):
    with pytest.raises(openai.AuthenticationError):
        client(server, key="wrong").models.list()
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model=model_id(server), messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model=model_id(server), messages=[{"role": "user", "content": "x"}],
                                               temperature=5)
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])

    # 429: the only batch place is taken by a long stream, which stays
    # open until the check is done (a fast machine would otherwise finish
    # it first and free the place).
    c = client(tiny_server)
    name = model_id(tiny_server)
    started = threading.Event()
    checked = threading.Event()

    def long():
        s = c.completions.create(model=name, prompt="x", max_tokens=4000, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True})
        for i, _ in enumerate(s):
            if i == 2:
                started.set()
                checked.wait(30)
                break
        s.close()

    t = threading.Thread(target=long)
    t.start()
    try:
        assert started.wait(30)
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model=name, prompt="y", max_tokens=2)
    finally:
        checked.set()
        t.join()


def test_disconnect_mid_stream_then_a_normal_request(server):
    c = client(server)
    before = server.metric("requests_cancelled_total")
    s = c.chat.completions.create(model=model_id(server), messages=[{"role": "user", "content": "long"}],
                                  max_tokens=3000, temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(s):
        if i == 5:
            break
    s.close()  # the client goes away mid-stream
    import time
    for _ in range(400):
        if server.metric("requests_cancelled_total") > before and server.metric("running") == 0:
            break
        time.sleep(0.01)
    assert server.metric("requests_cancelled_total") == before + 1
    r = c.chat.completions.create(model=model_id(server), messages=[{"role": "user", "content": "again"}],
                                  max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4

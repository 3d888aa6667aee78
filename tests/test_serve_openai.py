"""`mpi-tp serve` as OpenAI's API has it (issue 42): n choices, lists of prompts, echo, logprobs, the seed,
the model's name, fields refused by name, chat completions through a chat template, and the official
`openai` client driving it. A real 2-rank job; every text is checked against the serial model alone
(generate, or its full forward pass for the log-probabilities), never against the server itself.
"""
import http.client
import json

import numpy as np
import pytest
from serving import BLOCK, expected, module_server, needs_mpiexec

from mpi_tp.inference.api import BadRequest, parse_chat, parse_completion
from mpi_tp.text.chat import ChatTemplate

pytestmark = needs_mpiexec
NAME = "run"            # serving_checkpoint is run/checkpoints: the served name is the run's folder's
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}a:{% endif %}"


@pytest.fixture(scope="module")
def server(serving_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("server")
    (folder / "chat.jinja").write_text(TEMPLATE)
    yield from module_server(serving_checkpoint, folder, "--max-batch", "4", "--chat-template",
                             str(folder / "chat.jinja"))


def events(server, path, body):
    """A streamed answer's events (JSON; the last: "[DONE]")."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}))
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream", r.read()
    out = [line[6:].strip() for line in r if line.startswith(b"data: ")]
    conn.close()
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in out]


def test_n_choices_of_each_prompt_each_with_its_own_seed(server, serving_serial):
    prompts, body = ["The ", "def f"], {"n": 2, "max_tokens": 8, "temperature": 0.9, "seed": 5}
    status, got = server.call("/v1/completions", {**body, "prompt": prompts})
    assert status == 200, got
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    want = [expected(serving_serial, {**body, "prompt": p, "seed": 5 + j}) for p in prompts for j in range(2)]
    assert [c["text"] for c in got["choices"]] == [w[0] for w in want]        # prompt i // n, seed + i % n
    assert len({w[0] for w in want}) == 4                                     # four different texts
    assert got["usage"]["prompt_tokens"] == 9 and got["usage"]["completion_tokens"] == sum(w[2] for w in want)
    streamed = events(server, "/v1/completions", {**body, "prompt": prompts})
    assert streamed[-1] == "[DONE]" and "usage" in streamed[-2]
    texts = ["".join(e["choices"][0]["text"] for e in streamed[:-1] if e["choices"][0]["index"] == i) for i in range(4)]
    assert texts == [w[0] for w in want]


def test_echo_puts_the_prompt_first(server, serving_serial):
    body = {"prompt": "The ", "max_tokens": 6, "temperature": 0}
    status, got = server.call("/v1/completions", {**body, "echo": True})
    assert status == 200 and got["choices"][0]["text"] == "The " + expected(serving_serial, body)[0], got


def test_logprobs_are_the_serial_models_log_softmax(server, serving_serial):
    body = {"prompt": "The ", "max_tokens": 6, "temperature": 0}
    status, got = server.call("/v1/completions", {**body, "logprobs": 3, "return_token_ids": True})
    assert status == 200, got
    lp, ids = got["choices"][0]["logprobs"], got["choices"][0]["token_ids"]
    assert len(ids) == len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    context = list(b"The ")

    def text(i):
        return chr(i) if i < 128 else f"bytes:\\x{i:02x}"
    for t, token in enumerate(ids):
        z = serving_serial.last_logits(np.array([context])).astype(np.float64)   # the full forward pass
        ref = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
        top = np.argsort(-ref, kind="stable")[:3]
        assert token == top[0] and lp["tokens"][t] == text(token)                 # greedy: the likeliest
        assert abs(lp["token_logprobs"][t] - ref[token]) < 1e-9
        got_top = lp["top_logprobs"][t]
        assert set(got_top) == {text(i) for i in top}, (got_top, top)
        assert max(abs(got_top[text(i)] - ref[i]) for i in top) < 1e-9
        context.append(token)
    lengths = [len(s) for s in lp["tokens"]]
    assert lp["text_offset"] == [sum(lengths[:t]) for t in range(6)]


def test_the_seed_is_random_unless_given(server):
    body = {"prompt": "The ", "max_tokens": 16, "temperature": 1.0}
    texts = {server.call("/v1/completions", body)[1]["choices"][0]["text"] for _ in range(3)}
    assert len(texts) == 3, texts                                # 256^16 texts: the same twice is no chance
    seeded = {server.call("/v1/completions", {**body, "seed": 3})[1]["choices"][0]["text"] for _ in range(2)}
    assert len(seeded) == 1


def test_the_model_is_named_and_checked(server):
    status, got = server.call("/v1/models")
    assert status == 200 and [m["id"] for m in got["data"]] == [NAME]
    assert server.call(f"/v1/models/{NAME}") == (200, got["data"][0])
    status, got = server.call("/v1/models/gpt-4")
    assert status == 404 and repr(NAME) in got["error"]["message"]
    status, got = server.call("/v1/completions", {"prompt": "x", "max_tokens": 1, "model": "gpt-4"})
    assert status == 404 and "'gpt-4' is not served here" in got["error"]["message"] and repr(NAME) in \
        got["error"]["message"]
    status, got = server.call("/v1/completions", {"prompt": "x", "max_tokens": 1, "model": NAME})
    assert status == 200 and got["model"] == NAME


def test_unknown_and_unsupported_fields_are_refused_by_name(server):
    status, got = server.call("/v1/completions", {"prompt": "x", "presence_penalty": 0.5, "logit_bias": {"1": 2},
                                                  "temprature": 0, "best_of": 3})
    message = got["error"]["message"]
    assert status == 400 and all(f in message for f in ("presence_penalty", "logit_bias", "temprature", "best_of"))
    status, got = server.call("/v1/completions", {"prompt": "x", "max_tokens": 1, "presence_penalty": 0,
                                                  "user": "me", "logit_bias": {}})
    assert status == 200, got                                    # the neutral values change nothing


def test_chat_renders_the_template_and_streams_deltas(server, serving_serial):
    messages = [{"role": "user", "content": "Hi"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0}
    want = expected(serving_serial, {"prompt": "user: Hi\na:", "max_tokens": 6, "temperature": 0})
    status, got = server.call("/v1/chat/completions", body)
    assert status == 200 and got["object"] == "chat.completion", got
    assert got["choices"][0]["message"] == {"role": "assistant", "content": want[0]}
    assert got["usage"]["prompt_tokens"] == len("user: Hi\na:") and got["id"].startswith("chatcmpl-")
    streamed = events(server, "/v1/chat/completions", body)
    assert all(e["object"] == "chat.completion.chunk" for e in streamed[:-1])
    assert streamed[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in streamed[:-1]) == want[0]
    assert streamed[-2]["choices"][0]["finish_reason"] == want[1] and streamed[-2]["usage"] == got["usage"]
    status, got = server.call("/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 2})
    plain = server.call("/v1/completions", {"prompt": "user: Hi\na:", "max_tokens": 6, "temperature": 0,
                                            "logprobs": 2})[1]["choices"][0]["logprobs"]    # (checked above)
    content = got["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == plain["tokens"] and [c["logprob"] for c in content] == \
        plain["token_logprobs"]
    assert [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content] == plain["top_logprobs"]
    assert all(len(c["top_logprobs"]) == 2 and len(c["bytes"]) == 1 for c in content)
    status, got = server.call("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert status == 400 and "role" in got["error"]["message"]


def test_a_model_without_a_chat_template_is_refused():
    raw = json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode()
    with pytest.raises(BadRequest, match="no chat template"):
        parse_chat(raw, BLOCK, 256, None, None)
    template = ChatTemplate("{% if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}"
                            "{% endif %}")
    with pytest.raises(BadRequest, match="refused these messages: a system message first"):
        parse_chat(raw, BLOCK, 256, None, template)
    sneaky = ChatTemplate("{{ messages.__class__.__mro__ }}")          # the sandbox: no Python internals
    with pytest.raises(BadRequest, match="chat template failed"):
        parse_chat(raw, BLOCK, 256, None, sneaky)
    c = parse_completion(b'{"prompt": [[1, 2], "ab"], "n": 3, "seed": 18446744073709551615}', BLOCK)
    assert [r.prompt for r in c.requests] == [(1, 2)] * 3 + [b"ab"] * 3
    assert [r.seed for r in c.requests] == [2**64 - 1, 0, 1] * 2


def test_the_openai_client(server, serving_serial):
    openai = pytest.importorskip("openai", reason="the openai package is not installed (pip install openai)")
    client = openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == [NAME]
    body = {"prompt": "The ", "max_tokens": 8, "temperature": 0}
    want = expected(serving_serial, body)[0]
    got = client.completions.create(model=NAME, **body)
    assert got.choices[0].text == want and got.usage.completion_tokens == 8
    got = client.completions.create(model=NAME, **{**body, "temperature": 0.8}, n=2, seed=11)
    assert [c.text for c in got.choices] == [expected(serving_serial, {**body, "temperature": 0.8, "seed": s})[0]
                                             for s in (11, 12)]
    assert "".join(c.choices[0].text for c in client.completions.create(model=NAME, stream=True, **body)) == want
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0)
    assert chat.choices[0].message.content == expected(serving_serial, {"prompt": "user: Hi\na:", "max_tokens": 6,
                                                                        "temperature": 0})[0]
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.completions.create(model=NAME, frequency_penalty=1.0, **body)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", **body)

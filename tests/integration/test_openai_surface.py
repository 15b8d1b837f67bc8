"""The OpenAI/vLLM request surface, table-driven, over a real drafter + verifier + gateway:
every parameter of vLLM's CompletionRequest and ChatCompletionRequest (written out
below) is sent with a value that would change the output if honoured, and each answer
is either that effect or a 400 whose error names the parameter -- never a silent 200.
No-op parameters must be in the gateway's documented ACCEPTED_EXTRAS. Plus `n` = 3 and
`echo` through the official `openai` client, and `n` streamed with interleaved indices."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from chainspec.engine.local import LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.sampling import SamplingParams
from chainspec.gateway.app import Gateway
from chainspec.gateway.params import ACCEPTED_EXTRAS, REFUSED
from chainspec.gateway.schemas import CompletionRequest, parse
from chainspec.models.tokenizer import Tokenizer
from tests.integration.helpers import generate, verifier_stub
from tests.integration.test_gateway import AUTH, KEY, error, stack  # noqa: F401
from tests.integration.tiny_checkpoint import chat_prompt

pytestmark = pytest.mark.timeout(300)
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT, TOKENS, HOT = "hello world", 8, {"temperature": 1.5, "seed": 7}
BASE = {CMPL: {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True},
        CHAT: {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS,
               "temperature": 0, "ignore_eos": True}}
CHAT_PROMPT = chat_prompt([("user", PROMPT)])  # the chat baseline as a completion

# vLLM's vllm/entrypoints/openai/protocol.py request fields (OpenAI's and vLLM's extras).
VLLM_COMMON = [
    "model", "frequency_penalty", "logit_bias", "max_tokens", "n", "presence_penalty",
    "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user", "best_of",
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "prompt_logprobs", "add_special_tokens", "response_format",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs",
    "priority", "request_id", "logits_processors", "return_tokens_as_token_ids",
    "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs", "bad_words",
    "logprobs", "echo"]
VLLM_COMPLETION = [*VLLM_COMMON, "prompt", "suffix", "prompt_embeds", "detokenize"]
VLLM_CHAT = [
    *VLLM_COMMON, "messages", "top_logprobs", "max_completion_tokens", "tools",
    "tool_choice", "parallel_tool_calls", "functions", "function_call", "reasoning_effort",
    "include_reasoning", "add_generation_prompt", "continue_final_message", "documents",
    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structural_tag",
    "modalities", "metadata", "store", "service_tier", "prediction", "audio",
    "web_search_options"]

FIELDS = {CMPL: VLLM_COMPLETION, CHAT: VLLM_CHAT}


@dataclass
class Ctx:
    url: str
    greedy: dict[str, str]  # endpoint -> greedy text of BASE
    greedy_tokens: dict[str, list[int]]  # endpoint -> greedy token ids of BASE

    def post(self, path: str, fields: dict[str, Any], base: bool = True) -> httpx.Response:
        body = {**BASE[path], **fields} if base else fields
        return httpx.post(f"{self.url}{path}", json=body, headers=AUTH, timeout=60)

    def ok(self, path: str, fields: dict[str, Any]) -> dict:
        r = self.post(path, fields)
        assert r.status_code == 200, r.text
        return r.json()


def text_of(body: dict, i: int = 0) -> str:
    c = body["choices"][i]
    return c["text"] if "text" in c else c["message"]["content"]


@pytest.fixture(scope="module")
def ctx(stack):  # noqa: F811
    channel, stub = verifier_stub(stack.verifier.address)
    c = Ctx(stack.url, {}, {})
    for path, prompt in ((CMPL, PROMPT), (CHAT, CHAT_PROMPT)):
        ref = generate(stub, prompt, TOKENS)
        c.greedy[path], c.greedy_tokens[path] = text_of(c.ok(path, {})), ref.tokens
        assert c.greedy[path] == ref.text
    channel.close()
    return c


# ------------------------------------------------------------------------- the checks
Check = Callable[[Ctx, str, httpx.Response], None]


def refused(ctx: Ctx, path: str, r: httpx.Response, name: str) -> None:
    e = error(r, 400, name)
    assert e["type"] == "invalid_request_error"


def accepted_extra(ctx: Ctx, path: str, r: httpx.Response, name: str) -> None:
    assert name in ACCEPTED_EXTRAS and ACCEPTED_EXTRAS[name], name
    assert r.status_code == 200 and text_of(r.json()) == ctx.greedy[path], r.text


def greedy(ctx: Ctx, path: str, r: httpx.Response, name: str) -> None:
    """The value made the output greedy (top_p, top_k at a hot temperature)."""
    assert r.status_code == 200 and text_of(r.json()) == ctx.greedy[path], r.text


def hot_differs(ctx, path, r, name) -> None:
    assert r.status_code == 200 and text_of(r.json()) != ctx.greedy[path], r.text


def seeded(ctx, path, r, name) -> None:
    assert r.status_code == 200
    again, other = ctx.ok(path, HOT), ctx.ok(path, {**HOT, "seed": 8})
    assert text_of(again) == text_of(r.json()) != text_of(other)


def tokens(n: int) -> Check:
    def check(ctx, path, r, name) -> None:
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n, r.text
    return check


def stop_string(ctx: Ctx, path: str) -> str:
    text = ctx.greedy[path]
    return text[len(text) // 2:len(text) // 2 + 2]


def stopped_before(ctx, path, r, name) -> None:
    body = r.json()
    at = ctx.greedy[path].find(stop_string(ctx, path))
    assert text_of(body) == ctx.greedy[path][:at]
    assert body["choices"][0]["finish_reason"] == "stop"


def stopped_after(ctx, path, r, name) -> None:
    s = stop_string(ctx, path)
    at = ctx.greedy[path].find(s)
    assert r.status_code == 200 and text_of(r.json()) == ctx.greedy[path][:at + len(s)], r.text


def stop_token(ctx, path, r, name) -> None:
    body = r.json()
    ids = ctx.greedy_tokens[path]
    first = ids.index(ids[2])
    assert body["usage"]["completion_tokens"] == first + 1, body
    assert body["choices"][0]["finish_reason"] == "stop"


def three_choices(ctx, path, r, name) -> None:
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 3 * TOKENS
    assert text_of(body, 0) == text_of(ctx.ok(path, HOT))  # choice 0 keeps the seed


def streamed(ctx, path, r, name) -> None:
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    text = "".join(c.get("text") or c.get("delta", {}).get("content") or ""
                   for e in events for c in e["choices"])
    assert r.text.endswith("data: [DONE]\n\n") and text == ctx.greedy[path]
    if "include_usage" in name:
        assert events[-1]["usage"]["completion_tokens"] == TOKENS


def response_id(ctx, path, r, name) -> None:
    prefix = "cmpl-" if path == CMPL else "chatcmpl-"
    assert r.json()["id"] == f"{prefix}my-id-1"


def wire_ignore_eos(ctx, path, r, name) -> None:
    """EOS cannot be forced from the tiny model: the verifier request carries the flag."""
    body = parse(CompletionRequest, {**BASE[CMPL], "ignore_eos": True})
    spec = Gateway.new_specs(body, PROMPT, "cmpl-")[1][0]
    assert spec.message().stop.ignore_eos and r.status_code == 200


def as_completion(prompt: str | Callable[[Ctx], str]) -> Check:
    """The chat answer equals /v1/completions on `prompt` (what the chat should render)."""
    def check(ctx, path, r, name) -> None:
        text = prompt(ctx) if callable(prompt) else prompt
        want = text_of(ctx.ok(CMPL, {"prompt": text}))
        assert r.status_code == 200 and text_of(r.json()) == want, r.text
    return check


def differs(ctx, path, r, name) -> None:
    assert r.status_code == 200 and text_of(r.json()) != ctx.greedy[path], r.text


def min_tokens_hold_the_stop(ctx, path, r, name) -> None:
    """The stop token id cannot end the request before min_tokens tokens."""
    ids = ctx.greedy_tokens[path]
    body = r.json()
    assert body["usage"]["completion_tokens"] >= 6 > ids.index(ids[2]) + 1, body


def with_logprobs(top: int) -> Check:
    def check(ctx, path, r, name) -> None:
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        pairs = zip(lp.get("token_logprobs", ()), lp.get("top_logprobs", ()), strict=True)
        entries = lp["content"] if path == CHAT else [
            {"logprob": v, "top_logprobs": t} for v, t in pairs]
        assert len(entries) == TOKENS and all(e["logprob"] <= 0 for e in entries)
        assert all(len(e["top_logprobs"]) == top for e in entries), entries
    return check


def echoed(ctx, path, r, name) -> None:
    assert r.status_code == 200 and text_of(r.json()) == PROMPT + ctx.greedy[CMPL], r.text


def chat_echoed(ctx, path, r, name) -> None:
    plain = ctx.ok(CHAT, {"messages": CONTINUE})
    assert text_of(r.json()) == "Sure" + text_of(plain)


def matches(pattern: str) -> Check:
    """The output is the whole of `pattern` (a grammar's), and ended there (EOS)."""
    def check(ctx, path, r, name) -> None:
        assert r.status_code == 200, r.text
        text, reason = text_of(r.json()), r.json()["choices"][0]["finish_reason"]
        assert re.fullmatch(pattern, text) and reason == "stop", (text, reason)
    return check


def refused_as(param: str) -> Check:
    def check(ctx, path, r, name) -> None:
        error(r, 400, param)
    return check


# ------------------------------------------------------------------------- the table
FREE = {"ignore_eos": False, "max_tokens": 32}  # room for a grammar to end with EOS
CONTINUE = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Sure"}]
TEMPLATE = "{{ messages[0]['content'] }}{{ mark }}"
REFUSE = "refuse"
# (endpoints, parameter, fields sent (or a function of ctx), check)
ROWS: list[tuple[tuple[str, ...], str, Any, Any]] = [
    ((CMPL, CHAT), "model", {"model": "not-served"}, REFUSE),
    ((CMPL, CHAT), "priority", {"priority": 0}, greedy),
    ((CMPL, CHAT), "cache_salt", {"cache_salt": "tenant-1"}, greedy),  # the same output
    ((CMPL, CHAT), "priority", {"priority": 5}, REFUSE),  # the verifier schedules fcfs
    ((CMPL, CHAT), "max_tokens", {"max_tokens": 3}, tokens(3)),
    ((CHAT,), "max_completion_tokens", {"max_completion_tokens": 2}, tokens(2)),
    ((CMPL, CHAT), "temperature", HOT, hot_differs),
    ((CMPL, CHAT), "top_p", {**HOT, "top_p": 1e-6}, greedy),
    ((CMPL, CHAT), "top_k", {**HOT, "top_k": 1}, greedy),
    ((CMPL, CHAT), "seed", HOT, seeded),
    ((CMPL, CHAT), "stop", lambda c, p: {"stop": [stop_string(c, p)]}, stopped_before),
    ((CMPL, CHAT), "include_stop_str_in_output",
     lambda c, p: {"stop": stop_string(c, p), "include_stop_str_in_output": True},
     stopped_after),
    ((CMPL, CHAT), "include_stop_str_in_output",  # the verifier says which one matched
     lambda c, p: {"stop": ["\u2603\u2603", stop_string(c, p)],
                   "include_stop_str_in_output": True}, stopped_after),
    ((CMPL, CHAT), "stop_token_ids",
     lambda c, p: {"stop_token_ids": [c.greedy_tokens[p][2]]}, stop_token),
    ((CMPL, CHAT), "n", {**HOT, "n": 3}, three_choices),
    ((CMPL, CHAT), "best_of", {"best_of": 2}, REFUSE),
    ((CMPL, CHAT), "stream", {"stream": True}, streamed),
    ((CMPL, CHAT), "stream_options",
     {"stream": True, "stream_options": {"include_usage": True}}, streamed),
    ((CMPL, CHAT), "stream_options.continuous_usage_stats",
     {"stream": True, "stream_options": {"continuous_usage_stats": True}}, REFUSE),
    ((CMPL, CHAT), "ignore_eos", {"ignore_eos": True}, wire_ignore_eos),
    ((CMPL, CHAT), "request_id", {"request_id": "my-id-1"}, response_id),
    ((CMPL, CHAT), "response_format", {**FREE, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}},
     matches(r'\{"ok": (true|false)\}')),
    ((CMPL, CHAT), "response_format", {"response_format": {"type": "json_object"}},
     refused_as("ignore_eos")),  # BASE ignores EOS, which a grammar needs to end
    ((CMPL, CHAT), "guided_regex", {**FREE, "guided_regex": "[0-9]{3}"}, matches("[0-9]{3}")),
    ((CMPL, CHAT), "guided_choice", {**FREE, "guided_choice": ["yes", "no"]},
     matches("yes|no")),
    ((CMPL, CHAT), "guided_json", {**FREE, "guided_json": {"enum": ["red", "blue"]}},
     matches('"(red|blue)"')),
    ((CMPL, CHAT), "guided_grammar", {**FREE, "guided_grammar": 'root ::= "a" "b"?'},
     matches("ab?")),
    ((CMPL, CHAT), "guided_decoding_backend",
     {**FREE, "guided_regex": "[xy]z", "guided_decoding_backend": "xgrammar"}, matches("[xy]z")),
    ((CMPL, CHAT), "guided_decoding_backend", {"guided_decoding_backend": "outlines"}, REFUSE),
    ((CMPL, CHAT), "structured_outputs", {**FREE, "structured_outputs": {"regex": "[a-c]{2}"}},
     matches("[a-c]{2}")),
    ((CMPL, CHAT), "structured_outputs", {**FREE, "structured_outputs": {"regex": "(a"}},
     refused_as("structured_outputs.regex")),
    ((CMPL,), "prompt", {"prompt": ["a", "b"]}, REFUSE),
    ((CMPL,), "echo", {"echo": True}, echoed),
    ((CHAT,), "messages", {"messages": [{"role": "user", "content": "other"}]},
     as_completion(chat_prompt([("user", "other")]))),
    ((CHAT,), "echo", {"messages": CONTINUE, "echo": True}, chat_echoed),
    ((CHAT,), "add_generation_prompt", {"add_generation_prompt": False},
     as_completion(CHAT_PROMPT.removesuffix("<|assistant|>\n"))),
    ((CHAT,), "continue_final_message",
     {"messages": CONTINUE, "continue_final_message": True, "add_generation_prompt": False},
     as_completion(CHAT_PROMPT + "Sure")),
    ((CHAT,), "chat_template", {"chat_template": TEMPLATE}, as_completion(PROMPT)),
    ((CHAT,), "chat_template_kwargs",
     {"chat_template": TEMPLATE, "chat_template_kwargs": {"mark": "!"}},
     as_completion(PROMPT + "!")),
    # the server's template takes variables too; one it does not read changes nothing
    ((CHAT,), "chat_template_kwargs", {"chat_template_kwargs": {"mark": "!"}},
     as_completion(CHAT_PROMPT)),
    ((CMPL, CHAT), "no_such_parameter", {"no_such_parameter": 1}, REFUSE),
    ((CMPL, CHAT), "presence_penalty", {"presence_penalty": -2.0, "max_tokens": TOKENS},
     differs),
    ((CMPL, CHAT), "frequency_penalty", {"frequency_penalty": -2.0}, differs),
    ((CMPL, CHAT), "repetition_penalty", {"repetition_penalty": 3.0}, differs),
    ((CMPL, CHAT), "logit_bias", {"logit_bias": {"7": 100}}, differs),
    ((CMPL, CHAT), "logit_bias.7", {"logit_bias": {"7": 101}}, REFUSE),
    ((CMPL, CHAT), "min_p", {**HOT, "min_p": 1.0}, greedy),
    ((CMPL, CHAT), "min_tokens",
     lambda c, p: {"min_tokens": 6, "stop_token_ids": [c.greedy_tokens[p][2]]},
     min_tokens_hold_the_stop),
    ((CMPL,), "logprobs", {"logprobs": 2}, with_logprobs(2)),
    ((CHAT,), "logprobs", {"logprobs": True}, with_logprobs(0)),
    ((CHAT,), "top_logprobs", {"logprobs": True, "top_logprobs": 3}, with_logprobs(3)),
    ((CHAT,), "top_logprobs", {"top_logprobs": 3}, REFUSE),
    ((CMPL,), "echo", {"echo": True, "logprobs": 1}, REFUSE),
]
ON_VALUES: dict[str, Any] = {  # a value that would change the output, per refused name
    "suffix": "!", "use_beam_search": True, "length_penalty": 2.0, "prompt_logprobs": 1,
    "allowed_token_ids": [1, 2], "bad_words": ["x"], "guided_whitespace_pattern": " ",
    "structural_tag": "{}",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "functions": [{"name": "f"}], "tool_choice": "auto", "function_call": "auto",
    "documents": [{"text": "d"}], "mm_processor_kwargs": {"a": 1},
    "truncate_prompt_tokens": 2, "return_tokens_as_token_ids": True,
    "return_token_ids": True, "detokenize": False, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "add_special_tokens": False,
    "logits_processors": ["m.f"], "vllm_xargs": {"a": 1}, "kv_transfer_params": {"a": 1},
    "prompt_embeds": "AAAA", "reasoning_effort": "high", "audio": {"voice": "x"},
    "modalities": ["text", "audio"], "web_search_options": {}, "store": True,
    "service_tier": "flex"}
EXTRA_VALUES: dict[str, Any] = {
    "user": "u-1", "metadata": {"k": "v"}, "prediction": {"type": "content", "content": "x"},
    "parallel_tool_calls": False, "include_reasoning": False}


def all_rows() -> list[tuple[str, str, Any, Any]]:
    rows = [(p, name, fields, check) for paths, name, fields, check in ROWS for p in paths]
    for name in sorted(REFUSED):
        for path in (CMPL, CHAT):
            if name in FIELDS[path]:
                rows.append((path, name, {name: ON_VALUES[name]}, REFUSE))
    rows += [(p, name, {name: v}, accepted_extra) for name, v in EXTRA_VALUES.items()
             for p in (CMPL, CHAT) if name in FIELDS[p]]
    return rows


def test_every_vllm_parameter_has_a_row() -> None:
    rows = all_rows()
    for path, names in FIELDS.items():
        covered = {name.split(".")[0] for p, name, _, _ in rows if p == path}
        assert set(names) <= covered, sorted(set(names) - covered)


def test_each_parameter_has_its_effect_or_is_refused_by_name(ctx) -> None:
    failures = []
    for path, name, fields, check in all_rows():
        sent = fields(ctx, path) if callable(fields) else fields
        r = ctx.post(path, sent)
        try:
            if check == REFUSE:
                refused(ctx, path, r, name)
            else:
                check(ctx, path, r, name)
        except AssertionError as e:
            failures.append(f"{path} {name} {sent}: {e}")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ the openai client


def test_n_and_echo_through_the_openai_client(stack) -> None:  # noqa: F811
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=TOKENS,
                                    n=3, seed=11, temperature=1.5)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 3 * TOKENS
    single = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=TOKENS,
                                       seed=12, temperature=1.5)
    assert out.choices[1].text == single.choices[0].text  # choice i runs with seed + i
    chat = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": PROMPT}], n=3,
        max_tokens=TOKENS, temperature=0)
    assert len({c.message.content for c in chat.choices}) == 1  # greedy: all equal
    echo = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=TOKENS,
                                     temperature=0, echo=True)
    plain = client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=TOKENS,
                                      temperature=0)
    assert echo.choices[0].text == PROMPT + plain.choices[0].text


def test_n_streamed_interleaves_choices_by_index(stack) -> None:  # noqa: F811
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0)
    kw = {"model": stack.model, "prompt": PROMPT, "max_tokens": 24, "seed": 5,
          "temperature": 1.5, "n": 3}
    whole = client.completions.create(**kw)
    texts, order = ["", "", ""], []
    usage = None
    for chunk in client.completions.create(**kw, stream=True,
                                           stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
            order.append(c.index)
        usage = chunk.usage or usage
    assert texts == [c.text for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens == 3 * 24
    first_end = max(order.index(i) for i in range(3))
    assert first_end < len(order) - 3, order  # chunks of the three choices interleave


def plain_logprobs(model_dir, prompt: list[int], top: int) -> list:
    """Greedy TokenLogprobs of an in-process verifier engine without a drafter."""
    opts = LocalOptions(model_dir=model_dir, num_steps=3, max_seqs=2, max_len=256)
    engine = build_verifier(load_models(opts, speculative=False), opts, speculative=False)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, num_logprobs=top),
                       StopConditions(max_tokens=TOKENS, ignore_eos=True))
    out = []
    while len(out) < TOKENS:
        for o in engine.step():
            out.extend(o.logprobs or ())
    return out


def test_logprobs_through_the_openai_client_equal_plain(stack, model_dir) -> None:  # noqa: F811
    prompt = Tokenizer.from_dir(model_dir).encode(PROMPT)
    plain = plain_logprobs(model_dir, prompt, 5)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model=stack.model, prompt=prompt, max_tokens=TOKENS,
                                    temperature=0, logprobs=5,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp.tokens == [f"token_id:{p.token}" for p in plain]
    assert max(abs(a - p.logprob) for a, p in zip(lp.token_logprobs, plain, strict=True)) < 1e-4
    for got, p in zip(lp.top_logprobs, plain, strict=True):
        assert list(got) == [f"token_id:{t}" for t, _ in p.top]
        assert max(abs(got[f"token_id:{t}"] - v) for t, v in p.top) < 1e-4
    chat = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": PROMPT}], logprobs=True,
        top_logprobs=5, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == TOKENS and all(len(c.top_logprobs) == 5 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)

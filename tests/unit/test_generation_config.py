"""vLLM's --generation-config and --max-logprobs, and the gateway's flag rows: a model's
sampling defaults apply to requests that leave them unset (and only to those), `vllm`
turns them off, a bad file is one line at start; a request asking more logprobs than
--max-logprobs is a 400 naming the field; every gateway flag means the same through
`serve` and `gateway`."""

from __future__ import annotations

import json

import pytest

from chainspec.cli import build_parser
from chainspec.commands import gateway as gateway_command
from chainspec.commands import serve
from chainspec.commands.stack_flags import GATEWAY_FLAGS
from chainspec.gateway.app import Gateway
from chainspec.gateway.chat_template import ChatTemplate
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.errors import APIError
from chainspec.gateway.generation_config import sampling_defaults
from chainspec.gateway.routing import VerifierPool
from chainspec.gateway.schemas import ChatCompletionRequest, CompletionRequest, parse

PARSER, _ = build_parser()
MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True,
                  "max_new_tokens": 64, "eos_token_id": 2}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(MODEL_DEFAULTS))
    return tmp_path


def gateway(**config) -> Gateway:
    return Gateway(GatewayConfig(**config), VerifierPool(), ChatTemplate())


def test_auto_reads_the_keys_vllm_reads(model_dir) -> None:
    assert dict(sampling_defaults("auto", model_dir)) == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert sampling_defaults("vllm", model_dir) == ()
    assert sampling_defaults("auto", model_dir / "none") == ()  # no file: no defaults
    assert dict(sampling_defaults(str(model_dir), None))["top_k"] == 20  # a directory


def test_the_defaults_fill_only_what_a_request_leaves_unset(model_dir) -> None:
    g = gateway(sampling_defaults=sampling_defaults("auto", model_dir))
    body = g.request_params(parse(CompletionRequest, {"prompt": "x", "temperature": 0}))
    assert (body.temperature, body.top_p, body.top_k, body.max_tokens) == (0.0, 0.95, 20, 64)
    plain = gateway().request_params(parse(CompletionRequest, {"prompt": "x"}))
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)  # OpenAI's


@pytest.mark.parametrize("bad,needle", [
    ({"temperature": "hot"}, "temperature: input should be a valid number"),
    ({"top_p": 0}, "top_p: input should be greater than 0"),
])
def test_a_bad_generation_config_is_one_line_naming_the_file_and_key(tmp_path, bad, needle):
    (tmp_path / "generation_config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=needle) as e:
        sampling_defaults("auto", tmp_path)
    assert str(tmp_path) in str(e.value)
    with pytest.raises(ValueError, match="no generation_config.json there"):
        sampling_defaults(str(tmp_path / "nowhere"), None)


def test_max_logprobs_is_a_400_naming_the_field() -> None:
    g = gateway(max_logprobs=2)
    assert g.request_params(parse(CompletionRequest, {"prompt": "x", "logprobs": 2}))
    with pytest.raises(APIError) as e:
        g.request_params(parse(CompletionRequest, {"prompt": "x", "logprobs": 3}))
    assert e.value.param == "logprobs" and "--max-logprobs" in e.value.message
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            "top_logprobs": 3}
    with pytest.raises(APIError) as e:
        g.request_params(parse(ChatCompletionRequest, chat))
    assert e.value.param == "top_logprobs"


# gateway key -> a value unlike the default (one line each; a new row fails here)
EXAMPLES = {"host": ["0.0.0.0"], "port": ["9001"], "served_model_name": ["a", "b"],
            "max_n": ["4"], "max_in_flight": ["9"], "trust_request_chat_template": [],
            "chat_template": ["{{ messages }}"], "generation_config": ["vllm"],
            "max_logprobs": ["5"]}


def test_every_gateway_row_has_an_example() -> None:
    assert sorted(r.key.removeprefix("gateway.") for r in GATEWAY_FLAGS) == sorted(EXAMPLES)


@pytest.mark.parametrize("row", GATEWAY_FLAGS, ids=lambda r: r.flag)
def test_a_gateway_flag_means_the_same_through_serve_and_gateway(row) -> None:
    key = row.key.removeprefix("gateway.")
    for name in row.names:
        argv = [name, *EXAMPLES[key]]
        by_serve = serve.resolve(PARSER.parse_args(["serve", *argv])).gateway
        alone = gateway_command.resolve(PARSER.parse_args(
            ["gateway", "--verifier", "h:1", *argv]))
        assert by_serve == alone != GatewayConfig(), name

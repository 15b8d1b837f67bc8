"""The per-request depth cap (`speculative: {"num_speculative_tokens": n}`, DESIGN 4.11)
travels from the gateway's body over the Generate wire to the engine's arguments."""

import pytest
from pydantic import ValidationError

from chainspec.gateway.app import Gateway
from chainspec.gateway.schemas import ChatCompletionRequest, CompletionRequest
from chainspec.rpc.generate_codec import GenerateLimits, parse_generate

LIMITS = GenerateLimits(61, 256, 3)


def _wire_cap(body: dict, cls=CompletionRequest):
    req = cls.model_validate(body)
    req.check_supported()
    _, specs = Gateway.new_specs(req, [1, 2, 3], "cmpl-")
    return [parse_generate(s.message(), LIMITS, None).num_speculative_tokens for s in specs]


@pytest.mark.parametrize("cap", [0, 1, 7])
def test_cap_reaches_the_engine_arguments(cap):
    assert _wire_cap({"prompt": [1], "speculative": {"num_speculative_tokens": cap}}) == [cap]
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2,
            "speculative": {"num_speculative_tokens": cap}}
    assert _wire_cap(chat, ChatCompletionRequest) == [cap, cap]  # every choice


def test_no_cap_is_unset_on_the_wire():
    assert _wire_cap({"prompt": [1]}) == [None]


@pytest.mark.parametrize("bad", [{"num_speculative_tokens": -1}, {"num_speculative_tokens": "2"},
                                 {"num_speculative_tokens": 2, "method": "mtp"}, {}])
def test_bad_caps_are_refused(bad):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": [1], "speculative": bad})

"""`/v1/models` cards (vLLM's ModelCard) from the verifiers' Info, without a stack: one
card per served name; under --model-name the card's `root` is what the verifiers load,
its `max_model_len` the longest they take; an unknown id is a 404 naming it."""

from __future__ import annotations

import pytest
from openai.types import Model

from chainspec.gateway.app import Gateway
from chainspec.gateway.chat_template import ChatTemplate
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.errors import APIError
from chainspec.gateway.routing import VerifierPool
from chainspec.rpc.generated.v1 import verifier_pb2 as pb


class FakeVerifier:
    serving, in_flight, retired, load = True, 0, False, 0

    def __init__(self, endpoint: str, model: str, max_model_len: int) -> None:
        self.endpoint, self.stub = endpoint, None
        self.info = pb.VerifierInfo(model_name=model, max_model_len=max_model_len)


def gateway(model_name: str = "") -> Gateway:
    pool = VerifierPool()
    for i, (model, length) in enumerate([("org/b", 512), ("org/a", 1024), ("org/b", 2048)]):
        pool.handles[f"v:{i}"] = FakeVerifier(f"v:{i}", model, length)
    return Gateway(GatewayConfig(served_model_name=model_name), pool, ChatTemplate())


def test_one_card_per_model_with_its_longest_context() -> None:
    cards = gateway().model_cards()
    assert [(c["id"], c["root"], c["max_model_len"]) for c in cards] == \
        [("org/a", "org/a", 1024), ("org/b", "org/b", 2048)]
    assert all(Model.model_validate(c).owned_by == "chainspec" and c["parent"] is None
               for c in cards)


def test_an_alias_card_roots_at_the_loaded_model() -> None:
    (card,) = gateway("served").model_cards()
    assert (card["id"], card["root"], card["max_model_len"]) == ("served", "org/a", 2048)
    assert gateway("served").model_card("served") == card


def test_an_unknown_id_is_a_404_naming_it() -> None:
    with pytest.raises(APIError) as e:
        gateway().model_card("org/c")
    body = e.value.body()["error"]
    assert e.value.status == 404 and body["param"] == "model"
    assert "'org/c'" in body["message"] and "'org/a', 'org/b'" in body["message"]

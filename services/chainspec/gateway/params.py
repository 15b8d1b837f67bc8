"""Which request parameters the gateway honours, accepts as documented no-ops, or refuses.

No parameter is ever ignored silently: a field of either endpoint is one of
- a declared field of the request schema (`schemas.py`), honoured;
- in `ACCEPTED_EXTRAS`: accepted, with the reason it cannot change the output;
- in `REFUSED`: accepted only at its "off" values, anything else is 400 naming it;
- anything else: 400 "unknown parameter", naming it.
docs/design.md ("OpenAI surface") lists the same tables.
"""

from __future__ import annotations

from typing import Any

from chainspec.gateway.errors import APIError, invalid, unsupported

# name -> why accepting it changes nothing
ACCEPTED_EXTRAS: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring; nothing is logged per user",
    "metadata": "labels for stored completions; nothing is stored (`store` must be false)",
    "prediction": "a predicted output only makes decoding faster, never different; "
                  "chainspec drafts with its MTP modules instead",
    "parallel_tool_calls": "only matters with `tools`, which are refused",
    "include_reasoning": "no reasoning parser runs, so there is no reasoning content to "
                         "include or drop",
}

_OFF_NONE: tuple[Any, ...] = (None,)
_OFF_EMPTY: tuple[Any, ...] = (None, [], {}, "")

# name -> (values that mean "off", why any other value is refused)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": (_OFF_EMPTY, "suffix (insertion) needs a fill-in-the-middle prompt format"),
    "use_beam_search": ((None, False), "beam search"),
    "length_penalty": ((None, 1, 1.0), "length_penalty (it only acts on beam search)"),
    "prompt_logprobs": (_OFF_NONE, "prompt_logprobs"),
    "allowed_token_ids": (_OFF_NONE, "allowed_token_ids"),
    "bad_words": (_OFF_EMPTY, "bad_words"),
    # structured output is honoured (gateway/structured_output.py), but not these two
    "guided_whitespace_pattern": (_OFF_NONE, "guided_whitespace_pattern (JSON is always "
                                             "compact)"),
    "structural_tag": (_OFF_NONE, "structural tags"),
    "tools": (_OFF_EMPTY, "tool calling"),
    "functions": (_OFF_EMPTY, "tool calling"),
    "tool_choice": ((None, "none"), "tool calling"),
    "function_call": ((None, "none"), "tool calling"),
    "documents": (_OFF_EMPTY, "documents (retrieval chat templates)"),
    "mm_processor_kwargs": (_OFF_EMPTY, "multimodal input"),
    "truncate_prompt_tokens": (_OFF_NONE, "truncate_prompt_tokens"),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids"),
    "return_token_ids": ((None, False), "return_token_ids"),
    "detokenize": ((None, True), "detokenize = false (output is always text)"),
    "skip_special_tokens": ((None, True), "skip_special_tokens = false (the verifier "
                                          "always skips special tokens)"),
    "spaces_between_special_tokens": ((None, True), "spaces_between_special_tokens = "
                                                    "false"),
    "add_special_tokens": ((None, True), "add_special_tokens = false (the verifier "
                                         "always tokenizes with special tokens)"),
    "logits_processors": (_OFF_EMPTY, "custom logits processors"),
    "vllm_xargs": (_OFF_EMPTY, "vllm_xargs"),
    "kv_transfer_params": (_OFF_EMPTY, "KV transfer (disaggregated prefill)"),
    "prompt_embeds": (_OFF_EMPTY, "prompt embeddings"),
    "reasoning_effort": (_OFF_NONE, "reasoning_effort (not a reasoning-model server)"),
    "audio": (_OFF_NONE, "audio output"),
    "modalities": ((None, ["text"]), "output modalities other than text"),
    "web_search_options": (_OFF_NONE, "web search"),
    "store": ((None, False), "store = true (completions are not stored)"),
    "service_tier": ((None, "auto", "default"), "service tiers other than auto/default"),
}

def check_extras(fields: dict[str, Any], refused: dict[str, tuple[tuple[Any, ...], str]]
                 ) -> None:
    """Every field the schema did not declare: accepted extra, refused at an "on" value
    (400 naming it), or unknown (400 naming it)."""
    for name, value in fields.items():
        if name in ACCEPTED_EXTRAS:
            continue
        if name in refused:
            off, what = refused[name]
            if not _is_off(value, off):
                raise unsupported(name, what)
            continue
        raise unknown(name)


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    # NOTE: `True in (1,)` is true in Python; a boolean only matches a boolean
    return any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off)


def unknown(name: str) -> APIError:
    name = name or '""'  # an empty key still gets a name the message can start with
    return invalid(name, "unknown parameter (see the gateway's documented parameters)",
                   "unknown_parameter")

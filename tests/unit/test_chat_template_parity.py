"""Chat prompts rendered by the gateway (`ChatTemplate.render`: the render pool's worker,
the model directory's template and special tokens) equal transformers'
`apply_chat_template` for templates in the styles of Llama-3.x, Qwen3, Mistral,
DeepSeek-V3 and GLM-4.5 (`chat_templates/`), on conversations with a system message,
tools, several turns, <think> blocks, continue_final_message and template variables.
Together the templates use every feature transformers' environment adds: loopcontrols
(`break`, `continue`), `strftime_now`, `tojson` with arguments, `{% generation %}`,
`namespace()` and `raise_exception`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from chainspec.gateway.chat_template import ChatTemplate, RenderLimits, Turn
from chainspec.gateway.errors import APIError

TEMPLATES = Path(__file__).parent / "chat_templates"
STYLES = ("llama3", "qwen3", "mistral", "deepseek_v3", "glm45")
SPECIALS = {"llama3": ("<|begin_of_text|>", "<|eot_id|>"), "qwen3": (None, "<|im_end|>"),
            "mistral": ("<s>", "</s>"), "deepseek_v3": ("<｜begin▁of▁sentence｜>",
                                                       "<｜end▁of▁sentence｜>"),
            "glm45": (None, "<|endoftext|>")}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Température actuelle d'une ville",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "ville, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]
SYSTEM = {"role": "system", "content": "You are terse. Réponds en français."}
USER = {"role": "user", "content": "What is the weather in Paris?  "}
ASSISTANT = {"role": "assistant", "content": "<think>\nThe user wants weather.\n</think>\n\n"
                                             "Il fait 21 °C."}
# name -> (messages, variables, add_generation_prompt, continue_final_message)
CASES = {
    "system_user": ([SYSTEM, USER], {}, True, False),
    "multi_turn": ([SYSTEM, USER, ASSISTANT, {"role": "user", "content": "And tomorrow?"}],
                   {}, True, False),
    "tools": ([SYSTEM, USER], {"tools": TOOLS}, True, False),
    "tools_multi_turn": ([USER, ASSISTANT, {"role": "user", "content": "Merci"}],
                         {"tools": TOOLS, "enable_thinking": False}, True, False),
    "no_generation_prompt": ([USER, ASSISTANT], {}, False, False),
    "thinking_off": ([USER], {"enable_thinking": False}, True, False),
    "continue_final": ([USER, {"role": "assistant", "content": "Il fait"}], {}, False, True),
    "variables": ([USER], {"date_string": "01 Jan 2025", "tools_in_user_message": False,
                           "tools": TOOLS}, True, False),
}


def _model_dir(root: Path, style: str) -> Path:
    """A tokenizer directory as transformers saves one, with this style's template."""
    from transformers import PreTrainedTokenizerFast
    bos, eos = SPECIALS[style]
    backend = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos,
                                 unk_token="[UNK]")
    hf.chat_template = (TEMPLATES / f"{style}.jinja").read_text()
    out = root / style
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """style -> (the gateway's ChatTemplate, transformers' tokenizer), same directory."""
    from transformers import AutoTokenizer
    root, out = tmp_path_factory.mktemp("templates"), {}
    for style in STYLES:
        d = _model_dir(root, style)
        out[style] = (ChatTemplate.from_model_dir(d, limits=RenderLimits(workers=1)),
                      AutoTokenizer.from_pretrained(d))
    yield out
    for chat, _ in out.values():
        chat.close()


def _gateway(chat: ChatTemplate, messages, variables, generation, cont) -> str:
    turns = [Turn(m["role"], m["content"]) for m in messages]
    return asyncio.run(chat.render(turns, generation, cont, dict(variables)))


def _transformers(hf, messages, variables, generation, cont) -> str:
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation,
                                  continue_final_message=cont, **variables)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("style", STYLES)
def test_prompt_equals_apply_chat_template(pairs, style, case) -> None:
    chat, hf = pairs[style]
    messages, variables, generation, cont = CASES[case]
    if style == "mistral" and messages[0]["role"] == "assistant":
        pytest.fail("case list: Mistral needs user first")  # NOTE: keeps CASES honest
    want = _transformers(hf, messages, variables, generation, cont)
    assert _gateway(chat, messages, variables, generation, cont) == want


def test_the_cases_reach_what_the_templates_branch_on(pairs) -> None:
    """Not vacuous: tools, dates, thinking and special tokens show in the prompts."""
    chat, hf = pairs["llama3"]
    tools = _gateway(chat, *CASES["tools"])
    assert '"name": "get_weather"' in tools and '\n    "type": "function"' in tools  # indent
    assert "Today Date: " in tools and tools.startswith("<|begin_of_text|>")
    assert "Today Date: 01 Jan 2025" in _gateway(chat, *CASES["variables"])
    qwen = _gateway(pairs["qwen3"][0], *CASES["multi_turn"])
    assert "<think>" not in qwen.split("And tomorrow?")[0]  # earlier reasoning dropped
    assert _gateway(pairs["qwen3"][0], *CASES["thinking_off"]).endswith(
        "<think>\n\n</think>\n\n")
    deepseek = _gateway(pairs["deepseek_v3"][0], *CASES["tools"])
    assert 'Parameters: {"properties":{"city"' in deepseek  # separators, sort_keys
    glm = _gateway(pairs["glm45"][0], *CASES["multi_turn"])
    assert "\nIl fait 21 °C." in glm and "Température" in _gateway(
        pairs["glm45"][0], *CASES["tools"])  # {% generation %} body; ensure_ascii=False
    assert _gateway(pairs["mistral"][0], *CASES["continue_final"]).endswith("Il fait")


def test_the_set_uses_every_feature_of_the_environment() -> None:
    sources = "".join((TEMPLATES / f"{s}.jinja").read_text() for s in STYLES)
    for feature in ("{%- break %}", "{%- continue %}", "strftime_now(", "tojson(indent=",
                    "tojson(separators=", "tojson(ensure_ascii=", "{% generation %}",
                    "namespace(", "raise_exception("):
        assert feature in sources, feature


def test_raise_exception_is_a_400_with_the_template_message(pairs) -> None:
    """Mistral's role alternation: transformers raises, the gateway answers 400."""
    import jinja2
    chat, hf = pairs["mistral"]
    messages = [USER, {"role": "user", "content": "again"}]
    with pytest.raises(jinja2.TemplateError) as hf_error:
        _transformers(hf, messages, {}, True, False)
    with pytest.raises(APIError) as e:
        _gateway(chat, messages, {}, True, False)
    assert e.value.status == 400 and e.value.param == "messages"
    assert str(hf_error.value) in e.value.message  # "Conversation roles must alternate..."


def test_strftime_now_is_today(pairs) -> None:
    import datetime
    chat, _ = pairs["llama3"]
    prompt = _gateway(chat, *CASES["system_user"])
    assert f"Today Date: {datetime.datetime.now():%d %b %Y}\n" in prompt

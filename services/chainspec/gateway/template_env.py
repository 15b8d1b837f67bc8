"""The Jinja environment chat templates render in, and the render job a worker runs.

It is transformers' `apply_chat_template` environment (`chat_template_utils.
_compile_jinja_template`, mirrored rather than imported: that function is private and
transformers is no runtime dependency): `ImmutableSandboxedEnvironment` with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension (`break`, `continue`),
the `{% generation %}` block (renders its body; the assistant-mask tracking is a training
feature), `raise_exception`, `strftime_now`, `tojson` with `ensure_ascii`, `indent`,
`separators` and `sort_keys`, and its guarded `dict` and `namespace`. So a Hub template
renders here as in transformers, and `tests/unit/test_chat_template_parity.py` checks it.

On top, bounds that transformers lacks (the gateway renders for untrusted clients): `*`
and `+` refuse to build a string or list over `max_chars`, `**` an integer over 64 Kibit,
and the text is counted as it is produced (`render_job`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


def render_job(job: tuple[str, dict[str, Any], int]) -> str:
    """(template source, variables, max_chars) -> the text; runs in a render worker."""
    source, context, max_chars = job
    return _joined(compiled(source, max_chars).generate(**context), max_chars)


@functools.lru_cache(maxsize=16)
def compiled(source: str, max_chars: int) -> jinja2.Template:
    return compile_template(source, max_chars)


def compile_template(source: str, max_chars: int) -> jinja2.Template:
    """The template in transformers' environment, bounded; TemplateSyntaxError if broken."""
    env = _BoundedEnvironment(max_chars, trim_blocks=True, lstrip_blocks=True,
                              extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def _joined(chunks: Iterator[str], max_chars: int) -> str:
    out, size = [], 0
    for chunk in chunks:
        size += len(chunk)
        if size > max_chars:
            raise TooLarge(f"its text passed the limit of {max_chars:,} characters")
        out.append(chunk)
    return "".join(out)


class TooLarge(jinja2.TemplateRuntimeError):
    pass


# -- what transformers' environment adds ---------------------------------------------------
def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # NOTE: not Jinja's own tojson, which escapes HTML characters
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)`, without the type itself (no attribute walk)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` refusing underscore-prefixed attributes (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # NOTE: Jinja's `self`-free signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set an underscore-prefixed attribute on a "
                f"namespace ({name!r})")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the body, as rendered."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body
                                      ).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


# -- bounds --------------------------------------------------------------------------------
class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with `*` and `+` refusing to build a string or list over max_chars
    and `**` refusing integers over 64 Kibit (each would otherwise run long in one C call
    before any limit could look). `range` is the sandbox's own (100,000 at most)."""

    intercepted_binops = frozenset({"*", "+", "**"})

    def __init__(self, max_chars: int, **options: Any) -> None:
        super().__init__(**options)
        self.max_chars = max_chars

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        if op == "**":
            _check_power(left, right)
        else:
            size = _result_size(op, left, right)
            if size > self.max_chars:
                raise TooLarge(f"{op!r} would build {size:,} items, over the limit of "
                               f"{self.max_chars:,}")
        return self.binop_table[op](left, right)


_SEQUENCES = (str, list, tuple)


def _result_size(op: str, left: Any, right: Any) -> int:
    if op == "+":
        both = isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES)
        return len(left) + len(right) if both else 0
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, _SEQUENCES) and isinstance(times, int):
            return len(seq) * max(times, 0)
    return 0


def _check_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 \
            and exponent * max(abs(base).bit_length() - 1, 1) > 65536:
        raise TooLarge("'**' would build an integer over 64 Kibit")

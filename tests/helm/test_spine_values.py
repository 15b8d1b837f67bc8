"""The chart's stack values follow the config spine: each value that sets a spine option
has the option's type, bounds, choices and default in values.schema.json/values.yaml; a
bad value is one error naming it; and every vLLM flag resolves through the chart to the
config it resolves to through `chainspec up` (and `serve`), as does its chainspec alias."""

from __future__ import annotations

import json
import typing

import pytest
import yaml

from chainspec.cli import build_parser
from chainspec.commands.stack_args import stack_config as up_config
from chainspec.spine.sections import (
    AutoscaleSection,
    StackSection,
    chart_value,
    default,
    inverted,
)
from tests.helm.render import EXAMPLES, HelmError, of_kind, stack_config, template
from tests.tools import CHART

_SCHEMA = json.loads((CHART / "values.schema.json").read_text())
_VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA, VALUES = _SCHEMA["properties"]["stack"], _VALUES["stack"]
CHARTED = {chart_value(StackSection, k): k for k in StackSection.model_fields
           if chart_value(StackSection, k)}
# drafter.autoscale: the policy's values (enabled and the bounds are the group's)
AUTOSCALE_SCHEMA = _SCHEMA["definitions"]["drafterAutoscale"]["properties"]
AUTOSCALE_VALUES = _VALUES["drafter"]["autoscale"]
AUTOSCALED = {chart_value(AutoscaleSection, k): k for k in AutoscaleSection.model_fields
              if chart_value(AutoscaleSection, k)}
# chart defaults that differ from the spine's, and why
CHART_OWN = {"startTimeoutSeconds": 600}  # an autoscaled drafter waits for a new pod
JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}
PARSER, _ = build_parser()


def _types(annotation) -> tuple[list[str], list | None]:
    """(JSON types, enum) of a spine annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return ["string"], list(args)
    if args:  # X | None
        (inner,) = [a for a in args if a is not type(None)]
        types, enum = _types(inner)
        return [*types, "null"], enum
    return [JSON_TYPES[annotation]], None


def test_every_stack_value_is_a_spine_option_and_each_is_in_the_schema() -> None:
    assert set(SCHEMA["properties"]) == set(CHARTED)
    assert SCHEMA["additionalProperties"] is False


def test_every_autoscale_value_is_a_policy_option() -> None:
    assert set(AUTOSCALE_SCHEMA) - {"enabled"} == set(AUTOSCALED)


CASES = [(StackSection, CHARTED, SCHEMA["properties"], VALUES, v) for v in sorted(CHARTED)] + [
    (AutoscaleSection, AUTOSCALED, AUTOSCALE_SCHEMA, AUTOSCALE_VALUES, v)
    for v in sorted(AUTOSCALED)]


@pytest.mark.parametrize("section,charted,schema,values,value", CASES,
                         ids=[c[-1] for c in CASES])
def test_a_values_type_bounds_and_default_are_its_options(section, charted, schema, values,
                                                          value) -> None:
    key = charted[value]
    info, prop = section.model_fields[key], schema[value]
    types, enum = _types(info.annotation)
    assert sorted(prop["type"] if isinstance(prop["type"], list) else [prop["type"]]) == \
        sorted(types), value
    assert prop.get("enum") == enum, value
    bounds = {b: getattr(m, b) for m in info.metadata for b in ("ge", "gt", "le")
              if hasattr(m, b)}
    assert (prop.get("minimum"), prop.get("exclusiveMinimum"), prop.get("maximum")) == (
        bounds.get("ge"), bounds.get("gt"), bounds.get("le")), value
    want = default(section, key)
    want = (not want) if inverted(section, key) else want
    assert values[value] == CHART_OWN.get(value, want), value


@pytest.mark.parametrize("args,named", [
    (("--set-string", "stack.maxLen=4096"), "stack.maxLen: Invalid type. Expected: integer"),
    (("--set-string", "stack.chain=false"), "stack.chain: Invalid type. Expected: boolean"),
    (("--set", "stack.maxSeqz=8"), "Additional property maxSeqz is not allowed"),
    (("--set", "stack.maxSeqs=0"), "stack.maxSeqs: Must be greater than or equal to 1"),
    (("--set-json", "stack.gpuMemoryUtilization=1.5"), "stack.gpuMemoryUtilization: Must be "
                                                        "less than or equal to 1"),
    (("--set", "stack.speculativeDepth=deep"), "stack.speculativeDepth: stack.speculativeDepth "
                                               "must be one of the following"),
])
def test_a_bad_value_is_one_error_naming_it(args, named) -> None:
    with pytest.raises(HelmError) as e:
        template(*args)
    assert named in str(e.value)


def _rendered_file(tmp_path, *base: str):
    cm = next(d for d in of_kind(template(*base), "ConfigMap")
              if d["metadata"]["name"].endswith("-stack"))
    path = tmp_path / "stack.yaml"
    path.write_text(cm["data"]["stack.yaml"])
    return path


GPU = ("-f", str(EXAMPLES / "gpu-1verifier-2drafters.yaml"))
# (chainspec flags, the same through vLLM's names, the chart's values, the chart base)
FLAGS = [
    (["--max-len", "512"], ["--max-model-len", "512"], ["--set", "stack.maxLen=512"], ()),
    (["--max-seqs", "5"], ["--max-num-seqs", "5"], ["--set", "stack.maxSeqs=5"], ()),
    (["--kv-block-size", "8"], ["--block-size", "8"], ["--set", "stack.kvBlockSize=8"], ()),
    (["--eager"], ["--enforce-eager"], ["--set", "stack.cudaGraphs=false"], ()),
    (["--kv-cache-memory", "1048576"], ["--kv-cache-memory-bytes", "1048576"],
     ["--set", "stack.kvCacheMemoryBytes=1048576"], ()),
    (["-k", "2", "--speculative-depth", "adaptive", "--no-chain"],
     ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2, '
                              '"depth": "adaptive", "chain": false}'],
     ["--set", "stack.numSpeculativeTokens=2", "--set", "stack.speculativeDepth=adaptive",
      "--set", "stack.chain=false"], ()),
    (["--seed", "7"], ["--seed", "7"], ["--set", "stack.seed=7"], ()),
    (["--dtype", "bfloat16"], ["--dtype", "bfloat16"], ["--set", "stack.dtype=bfloat16"], ()),
    (["--no-enable-prefix-caching"], ["--no-enable-prefix-caching"],
     ["--set", "stack.enablePrefixCaching=false"], ()),
    (["--gpu-memory-utilization", "0.85"], ["--gpu-memory-utilization", "0.85"],
     ["--set-json", "stack.gpuMemoryUtilization=0.85"], GPU),
]


@pytest.mark.parametrize("alias,vllm,values,base", FLAGS, ids=lambda v: " ".join(v)[:40])
def test_a_flag_its_alias_and_its_chart_value_make_one_config(tmp_path, alias, vllm, values,
                                                              base) -> None:
    """Over the chart's own rendered file (what its `chainspec up` reads): `up` with the
    alias, `up` with vLLM's name and the chart rendered with the value give one
    StackConfig, which the flag changed. (serve resolves as up does: test_stack_flags.)"""
    path = str(_rendered_file(tmp_path, *base))
    configs = [up_config(PARSER.parse_args(["up", "--config", path, *argv]))
               for argv in (alias, vllm)]
    charted = stack_config(template(*base, *values))
    assert all(c == charted for c in configs), (configs[0], charted)
    assert charted != stack_config(template(*base))


# the gateway's chart values -> the flags serve takes for the same gateway keys
GATEWAY = [
    (["--set", "gateway.maxLogprobs=5"], ["--max-logprobs", "5"]),
    (["--set", "gateway.generationConfig=vllm"], ["--generation-config", "vllm"]),
    (["--set", "model.name=m1"], ["--served-model-name", "m1"]),
    (["--set", "model.name=m1"], ["--model-name", "m1"]),
    (["--set", "gateway.maxN=3"], ["--max-n", "3"]),
    (["--set", "gateway.trustRequestChatTemplate=true"], ["--trust-request-chat-template"]),
]


@pytest.mark.parametrize("values,flags", GATEWAY, ids=lambda v: " ".join(v))
def test_a_gateway_value_makes_the_gateway_config_its_flag_makes(values, flags) -> None:
    """The chart's gateway command, as parsed, equals `serve <flags>`'s gateway (but for
    where it listens), and the value changed it."""
    from chainspec.commands import gateway as gateway_command
    from chainspec.commands import serve
    from tests.helm.commands import invocations

    def charted(*args: str):
        [deploy] = of_kind(template(*args), "Deployment")
        [run] = [i for i in invocations(deploy["spec"]["template"]["spec"]["containers"][0])
                 if i.command == "gateway"]
        return gateway_command.resolve(PARSER.parse_args(list(run.argv)))

    got = charted(*values)
    want = serve.resolve(PARSER.parse_args(["serve", "--host", got.host, "--port",
                                            str(got.port), *flags])).gateway
    assert got == want
    assert got != charted()

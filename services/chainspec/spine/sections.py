"""Every engine, stack and gateway option, declared once: its config-file key (the flag's
name, as in vLLM: `max_model_len` is `--max-model-len`), type, default, bounds and help.

One frozen, strict pydantic model per section (a stack, its drafter and verifier roles,
the drafter autoscale policy, `speculative_config`, the gateway, `serve`'s extras).
Strict means a YAML `max_model_len: "4096"` or a quoted `chain: "false"` is refused,
never coerced; unknown keys are refused too (`read.py` turns either into one line naming
the key and where it came from).

An option whose runtime field (`StackConfig`, `LocalOptions`, `GatewayConfig`: the
objects the engines, Ray actors and gateway take) has another name says so with
`field=`; that old name stays accepted in files with a deprecation warning. `chart=` names
the chart value (`helm/chainspec/values.yaml`) that sets it. Adding an option: a line
here, its flag row (`commands/stack_flags.py`), its chart value (values.yaml and the
schema), and the runtime field that carries it (one line reading its default here;
`tests/unit/test_config_spine.py` fails until it exists), then the code that uses it.

NOTE: light on purpose (pydantic only): `chainspec --help` builds every parser from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DEMO_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo"
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")  # auto: checkpoint's (GPU), fp32 CPU
SPECULATIVE_DEPTHS = ("fixed", "adaptive")
SCHEDULING_POLICIES = ("fcfs", "priority")
DRAFTER_MODES = ("remote", "local")


def option(default: Any, help: str, *, field: str | None = None, old: str | None = None,
           chart: str | None = None, invert: bool = False, **bounds: Any) -> Any:
    """One option: its default, help and bounds; `field`: the runtime field, when named
    otherwise (`invert`: that field is the negation, enforce_eager -> use_graphs); `old`:
    the key files used before (default: `field`), accepted with a warning; `chart`: the
    chart value that sets it."""
    extra = {k: v for k, v in (("field", field), ("old", old), ("chart", chart),
                               ("invert", invert)) if v}
    return Field(default, description=help, json_schema_extra=extra or None, **bounds)


class Section(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class RoleSection(Section):
    """How many actors of one role, and what each asks Ray for (`cluster/config.py`)."""

    replicas: int = option(1, "actors of the role", ge=0)
    num_gpus: float = option(0.0, "GPUs per actor (> 0: its model runs on cuda)", ge=0)
    num_cpus: float = option(0.0, "CPUs per actor", ge=0)
    max_restarts: int = option(-1, "Ray restarts of a crashed actor (-1: forever)", ge=-1)
    resource: str = option("", "custom Ray resource ('' -> chainspec_<role>)")
    resource_amount: float = option(0.001, "amount of it each actor asks for", gt=0)
    port: int = option(0, "gRPC port of each actor (0: any free port)", ge=0, le=65535)
    metrics_port: int | None = option(0, "Prometheus port of each actor (null: off)",
                                      ge=0, le=65535)
    tensor_parallel_size: int = option(1, "ranks of one member (tensor parallel)", ge=1)
    collective_timeout_s: float = option(60.0, "a TP step with a lost peer fails after "
                                               "this", gt=0)


class AutoscaleSection(Section):
    """How the controller scales drafters (`cluster/autoscale.py`, `drafter.autoscale`;
    chart values under `drafter.autoscale`, the bounds from the group's min/maxReplicas)."""

    min_drafters: int = option(1, "fewest drafters", ge=0)
    max_drafters: int = option(4, "most drafters", ge=1)
    target_occupancy: float = option(0.75, "running sequences per drafter / "
                                     "drafter_max_num_seqs to aim at", gt=0, le=1,
                                     chart="targetOccupancy")
    draft_wait_high_s: float = option(0.02, "mean draft wait per round above this: one "
                                      "more drafter", ge=0, chart="draftWaitHighSeconds")
    draft_wait_low_s: float = option(0.005, "scale in only with the wait under this (or "
                                     "no rounds)", ge=0, chart="draftWaitLowSeconds")
    up_window_s: float = option(5.0, "every recommendation this long above now: scale "
                                "out", ge=0, chart="upWindowSeconds")
    down_window_s: float = option(60.0, "every recommendation this long below now: scale "
                                  "in", ge=0, chart="downWindowSeconds")
    cooldown_s: float = option(10.0, "no decision this soon after the last one", ge=0,
                               chart="cooldownSeconds")
    interval_s: float = option(1.0, "between samples of the signals", gt=0,
                               chart="intervalSeconds")


class DrafterRoleSection(RoleSection):
    replicas: int | None = option(None, "drafter actors (null: 1 remote, 0 local)", ge=0)
    mode: Literal[DRAFTER_MODES] = option("remote", "remote: drafter actors over gRPC; "
                                          "local: each verifier drafts in process")
    autoscale: AutoscaleSection | None = option(
        None, "drafter autoscaling policy; remote mode only")


class SpeculativeSection(Section):
    """vLLM's `--speculative-config` JSON: `method` (mtp only: chainspec drafts with the
    checkpoint's MTP modules) and `num_speculative_tokens`, plus chainspec's own keys.
    Unset keys leave the flat options' values."""

    method: str = option("mtp", "speculative method (only mtp)")
    num_speculative_tokens: int | None = option(None, "draft tokens per round", ge=1)
    chain: bool | None = option(None, "MTP steps chain (DeepSeek) or read the target")
    depth: Literal[SPECULATIVE_DEPTHS] | None = option(None, "fixed or adaptive depth")
    draft_top_k: int | None = option(None, "support of sampled drafts", ge=1)


class StackSection(Section):
    """A Ray-hosted stack (`chainspec up --config`; `serve`'s top level)."""

    model: str = option(str(DEMO_MODEL), "model directory (default: the bundled demo "
                        "model)", field="model_dir")
    revision: str | None = option(None, "branch, tag or commit of a Hub model id given as "
                                  "the model (default: main)", min_length=1)
    download_dir: str | None = option(None, "Hugging Face cache to read and download Hub "
                                      "models into (default: HF_HUB_CACHE, "
                                      "~/.cache/huggingface/hub)", min_length=1)
    num_speculative_tokens: int = option(3, "draft tokens per round (K)", ge=1,
                                         field="num_steps", chart="numSpeculativeTokens")
    chain: bool = option(True, "each MTP step reads the previous one's output (chain); "
                         "--no-chain: every step reads the target hidden state",
                         chart="chain")
    max_num_seqs: int = option(8, "running sequences per verifier", ge=1,
                               field="max_seqs", chart="maxSeqs")
    drafter_max_num_seqs: int = option(64, "sequences per drafter (it serves every "
                                       "verifier)", ge=1, field="drafter_max_seqs",
                                       chart="drafterMaxSeqs")
    max_model_len: int = option(1024, "context length of one sequence", ge=4,
                                field="max_len", chart="maxLen")
    dtype: Literal[DTYPE_NAMES] = option("auto", "weights and activations (auto: the "
                                         "checkpoint's on GPU, float32 on CPU)",
                                         chart="dtype")
    kv_cache_memory_bytes: int | None = option(
        None, "each verifier's paged KV cache in bytes (default: what its slots need)",
        ge=1, field="kv_cache_memory", chart="kvCacheMemoryBytes")
    kv_cache_fraction: float | None = option(
        None, "paged KV cache as a share of free device memory (CUDA; default: off)",
        gt=0, le=1, chart="kvCacheFraction")
    gpu_memory_utilization: float | None = option(
        None, "share of the device's TOTAL memory the whole member may use, KV cache "
        "included (vLLM's meaning; GPU members only; default: off)", gt=0, le=1,
        chart="gpuMemoryUtilization")
    block_size: int = option(16, "positions per KV block", ge=1, field="kv_block_size",
                             chart="kvBlockSize")
    draft_top_k: int = option(8, "support of sampled draft distributions", ge=1,
                              chart="draftTopK")
    enforce_eager: bool = option(False, "no CUDA graphs (default: graphs on a GPU)",
                                 field="use_graphs", invert=True, chart="cudaGraphs")
    speculative_depth: Literal[SPECULATIVE_DEPTHS] = option(
        "fixed", "drafts verified per round: fixed (K every round) or adaptive (k in "
        "0..K per sequence each step; DESIGN 4.11)", chart="speculativeDepth")
    enable_prefix_caching: bool = option(True, "verifiers share the KV blocks of equal "
                                         "prompt prefixes (vLLM's prefix caching)",
                                         chart="enablePrefixCaching")
    state_snapshots: int | None = option(
        None, "recurrent states a hybrid (Gated DeltaNet) verifier keeps at block ends for "
        "prefix caching, paid out of its KV cache budget when one is set (default: "
        "max_num_seqs x (K+1), as many as its running states; 0: hybrid models cache no "
        "prefixes; attention-only models keep none)", ge=0)
    seed: int | None = option(None, "seeds the seeds each verifier gives requests that set "
                              "none, so a run repeats (vLLM's --seed; default: none, fresh "
                              "randomness)", ge=0, chart="seed")
    drafter: DrafterRoleSection = Field(default_factory=DrafterRoleSection)
    verifier: RoleSection = Field(default_factory=RoleSection)
    grpc_host: str = option("127.0.0.1", "gRPC bind address of the services; 0.0.0.0 "
                            "advertises the node's IP", field="host", min_length=1)
    namespace: str = option("chainspec", "Ray namespace of the stack", min_length=1,
                            chart="rayNamespace")
    auth_token: str | None = option(None, "shared service-to-service token")
    tls_ca: str | None = option(None, "mTLS: CA of both ends")
    tls_server_cert: str | None = option(None, "mTLS: servers' certificate")
    tls_server_key: str | None = option(None, "mTLS: servers' key")
    tls_client_cert: str | None = option(None, "mTLS: clients' certificate")
    tls_client_key: str | None = option(None, "mTLS: clients' key")
    tls_server_name: str | None = option(None, "name clients check server certificates "
                                         "against")
    health_interval_s: float = option(1.0, "seconds between health pings", gt=0,
                                      chart="healthIntervalSeconds")
    health_timeout_s: float = option(5.0, "a member silent to a ping this long is dead",
                                     gt=0, chart="healthTimeoutSeconds")
    start_timeout_s: float = option(300.0, "a starting member silent this long is dead",
                                    gt=0, chart="startTimeoutSeconds")
    drain_timeout_s: float = option(30.0, "longest drain of a member, seconds", gt=0,
                                    chart="drainTimeoutSeconds")
    draft_deadline_s: float = option(0.05, "seconds a round waits for drafts", gt=0,
                                     chart="draftDeadlineSeconds")
    max_waiting: int = option(64, "queued requests per verifier beyond its running slots "
                              "(then RESOURCE_EXHAUSTED)", ge=0, chart="maxWaiting")
    pipeline_groups: int = option(1, "verifier groups taking turns so drafts overlap "
                                  "verification (1: off)", ge=1, chart="pipelineGroups")
    draft_ahead: bool = option(False, "verifiers use drafters' look-ahead drafts on a hit",
                               chart="draftAhead")
    scheduling_policy: Literal[SCHEDULING_POLICIES] = option(
        "fcfs", "verifiers' admission order: fcfs (a request's priority must be 0) or "
        "priority (lower `priority` first, as in vLLM)")
    controller_metrics_port: int | None = option(0, "the controller's /metrics port "
                                                 "(null: off)", ge=0, le=65535)
    speculative_config: SpeculativeSection | None = option(
        None, "vLLM's speculative config: {method: mtp, num_speculative_tokens: K, "
        "chain, depth, draft_top_k} (default: none; the keys it names set those options)")


class GatewaySection(Section):
    """The HTTP side (`gateway/config.py`): `serve`'s `gateway:` section."""

    host: str = option("127.0.0.1", "HTTP address to listen on", min_length=1)
    port: int = option(8000, "HTTP port (0: any free port)", ge=0, le=65535)
    api_key: str | None = option(None, "require `Authorization: Bearer <key>` on /v1",
                                 min_length=1, pattern=r"\S")
    served_model_name: list[str] = option(
        [], "names clients send as `model`, each listed in /v1/models (default: the "
        "name the verifiers report)", old="model_name")
    max_in_flight: int = option(256, "requests in flight, then 429", ge=1)
    retry_after_s: int = option(1, "Retry-After of 429 and 503 answers", ge=0)
    request_timeout_s: float = option(600.0, "deadline of one request", gt=0)
    refresh_interval_s: float = option(1.0, "how often verifiers are polled", gt=0)
    max_body_bytes: int = option(8 * 2 ** 20, "larger request bodies are 413", ge=1024)
    max_n: int = option(16, "most choices (n) per request; more is a 400", ge=1, le=256)
    trust_request_chat_template: bool = option(
        False, "honour a request's own chat_template (default: refused with a 400; every "
        "template runs sandboxed, time- and size-limited)", chart="trustRequestChatTemplate")
    generation_config: str = option(
        "auto", "sampling defaults of requests that set none: auto (the model's "
        "generation_config.json, as in vLLM), vllm (none: OpenAI's), or a directory's",
        min_length=1)
    max_logprobs: int = option(20, "most logprobs (top_logprobs) a request may ask for",
                               ge=0, le=20)
    chat_template: str | None = option(
        None, "the chat template (a file, or the template itself) instead of the model's "
        "(default: the model's own)", min_length=1)


class ServeSection(StackSection):
    """`chainspec serve --config`: the stack's keys, where Ray is, the gateway."""

    # NOTE: start_timeout_s here is serve's wait for the whole stack (the stack keeps its
    # default: serving/config.py)
    address: str | None = option(None, "Ray cluster to join (null: an embedded local Ray)",
                                 min_length=1, pattern=r"\S")
    gateway: GatewaySection = Field(default_factory=GatewaySection)


def default(section: type[Section], key: str) -> Any:
    """The one default of `key` in `section` (runtime dataclasses read theirs here)."""
    info = section.model_fields[key]
    return info.get_default(call_default_factory=True)


def runtime_name(section: type[Section], key: str) -> str:
    """The runtime field `key` sets."""
    extra = section.model_fields[key].json_schema_extra or {}
    return extra.get("field", key)


def renames(section: type[Section]) -> dict[str, str]:
    """Old name -> key, for every option that had another name in files (by default its
    runtime field's)."""
    out = {}
    for key, info in section.model_fields.items():
        old = (info.json_schema_extra or {}).get("old", runtime_name(section, key))
        if old != key:
            out[old] = key
    return out


def chart_value(section: type[Section], key: str) -> str | None:
    """The chart value (under `stack.`) that sets `key`, if the chart has one."""
    return (section.model_fields[key].json_schema_extra or {}).get("chart")


def inverted(section: type[Section], key: str) -> bool:
    return bool((section.model_fields[key].json_schema_extra or {}).get("invert"))

"""Draft stream messages to and from the dataclasses of `engine.draft_types`.

The verifier encodes `UpdateBatch` and decodes `DraftReply`; the drafter does the reverse.
Both decoders validate per sequence: a bad entry becomes a `SeqFailure` for that
sequence (INVALID_ARGUMENT, the message names the field) and the rest of the batch goes
on, so one bad sequence never takes the stream down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from chainspec.engine.draft_types import (
    GREEDY,
    DraftAhead,
    DraftReply,
    DraftResult,
    DraftSampling,
    ErrorCode,
    SeqFailure,
    SeqOutcome,
    SeqUpdate,
    UpdateBatch,
)
from chainspec.rpc.codec import (
    FLOAT_DTYPES,
    WireDType,
    WireError,
    check_tokens,
    decode_array,
    decode_tensor,
    encode_rows,
    encode_tensor,
    invalid,
    packed_rows,
    tensor_header,
    to_tensors,
)
from chainspec.rpc.generated.v1 import drafter_pb2 as pb

# The Drafter service's full name (health checks, reflection, server registration).
DRAFTER_SERVICE = pb.DESCRIPTOR.services_by_name["Drafter"].full_name
# Tolerance on the row sums of a sampled draft distribution.
PROB_SUM_TOL = 1e-3
# Draft stream metadata: how many sequences the verifier will hold on the stream.
MAX_SEQS_KEY = "x-chainspec-max-seqs"


def stream_metadata(max_seqs: int) -> tuple[tuple[str, str], ...]:
    """Metadata of a Draft stream whose verifier holds at most `max_seqs` sequences."""
    if max_seqs < 1:
        raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
    return ((MAX_SEQS_KEY, str(max_seqs)),)


@dataclass(frozen=True)
class DraftLimits:
    """What a peer's messages must fit: the model's shape and the drafter's bounds."""

    hidden_size: int
    vocab_size: int
    num_draft_tokens: int  # K
    max_rows: int | None = None  # rows of one update's hidden
    max_top_k: int | None = None  # k of sampled drafts

    def __post_init__(self) -> None:
        if min(self.hidden_size, self.vocab_size, self.num_draft_tokens) < 1:
            raise ValueError(f"draft limits need positive sizes, got {self}")


def _failure(seq_id: int, err: WireError) -> SeqFailure:
    return SeqFailure(seq_id, ErrorCode(err.code.name), err.message)


# ------------------------------------------------------------------- verifier -> drafter


def _fill_update(out: pb.SequenceUpdate, u: SeqUpdate) -> None:
    """Everything of `u` but its hidden rows."""
    out.seq_id, out.start, out.want_drafts = u.seq_id, u.start, u.want_drafts
    out.tokens.extend(u.tokens)
    if u.want_drafts and not u.sampling.greedy:
        out.sampling.temperature, out.sampling.top_k = u.sampling.temperature, u.sampling.top_k
        if u.sampling.seed is not None:
            out.sampling.seed = u.sampling.seed
    if u.want_drafts and u.look_ahead:
        out.look_ahead = True
        out.verifying.extend(u.verifying)
    if u.want_drafts and u.num_drafts:
        out.num_drafts = u.num_drafts
    for end, key in u.cache_keys:
        out.cache_key_ends.append(end)
        out.cache_keys.append(key)


def encode_update(u: SeqUpdate, hidden_dtype: WireDType | str = WireDType.F32) -> pb.SequenceUpdate:
    msg = pb.SequenceUpdate()
    _fill_update(msg, u)
    encode_tensor(u.hidden, hidden_dtype, out=msg.hidden)
    return msg


def _packed_hidden(updates: tuple[SeqUpdate, ...]) -> torch.Tensor:
    """All updates' hidden rows, [sum(n), H], on their device (the host if mixed)."""
    if len(updates) == 1:
        return updates[0].hidden
    hidden = [u.hidden for u in updates]
    if any(h.device != hidden[0].device for h in hidden):
        hidden = [h.cpu() for h in hidden]
    return torch.cat(hidden)


def encode_draft_request(batch: UpdateBatch,
                         hidden_dtype: WireDType | str = WireDType.F32) -> pb.DraftRequest:
    """One conversion (or quantization) and one device-to-host copy for the whole batch."""
    msg = pb.DraftRequest(batch_id=batch.batch_id, releases=batch.releases)
    if not batch.updates:
        return msg
    rows = encode_rows(_packed_hidden(batch.updates), hidden_dtype)
    outs = []
    for u in batch.updates:
        out = msg.updates.add()
        _fill_update(out, u)
        outs.append(out.hidden)
    rows.fill_blocks(outs, [len(u.tokens) for u in batch.updates])
    return msg


def decode_sampling(msg: pb.DraftSampling, limits: DraftLimits, name: str) -> DraftSampling:
    t, k = msg.temperature, msg.top_k
    if not (math.isfinite(t) and t >= 0):
        raise invalid(f"{name}.temperature: must be finite and >= 0, got {t}")
    if t == 0:
        return DraftSampling()
    max_k = limits.max_top_k if limits.max_top_k is not None else limits.vocab_size
    if not 1 <= k <= max_k:
        raise invalid(f"{name}.top_k: sampled drafts need 1 <= top_k <= {max_k}, got {k}")
    seed = msg.seed if msg.HasField("seed") else None
    return DraftSampling(temperature=t, top_k=k, seed=seed)


def _check_update(msg: pb.SequenceUpdate, limits: DraftLimits, name: str
                  ) -> tuple[tuple[int, ...], WireDType, bytes, DraftSampling, dict]:
    """Everything of one update but its elements: (tokens, hidden's wire dtype and
    bytes, sampling, look-ahead fields). Raises WireError(INVALID_ARGUMENT) naming the
    field."""
    tokens = check_tokens(msg.tokens, limits.vocab_size, name=f"{name}.tokens", min_count=1)
    if not msg.HasField("hidden"):
        raise invalid(f"{name}.hidden: missing; {len(tokens)} token(s) need {len(tokens)} rows")
    wire, shape, data = tensor_header(msg.hidden, name=f"{name}.hidden",
                                      expect_cols=limits.hidden_size,
                                      max_rows=limits.max_rows, allowed=FLOAT_DTYPES)
    if shape[0] != len(tokens):
        raise invalid(f"{name}: {len(tokens)} tokens but {shape[0]} hidden rows; "
                      f"they must match")
    sampling = GREEDY
    if msg.want_drafts and msg.HasField("sampling"):
        sampling = decode_sampling(msg.sampling, limits, f"{name}.sampling")
    if msg.want_drafts and msg.num_drafts > limits.num_draft_tokens:
        raise invalid(f"{name}.num_drafts: {msg.num_drafts}; at most K = "
                      f"{limits.num_draft_tokens} (0: K)")
    depth = {"num_drafts": msg.num_drafts} if msg.want_drafts and msg.num_drafts else {}
    return tuple(tokens), wire, data, sampling, {**_look_ahead(msg, limits, name),
                                                 **_cache_keys(msg, name), **depth}


def _cache_keys(msg: pb.SequenceUpdate, name: str) -> dict:
    """SeqUpdate's prefix-cache keys of `msg` (keyword arguments)."""
    if not msg.cache_keys and not msg.cache_key_ends:
        return {}
    if len(msg.cache_keys) != len(msg.cache_key_ends):
        raise invalid(f"{name}: {len(msg.cache_key_ends)} cache_key_ends but "
                      f"{len(msg.cache_keys)} cache_keys; they must match")
    if any(len(k) != 16 for k in msg.cache_keys):
        raise invalid(f"{name}.cache_keys: each key is 16 bytes")
    return {"cache_keys": tuple(zip(msg.cache_key_ends, msg.cache_keys, strict=True))}


def _look_ahead(msg: pb.SequenceUpdate, limits: DraftLimits, name: str) -> dict:
    """SeqUpdate's look-ahead fields of `msg` (keyword arguments)."""
    if not (msg.want_drafts and msg.look_ahead):
        return {}
    verifying = check_tokens(msg.verifying, limits.vocab_size, name=f"{name}.verifying")
    if len(verifying) > limits.num_draft_tokens:
        raise invalid(f"{name}.verifying: {len(verifying)} tokens; at most K = "
                      f"{limits.num_draft_tokens}")
    return {"look_ahead": True, "verifying": tuple(verifying)}


def decode_draft_request(msg: pb.DraftRequest,
                         limits: DraftLimits) -> tuple[UpdateBatch, tuple[SeqFailure, ...]]:
    """The valid updates as a batch, plus one failure per rejected update.

    The hidden states of the batch are decoded at once into one packed float32 buffer
    (one copy, one finiteness check); each update's `hidden` is a view of its rows.
    """
    checked: list[tuple[int, pb.SequenceUpdate, tuple[int, ...], WireDType, bytes,
                        DraftSampling, dict]] = []
    failures: list[SeqFailure] = []
    seen: set[int] = set()
    for i, u in enumerate(msg.updates):
        try:
            if u.seq_id in seen:
                raise invalid(f"updates[{i}]: seq {u.seq_id} has more than one update "
                              f"in batch {msg.batch_id}")
            seen.add(u.seq_id)
            checked.append((i, u, *_check_update(u, limits, f"updates[{i}]")))
        except WireError as err:
            failures.append(_failure(u.seq_id, err))
    hidden = _packed_hidden_rows(checked, limits.hidden_size)
    if hidden is None:  # mixed dtypes or a bad value: one by one, naming the culprit
        checked, hidden = _decode_each(checked, failures)
    updates = tuple(SeqUpdate(u.seq_id, u.start, tokens, h, u.want_drafts, sampling, **ahead)
                    for (_, u, tokens, _, _, sampling, ahead), h in zip(checked, hidden,
                                                                       strict=True))
    return UpdateBatch(msg.batch_id, updates, tuple(msg.releases)), tuple(failures)


def _packed_hidden_rows(checked, cols: int) -> list[torch.Tensor] | None:
    """Per-update views of one packed [sum(n), H] buffer; None: decode one by one."""
    if not checked:
        return []
    wire = checked[0][3]
    if any(c[3] is not wire for c in checked):
        return None
    scales = [c[1].hidden.scales for c in checked] if wire.quantized else []
    # NOTE: counted per update: one's shortfall and another's surplus would add up
    if scales and any(len(sc) != 4 * len(c[2]) for sc, c in zip(scales, checked, strict=True)):
        return None
    return packed_rows(wire, cols, [c[4] for c in checked], [len(c[2]) for c in checked],
                       scales)  # [n, H] each


def _decode_each(checked, failures: list[SeqFailure]):
    good, arrays = [], []
    for c in checked:
        i, u = c[0], c[1]
        try:
            arrays.append(decode_array(u.hidden, name=f"updates[{i}].hidden"))
            good.append(c)
        except WireError as err:
            failures.append(_failure(u.seq_id, err))
    return good, to_tensors(arrays)


# ------------------------------------------------------------------- drafter -> verifier


def encode_result(r: SeqOutcome) -> pb.SequenceResult:
    msg = pb.SequenceResult()
    _fill_result(msg, r, None)
    return msg


def _fill_result(out: pb.SequenceResult, r: SeqOutcome, tokens: list[int] | None) -> None:
    """Write `r` into the empty `out`; `tokens`: r.tokens as a list, if already at hand."""
    if isinstance(r, SeqFailure):
        e = out.error
        e.seq_id, e.code = r.seq_id, pb.ErrorCode.Value(f"ERROR_CODE_{r.code}")
        e.message = r.message
        if r.expected_start is not None:
            e.expected_start = r.expected_start
        return
    d = out.drafts
    d.seq_id, d.position, d.draft_time_s = r.seq_id, r.position, r.draft_time_s
    d.tokens.extend(r.tokens.tolist() if tokens is None else tokens)
    if r.sampled:
        encode_tensor(r.support, WireDType.INT32, out=d.support)
        encode_tensor(r.probs, WireDType.F32, out=d.probs)


def encode_draft_response(reply: DraftReply) -> pb.DraftResponse:
    """Filled in place; the draft tokens of the whole reply reach the host in one copy."""
    msg = pb.DraftResponse(batch_id=reply.batch_id)
    drafts = [r for r in reply.results if isinstance(r, DraftResult)]
    ids = iter(_token_lists(drafts))
    for r in reply.results:
        _fill_result(msg.results.add(), r, next(ids) if isinstance(r, DraftResult) else None)
    return msg


def _token_lists(drafts: list[DraftResult]) -> list[list[int]]:
    if len(drafts) > 1 and len({r.tokens.shape for r in drafts}) == 1:
        return torch.stack([r.tokens for r in drafts]).tolist()
    return [r.tokens.tolist() for r in drafts]


def decode_error(msg: pb.SequenceError) -> SeqFailure:
    expected = msg.expected_start if msg.HasField("expected_start") else None
    name = pb.ErrorCode.Name(msg.code) if msg.code in pb.ErrorCode.values() else ""
    try:
        code = ErrorCode(name.removeprefix("ERROR_CODE_"))
    except ValueError:  # a newer or broken drafter: no resync, just no drafts
        return SeqFailure(msg.seq_id, ErrorCode.UNAVAILABLE,
                          f"unknown error code {msg.code}: {msg.message}", expected)
    return SeqFailure(msg.seq_id, code, msg.message, expected)


def _check_support(tokens: torch.Tensor, support: torch.Tensor, probs: torch.Tensor,
                   limits: DraftLimits, name: str) -> None:
    k = support.shape[1]
    if limits.max_top_k is not None and k > limits.max_top_k:
        raise invalid(f"{name}.support: k = {k} exceeds max_top_k {limits.max_top_k}")
    if k and (support.min() < 0 or support.max() >= limits.vocab_size):
        raise invalid(f"{name}.support: token ids must be in [0, {limits.vocab_size})")
    if ((probs < 0) | (probs > 1)).any():
        raise invalid(f"{name}.probs: probabilities must be in [0, 1]")
    sums = probs.sum(dim=1)  # [K]
    if ((sums - 1).abs() > PROB_SUM_TOL).any():
        raise invalid(f"{name}.probs: rows must sum to 1, got {sums.tolist()}")
    # NOTE: q(d_i) = 0 (a draft outside its own support) is a drafter bug; rejecting it
    # here means a plain decode round instead of trusting a broken q.
    q = torch.where(support == tokens[:, None], probs, 0).sum(dim=1)  # [K]
    if (q <= 0).any():
        bad = int((q <= 0).nonzero()[0, 0])
        raise invalid(f"{name}.tokens[{bad}] = {int(tokens[bad])} has no probability in "
                      f"support[{bad}]")


def decode_drafts(msg: pb.Drafts, limits: DraftLimits, name: str = "drafts",
                  count: int | None = None) -> DraftResult:
    """Validate one sequence's drafts (1..K of them: fewer when the update asked for
    fewer, or exactly `count`); raises WireError(INVALID_ARGUMENT) naming the field."""
    ids = check_tokens(msg.tokens, limits.vocab_size, name=f"{name}.tokens")
    if count is None and not 1 <= len(ids) <= limits.num_draft_tokens:
        raise invalid(f"{name}.tokens: expected 1..K = {limits.num_draft_tokens} drafts, "
                      f"got {len(ids)}")
    if count is not None and len(ids) != count:
        raise invalid(f"{name}.tokens: expected {count} drafts, got {len(ids)}")
    K = len(ids)
    tokens = torch.tensor(ids, dtype=torch.int64)  # [K]
    if msg.HasField("support") != msg.HasField("probs"):
        raise invalid(f"{name}: support and probs must both be set or both be absent")
    support = probs = None
    if msg.HasField("support"):
        support = decode_tensor(msg.support, name=f"{name}.support",
                                allowed=(WireDType.INT32,))  # [K, k]
        k = support.shape[-1]
        if support.dim() != 2 or support.shape[0] != K:
            raise invalid(f"{name}.support: expected shape [{K}, k], got {list(support.shape)}")
        probs = decode_tensor(msg.probs, name=f"{name}.probs", expect_cols=k,
                              allowed=(WireDType.F32,))  # [K, k]
        if probs.shape[0] != K:
            raise invalid(f"{name}.probs: expected shape [{K}, {k}], got {list(probs.shape)}")
        _check_support(tokens, support, probs, limits, name)
    return DraftResult(msg.seq_id, msg.position, tokens, support, probs, msg.draft_time_s)


def encode_ahead_response(batch_id: int, entries: list[DraftAhead]) -> pb.DraftResponse:
    """The look-ahead response to batch `batch_id` (it follows the batch's answer)."""
    msg = pb.DraftResponse(batch_id=batch_id, look_ahead=True)
    for e in entries:
        out = msg.ahead.add()
        out.seq_id, out.base = e.seq_id, e.base
        out.outcome.extend(e.outcome)
        fill = pb.SequenceResult()
        _fill_result(fill, e.drafts, None)
        out.drafts.CopyFrom(fill.drafts)
    return msg


def decode_ahead(msg: pb.LookAhead, limits: DraftLimits, name: str) -> DraftAhead:
    """One look-ahead entry; raises WireError(INVALID_ARGUMENT) naming the field."""
    K = limits.num_draft_tokens
    outcome = check_tokens(msg.outcome, limits.vocab_size, name=f"{name}.outcome")
    if not 1 <= len(outcome) <= K + 1:
        raise invalid(f"{name}.outcome: {len(outcome)} tokens; expected 1..{K + 1}")
    if msg.drafts.seq_id != msg.seq_id or \
            msg.drafts.position != msg.base + len(outcome):
        raise invalid(f"{name}.drafts: seq_id {msg.drafts.seq_id} at position "
                      f"{msg.drafts.position} do not follow seq {msg.seq_id}'s outcome "
                      f"at {msg.base} + {len(outcome)}")
    # NOTE: K drafts, or K-1 after a bonus guess drafted in the bonus pass itself
    count = K - 1 if len(msg.drafts.tokens) == K - 1 and len(outcome) > 1 else K
    drafts = decode_drafts(msg.drafts, limits, f"{name}.drafts", count=count)
    return DraftAhead(msg.seq_id, msg.base, tuple(outcome), drafts)


def decode_draft_response(msg: pb.DraftResponse, limits: DraftLimits) -> DraftReply:
    """Drafts and failures; drafts that fail validation become INVALID_ARGUMENT failures.

    Greedy drafts (K tokens, no support) are range-checked for the whole reply at once.
    A look-ahead response decodes to its entries; a bad entry is dropped (it is a guess).
    """
    if msg.look_ahead:
        entries = []
        for i, e in enumerate(msg.ahead):
            try:
                entries.append(decode_ahead(e, limits, f"ahead[{i}]"))
            except WireError:
                continue
        return DraftReply(msg.batch_id, (), tuple(entries))
    results: list[SeqOutcome | None] = []
    greedy: list[tuple[int, int, pb.Drafts]] = []  # (index in results, in msg, drafts)
    ids: list[int] = []
    K = limits.num_draft_tokens
    for j, r in enumerate(msg.results):
        kind = r.WhichOneof("outcome")
        if kind == "error":
            results.append(decode_error(r.error))
        elif kind == "drafts":
            d = r.drafts
            if 1 <= len(d.tokens) <= K and not d.HasField("support") and \
                    not d.HasField("probs"):
                greedy.append((len(results), j, d))
                ids.extend(d.tokens)
                results.append(None)
            else:
                results.append(_decoded_or_failure(d, limits, f"results[{j}]"))
    if greedy and max(ids) < limits.vocab_size:
        # NOTE: one torch op per sequence, not tensor + view + unbind: in a cold process
        # each distinct torch op costs tens of microseconds the first time (measured)
        at = 0
        for i, _, d in greedy:
            n = len(d.tokens)  # K, or fewer when the update asked for fewer
            tokens = torch.tensor(ids[at:at + n], dtype=torch.int64)  # [n]
            at += n
            results[i] = DraftResult(d.seq_id, d.position, tokens, None, None, d.draft_time_s)
    else:  # a token out of range (or none): one by one, naming the culprit
        for i, j, d in greedy:
            results[i] = _decoded_or_failure(d, limits, f"results[{j}]")
    return DraftReply(msg.batch_id, tuple(results))


def _decoded_or_failure(d: pb.Drafts, limits: DraftLimits, name: str) -> SeqOutcome:
    try:
        return decode_drafts(d, limits, f"{name}.drafts")
    except WireError as err:
        return _failure(d.seq_id, err)

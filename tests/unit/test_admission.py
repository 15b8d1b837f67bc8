"""Fair admission (engine/admission.py): the n choices of one request cannot keep another
request waiting for their slots, a priority policy admits lower values first (and fcfs
refuses priorities), and giving way (preemption by recompute) never changes output."""

from __future__ import annotations

import dataclasses

import pytest

from chainspec.engine.admission import Admission, SchedulingPolicy, fair_victim, next_admission
from chainspec.engine.request import Request, StopConditions
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.verifier import VerifierEngine
from chainspec.rpc.codec import WireError
from chainspec.rpc.generate_codec import GenerateLimits, parse_generate
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from tests.unit.engine_fixtures import engine, prompts, tied_pair

GREEDY = SamplingParams(temperature=0.0)
MAX_SEQS = 4


@pytest.fixture(scope="module")
def pair():
    return tied_pair()


def _engine(pair, policy: SchedulingPolicy = SchedulingPolicy.FCFS, speculative=True
            ) -> VerifierEngine:
    eng = engine(pair[0], pair[1] if speculative else None, max_seqs=MAX_SEQS)
    eng.config = dataclasses.replace(eng.config, scheduling_policy=policy)
    return eng


def _add(eng: VerifierEngine, rid: str, prompt, max_tokens: int, party=None,
         priority: int = 0) -> None:
    eng.add_request(rid, prompt, GREEDY, StopConditions(max_tokens=max_tokens, ignore_eos=True),
                    admission=Admission(priority, party))


def _held(eng: VerifierEngine) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in eng.running:
        out[r.party] = out.get(r.party, 0) + 1
    return out


def _drain(eng: VerifierEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while eng.has_work:
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_tokens)
    return tokens


def test_a_party_alone_takes_every_slot_and_nothing_is_preempted(pair):
    eng = _engine(pair)
    for i, p in enumerate(prompts(2 * MAX_SEQS)):
        _add(eng, f"big-{i}", p, 12, party="big")
    eng.step()
    assert _held(eng) == {"big": MAX_SEQS}  # fairness costs nothing without rivals
    _drain(eng)
    assert eng.preemptions == 0


def test_a_probe_is_admitted_at_once_and_the_big_party_gives_one_slot(pair):
    eng = _engine(pair)
    for i, p in enumerate(prompts(2 * MAX_SEQS)):
        _add(eng, f"big-{i}", p, 40, party="big")
    for _ in range(3):
        eng.step()
    _add(eng, "probe", [1, 2, 3], 4)
    eng.step()
    assert _held(eng) == {"big": MAX_SEQS - 1, "probe": 1}
    assert eng.preemptions == 1


def test_two_big_parties_split_the_slots_in_half(pair):
    eng = _engine(pair)
    for i, p in enumerate(prompts(2 * MAX_SEQS)):
        _add(eng, f"a-{i}", p, 40, party="a")
    eng.step()
    for i, p in enumerate(prompts(2 * MAX_SEQS, seed=1)):
        _add(eng, f"b-{i}", p, 40, party="b")
    eng.step()
    assert _held(eng) == {"a": MAX_SEQS // 2, "b": MAX_SEQS // 2}
    preempted = eng.preemptions
    for _ in range(5):  # balanced: no more giving way (no thrash)
        eng.step()
    assert eng.preemptions == preempted


def test_giving_way_never_changes_output(pair):
    """Fair preemption is by recompute: every token equals the run without rivals."""
    alone = _engine(pair)
    for i, p in enumerate(prompts(2 * MAX_SEQS)):
        _add(alone, f"big-{i}", p, 30, party="big")
    want = _drain(alone)
    eng = _engine(pair)
    for i, p in enumerate(prompts(2 * MAX_SEQS)):
        _add(eng, f"big-{i}", p, 30, party="big")
    got: dict[str, list[int]] = {}
    for step in range(12):
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_tokens)
        _add(eng, f"probe-{step}", [5, step + 1], 3)  # a stream of rivals
    for rid, tokens in _drain(eng).items():
        got.setdefault(rid, []).extend(tokens)
    assert eng.preemptions > 0
    assert {k: v for k, v in got.items() if k.startswith("big")} == want
    assert eng.allocator.num_used == 0


def test_priority_policy_admits_lower_values_first(pair):
    eng = _engine(pair, SchedulingPolicy.PRIORITY, speculative=False)
    for i, p in enumerate(prompts(MAX_SEQS)):
        _add(eng, f"fill-{i}", p, 6, priority=5)
    eng.step()
    _add(eng, "late-low", [1, 2], 4, priority=9)
    _add(eng, "later-high", [3, 4], 4, priority=-1)
    order = []
    while eng.has_work:
        eng.step()
        order += [r.request_id for r in eng.running if r.request_id not in order]
    assert order.index("later-high") < order.index("late-low")


def test_fcfs_refuses_a_priority_as_vllm_does(pair):
    eng = _engine(pair)
    with pytest.raises(ValueError, match="scheduling-policy priority"):
        _add(eng, "x", [1, 2], 4, priority=1)
    assert not eng.has_work


def _req(rid: str, party: str, priority: int = 0) -> Request:
    r = Request(rid, [1], GREEDY, StopConditions(), 1)
    r.party, r.priority = party, priority
    return r


def test_order_is_priority_then_fewest_held_then_arrival():
    running = [_req("a0", "a"), _req("a1", "a"), _req("b0", "b")]
    waiting = [_req("a2", "a"), _req("b1", "b"), _req("c0", "c")]
    assert next_admission(waiting, running).request_id == "c0"  # holds none
    assert next_admission(waiting[:2], running).request_id == "b1"  # holds fewer
    waiting.append(_req("z0", "z", priority=-1))
    assert next_admission(waiting, running).request_id == "z0"


def test_no_party_of_better_priority_gives_way():
    running = [_req(f"a{i}", "a", priority=0) for i in range(4)]
    assert fair_victim([_req("c0", "c", priority=1)], running) is None
    assert fair_victim([_req("c0", "c", priority=0)], running).request_id == "a3"  # newest


def _wire(priority: int, parent: str = "") -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id="r", parent_request_id=parent, priority=priority)
    req.tokens.ids.extend([1, 2])
    return req


def test_the_wire_carries_priority_and_party_and_fcfs_refuses_a_priority() -> None:
    fcfs = GenerateLimits(61, 256, 3)
    assert parse_generate(_wire(0), fcfs, None).admission == Admission(0, None)
    assert parse_generate(_wire(0, "cmpl-1"), fcfs, None).admission.party == "cmpl-1"
    with pytest.raises(WireError, match="^priority: priority 3 needs"):
        parse_generate(_wire(3), fcfs, None)
    prio = GenerateLimits(61, 256, 3, scheduling_policy=SchedulingPolicy.PRIORITY)
    assert parse_generate(_wire(-3, "p"), prio, None).admission == Admission(-3, "p")

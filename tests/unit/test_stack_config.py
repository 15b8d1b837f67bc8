"""Stack configuration, membership transitions and the service commands' --dry-run
(no Ray, no model loading)."""

from __future__ import annotations

import json

import pytest

from chainspec.cli import main
from chainspec.cluster.config import DrafterRoleConfig, RoleConfig, StackConfig
from chainspec.cluster.membership import Member, MemberState


def test_from_dict_round_trip_and_unknown_keys() -> None:
    cfg = StackConfig(model_dir="/m", drafter=RoleConfig(replicas=3, num_gpus=1))
    assert StackConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="config: unknown keys bogus"):
        StackConfig.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="verifier: unknown keys gpus"):
        StackConfig.from_dict({"verifier": {"gpus": 1}})


@pytest.mark.parametrize("bad, match", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"), ({"dtype": "int4"}, "dtype"),
    ({"drafter": {"replicas": -1}}, "replicas"),
    ({"health_timeout_s": 0}, "health_timeout_s: input should be greater than 0"),
    ({"verifier": {"max_restarts": -2}}, "max_restarts"), ({"namespace": ""}, "namespace"),
    ({"drafter": {"port": 70000}}, "port"), ({"tls_ca": "/ca.crt"}, "mTLS needs all"),
])
def test_invalid_config_is_refused(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        StackConfig.from_dict(bad)


def test_drafter_mode_local_means_no_drafter_actors() -> None:
    """Local mode defaults to 0 drafter actors (the controller's desired count), refuses
    any other count, and survives the JSON round trip `up --detach` and the controller's
    `get_config` take; remote (the default) keeps 1 drafter."""
    from chainspec.cluster.intent import Intent
    local = StackConfig.from_dict({"drafter": {"mode": "local"}})
    assert (local.drafter.mode, local.drafter.replicas, local.drafter.local) == (
        "local", 0, True)
    assert Intent.fresh(local, "s").replicas == {"drafter": 0, "verifier": 1}
    assert StackConfig.from_dict(json.loads(json.dumps(local.to_dict()))) == local
    assert json.loads(json.dumps(local.to_dict()))["drafter"]["mode"] == "local"
    remote = StackConfig()
    assert (remote.drafter.mode, remote.drafter.replicas, remote.drafter.local) == (
        "remote", 1, False)
    assert StackConfig(drafter=RoleConfig(replicas=3)).drafter == DrafterRoleConfig(
        replicas=3)  # a plain RoleConfig is a remote drafter role
    with pytest.raises(ValueError, match="drafter.replicas must be 0 with drafter.mode local"):
        StackConfig.from_dict({"drafter": {"mode": "local", "replicas": 2}})
    with pytest.raises(ValueError, match="drafter.mode: input should be 'remote' or 'local'"):
        StackConfig.from_dict({"drafter": {"mode": "colocated"}})
    with pytest.raises(ValueError, match="verifier: unknown keys mode"):
        StackConfig.from_dict({"verifier": {"mode": "local"}})  # a drafter-only key


def test_pipeline_groups_are_validated_and_round_trip() -> None:
    assert StackConfig().pipeline_groups == 1
    cfg = StackConfig.from_dict({"pipeline_groups": 2})
    assert StackConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))).pipeline_groups == 2
    with pytest.raises(ValueError, match="pipeline_groups"):
        StackConfig.from_dict({"pipeline_groups": 0})


def test_verifier_options_carry_mode_and_groups_into_the_engine_config() -> None:
    from chainspec.engine.local import DrafterMode, LocalOptions, verifier_config
    from chainspec.rpc.verifier_service import VerifierOptions
    opts = VerifierOptions(drafter="local", groups=3)
    assert opts.drafter is DrafterMode.LOCAL and opts.groups == 3
    assert verifier_config(LocalOptions(max_seqs=4), opts.groups).groups == 3
    with pytest.raises(ValueError, match="groups"):
        VerifierOptions(groups=0)
    with pytest.raises(ValueError):
        VerifierOptions(drafter="colocated")


def test_a_local_mode_verifier_takes_no_drafter_endpoints() -> None:
    """Refused before anything loads: a local-mode verifier never opens a wire."""
    import asyncio

    from chainspec.rpc.server import ServerOptions
    from chainspec.rpc.verifier_service import VerifierOptions, serve_verifier
    with pytest.raises(ValueError, match="drafter mode local drafts in process"):
        asyncio.run(serve_verifier(VerifierOptions(drafter="local"), ServerOptions(),
                                   drafters=["d0:7001"]))


def test_local_drafts_stand_in_for_a_pool_of_one_and_take_no_endpoints() -> None:
    from chainspec.engine.local import LocalDrafts

    class Engine:
        load = 2
    drafts = LocalDrafts(Engine())
    assert drafts.loads() == {"in-process": 2} and drafts.states() == {"in-process": "live"}
    assert drafts.wanted() == 1 and drafts.wait_connected(0)
    drafts.set_endpoints([])  # what the hosting code does when there is nothing to follow
    with pytest.raises(ValueError, match="drafts in process"):
        drafts.set_endpoints(["d0:7001"])


def test_ports_and_mtls_reach_servers_and_clients() -> None:
    tls = {"tls_ca": "/t/ca.crt", "tls_server_cert": "/t/s.crt", "tls_server_key": "/t/s.key",
           "tls_client_cert": "/t/c.crt", "tls_client_key": "/t/c.key"}
    cfg = StackConfig.from_dict({"drafter": {"port": 50051}, "auth_token": "x", **tls})
    server = cfg.server_options("drafter", 5.0)
    assert (server.port, server.drain_grace_s, server.auth_token) == (50051, 5.0, "x")
    assert (str(server.tls_cert), str(server.tls_key), str(server.tls_client_ca)) == (
        "/t/s.crt", "/t/s.key", "/t/ca.crt")
    assert cfg.server_options("verifier", 5.0).port == 0
    client = cfg.client_options()
    assert (str(client.tls_cert), str(client.tls_key), str(client.tls_ca), client.auth_token) \
        == ("/t/c.crt", "/t/c.key", "/t/ca.crt", "x")
    plain = StackConfig().client_options()
    assert plain.tls_ca is None and plain.tls_cert is None


def test_roles_resources_and_devices() -> None:
    cfg = StackConfig(drafter=RoleConfig(num_gpus=0.5), verifier=RoleConfig(resource="big"))
    assert cfg.resource_name("drafter") == "chainspec_drafter"
    assert cfg.resource_name("verifier") == "big"
    assert cfg.local_options("drafter").device == "cuda"
    assert cfg.local_options("verifier").device == "cpu"
    with pytest.raises(ValueError, match="unknown role"):
        cfg.role("gateway")


def _info(**kw):
    return {"serving": True, "endpoint": "h:1", "load": 0, "pid": 10, "node": "n",
            "error": None, **kw}


def test_member_observe_transitions() -> None:
    m = Member("drafter-0", "drafter")
    assert not m.observe(_info(serving=False, endpoint=None))  # still starting
    assert m.observe(_info()) and m.state is MemberState.READY
    assert not m.observe(_info(load=5)) and m.load == 5  # load alone wakes no watcher
    assert m.observe(_info(pid=11, endpoint="h:2")) and m.restarts == 1
    m.state = MemberState.DRAINING
    assert not m.observe(_info(pid=11, endpoint="h:2")) and m.state is MemberState.DRAINING
    local = Member("verifier-1", "verifier")
    local.observe(_info(drafter_mode="local", links={"in-process": "live"}))
    assert local.to_dict()["drafter_mode"] == "local"  # what `status --json` prints
    assert Member("drafter-1", "drafter").to_dict()["drafter_mode"] is None
    failed = Member("verifier-0", "verifier")
    assert failed.observe(_info(serving=False, error="OSError: no model"))
    assert failed.state is MemberState.DEAD
    assert Member.from_dict(failed.to_dict()) == failed


def dry_run(capsys, *argv) -> dict:
    assert main([*argv, "--dry-run"]) == 0
    return json.loads(capsys.readouterr().out)


def test_up_dry_run_merges_config_file_and_flags(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CHAINSPEC_AUTH_TOKEN", "s3cret")
    path = tmp_path / "stack.yaml"
    path.write_text("model: /models/x\nmax_model_len: 512\ndrafter:\n  replicas: 2\n")
    out = dry_run(capsys, "up", "--config", str(path), "--drafter-gpus", "1", "--verifiers",
                  "3", "--address", "ray://head:10001")
    cfg = out["config"]
    assert (cfg["model"], cfg["max_model_len"], out["address"]) == ("/models/x", 512,
                                                                    "ray://head:10001")
    assert cfg["drafter"]["replicas"] == 2 and cfg["drafter"]["num_gpus"] == 1.0
    assert cfg["verifier"]["replicas"] == 3
    assert cfg["auth_token"] == "<set>"  # never printed


def test_up_dry_run_rejects_bad_config(tmp_path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text("drafter: {replicas: 1, bogus: 2}\n")
    assert main(["up", "--config", str(path), "--dry-run"]) == 2


def test_scale_status_down_dry_run(capsys) -> None:
    out = dry_run(capsys, "scale", "drafters", "4", "--namespace", "ns")
    assert (out["role"], out["replicas"], out["namespace"]) == ("drafter", 4, "ns")
    assert dry_run(capsys, "status")["namespace"] == "chainspec"
    assert dry_run(capsys, "down", "--address", "auto")["address"] == "auto"
    assert main(["scale", "drafters", "-1", "--dry-run"]) == 2


def test_up_dry_run_drafter_mode_and_pipeline_groups(capsys, tmp_path) -> None:
    cfg = dry_run(capsys, "up", "--drafter-mode", "local", "--pipeline-groups", "2")["config"]
    assert (cfg["drafter"]["mode"], cfg["drafter"]["replicas"]) == ("local", 0)
    assert cfg["pipeline_groups"] == 2
    path = tmp_path / "stack.yaml"
    path.write_text("drafter: {mode: local}\n")
    cfg = dry_run(capsys, "up", "--config", str(path), "--drafter-mode", "remote")["config"]
    assert (cfg["drafter"]["mode"], cfg["drafter"]["replicas"]) == ("remote", 1)  # flag wins
    assert main(["up", "--drafter-mode", "local", "--drafters", "2", "--dry-run"]) == 2
    assert "drafter.replicas must be 0" in capsys.readouterr().err


def test_verifier_dry_run(capsys, tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("abc\n")
    out = dry_run(capsys, "verifier", "--drafter", "d0:7001", "--drafter", "[::1]:7002",
                  "--max-waiting", "3", "--token-file", str(token), "--port", "7100")
    assert out["drafters"] == ["d0:7001", "[::1]:7002"]
    assert out["verifier"]["max_waiting"] == 3 and out["server"]["port"] == 7100
    assert out["server"]["auth_token"] == out["client"]["auth_token"] == "<set>"
    assert main(["verifier", "--drafter", "nohost", "--dry-run"]) == 2
    assert out["verifier"]["groups"] == 1
    assert dry_run(capsys, "verifier", "--pipeline-groups", "2")["verifier"]["groups"] == 2
    assert main(["verifier", "--pipeline-groups", "0", "--dry-run"]) == 2
    assert out["verifier"]["drafter"] == "remote"
    assert dry_run(capsys, "verifier", "--drafter-mode", "local")["verifier"]["drafter"] \
        == "local"
    # a local drafter takes no drafter endpoints (refused before loading anything)
    assert main(["verifier", "--drafter-mode", "local", "--drafter", "d:1", "--dry-run"]) == 2


def test_custom_resource_only_when_the_cluster_declares_it() -> None:
    from chainspec.cluster.controller import role_resources
    cfg = StackConfig(drafter=RoleConfig(resource_amount=0.01))
    plain_ray = {"CPU": 2.0, "memory": 1e9}
    assert role_resources(cfg, "drafter", plain_ray) == {}
    grouped = {**plain_ray, "chainspec_drafter": 4.0}
    assert role_resources(cfg, "drafter", grouped) == {"chainspec_drafter": 0.01}
    assert role_resources(cfg, "verifier", grouped) == {}


def test_intent_counts_ids_forgets_members_and_round_trips() -> None:
    from chainspec.cluster.intent import MEMBER_NAME, Intent, actor_name, role_of
    intent = Intent.fresh(StackConfig(drafter=RoleConfig(replicas=2)), "s1")
    assert intent.replicas == {"drafter": 2, "verifier": 1}
    ids = [intent.new_id("drafter"), intent.new_id("verifier"), intent.new_id("drafter")]
    assert ids == ["drafter-0", "verifier-0", "drafter-1"]  # never reused within a stack
    intent.members, intent.draining = list(ids), ["drafter-1"]
    assert intent.forget("drafter-1") and not intent.forget("drafter-1")
    assert intent.members == ["drafter-0", "verifier-0"] and intent.draining == []
    assert Intent.from_json(intent.to_json()) == intent
    assert role_of("verifier-12") == "verifier"
    assert MEMBER_NAME.fullmatch(actor_name("drafter-3"))
    assert not MEMBER_NAME.fullmatch("chainspec-controller")
    assert not MEMBER_NAME.fullmatch(actor_name("gateway-0"))  # not the controller's to kill


@pytest.fixture
def no_ray(monkeypatch):
    """As in a fresh CLI process, even when an earlier test joined a Ray here."""
    import ray
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def test_commands_refuse_a_stack_they_cannot_name(tmp_path, monkeypatch, capsys,
                                                   no_ray) -> None:
    monkeypatch.setenv("CHAINSPEC_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # never a fallback
    for argv in (["status"], ["down"], ["scale", "verifiers", "2"]):
        assert main([*argv, "--namespace", "nobody"]) == 1
        err = capsys.readouterr().err
        assert "no state file" in err and "--address" in err and "--namespace" in err, err


@pytest.mark.parametrize("listening", [False, True], ids=["nothing", "not-ray"])
def test_a_dead_address_is_a_fast_error_and_the_state_file_goes(tmp_path, monkeypatch,
                                                                no_ray, listening) -> None:
    """Nothing listening, or a socket that accepts but is no Ray (Ray's own connect
    would hang for minutes on either)."""
    import socket
    import time

    from chainspec.cluster import stack
    monkeypatch.setenv("CHAINSPEC_STATE_DIR", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        if listening:
            s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        path = stack.state_path("dead")
        path.write_text(json.dumps({"address": address, "namespace": "dead",
                                    "owner_pid": None}))
        t0 = time.monotonic()
        with pytest.raises(stack.StackNotFound, match=f"no Ray cluster answers at {address}"
                                                      ".*removed the stale state file"):
            stack.status(namespace="dead")
    assert time.monotonic() - t0 < stack.PROBE_TIMEOUT_S + 1 and not path.exists()

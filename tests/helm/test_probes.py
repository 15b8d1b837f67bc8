"""Worker probes check the gRPC health of the port the role's actor opens, and keep
working with mTLS: kubelet's gRPC probe over plaintext; with tls.enabled an exec of
`chainspec health` whose arguments dry-run through the real CLI with the files the pod
mounts, presenting the credentials the stack's own clients present."""

from pathlib import PurePosixPath

import pytest

from chainspec import cli
from tests.helm.commands import dry_run, sandbox
from tests.helm.render import CASES, of_kind, template, worker_group
from tests.helm.test_wiring import PROBES, ROLES, worker_groups

HEALTH = ["python", "-m", "chainspec.commands.health"]
TLS_SECRET_KEYS = {"tls.crt", "tls.key", "ca.crt"}  # kubernetes.io/tls (cert-manager)
MTLS_CASES = sorted(c for c in CASES if "mtls" in c)


def _container(docs, role: str) -> tuple[dict, dict]:
    spec = worker_group(docs, role)["template"]["spec"]
    return spec, spec["containers"][0]


def test_health_module_is_the_cli_command():
    """The exec probes run the module that `chainspec health` dispatches to."""
    _, handlers = cli.build_parser()
    assert handlers["health"].__name__ == ".".join(HEALTH[2:])


def test_an_example_has_mtls_with_probes(booted):
    assert MTLS_CASES, "no case renders mTLS"
    for case in MTLS_CASES:
        assert booted(case).of("up")[0].resolved["config"]["tls_ca"], case


@pytest.mark.parametrize("case", sorted(CASES))
def test_probes_check_the_port_the_actor_opens(case, booted, tmp_path):
    b = booted(case)
    config = b.of("up")[0].resolved["config"]
    configmaps = {d["metadata"]["name"]: d for d in of_kind(b.docs, "ConfigMap")}
    for role in sorted(worker_groups(b.docs)):  # no drafter group with drafter.mode local
        spec, c = _container(b.docs, role)
        for kind in (k for k in PROBES if k in c):
            probe = c[kind]
            if not config["tls_ca"]:
                assert set(probe) & {"grpc", "exec"} == {"grpc"}, (role, kind)
                assert probe["grpc"]["port"] == config[role]["port"], (role, kind)
                continue
            assert probe["exec"]["command"][:3] == HEALTH, (role, kind)
            argv = ("health", *probe["exec"]["command"][3:])
            run = dry_run(sandbox(spec, c, configmaps, tmp_path / role / kind, argv))
            assert run["address"] == f"127.0.0.1:{config[role]['port']}", (role, kind)
            assert probe["timeoutSeconds"] > run["timeout_s"], \
                "kubelet must not kill the probe before its own timeout answers"
            _check_credentials(probe["exec"]["command"], run, config, tmp_path, (role, kind))


def _check_credentials(command: list[str], run: dict, config: dict, root, where) -> None:
    """The probe trusts the stack's CA and presents the stack's client pair (what
    verifiers present to drafters, so the servers accept it), from files its container
    mounts (the sandbox moved them under `root`) under keys a TLS Secret has."""
    client = run["client"]
    pod_paths = {flag: command[command.index(flag) + 1]
                 for flag in ("--tls-ca", "--tls-cert", "--tls-key")}
    assert pod_paths == {"--tls-ca": config["tls_ca"],
                         "--tls-cert": config["tls_client_cert"],
                         "--tls-key": config["tls_client_key"]}, where
    for key in ("tls_ca", "tls_cert", "tls_key"):
        assert client[key].startswith(str(root)), f"{where}: {client[key]} is not mounted"
    assert {PurePosixPath(p).name for p in pod_paths.values()} <= TLS_SECRET_KEYS, where
    assert client["tls_server_name"], where


def test_mtls_without_probes_renders_no_probes_and_no_drafter_client_secret():
    tls = ("--set", "tls.enabled=true", "--set", "tls.serverSecretName=s",
           "--set", "tls.clientSecretName=c")
    off = ("--set", "drafter.grpc.probes=false", "--set", "verifier.grpc.probes=false")
    docs = template(*tls, *off)
    for role in ROLES:
        _, c = _container(docs, role)
        assert not set(PROBES) & set(c), role
    drafter = {m["name"] for m in _container(docs, "drafter")[1]["volumeMounts"]
               if m["name"].startswith("tls-")}
    assert drafter == {"tls-server"}, "a drafter needs the client pair only to probe itself"
    probed = {m["name"] for m in _container(template(*tls), "drafter")[1]["volumeMounts"]
              if m["name"].startswith("tls-")}
    assert probed == {"tls-server", "tls-client"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_autoscaled_roles_have_no_liveness_probe(case, booted):
    """A drained actor leaves its autoscaled pod idle until the autoscaler removes it;
    a liveness probe on the actor's port would restart the pod instead."""
    for role in sorted(worker_groups(booted(case).docs)):
        group = worker_group(booted(case).docs, role)
        c = group["template"]["spec"]["containers"][0]
        if "readinessProbe" in c:
            autoscaled = "replicas" not in group
            assert ("livenessProbe" in c) != autoscaled, (role, autoscaled)


def test_every_client_checks_certificates_against_the_server_name(booted):
    """Members dial each other by pod IP, which one shared certificate cannot list: the
    stack's clients (verifiers -> drafters) and the gateway check `tls.serverName`, the
    name the probes check too."""
    b = booted("autoscaling-mtls-monitoring")
    config = b.of("up")[0].resolved["config"]
    assert config["tls_server_name"] == "localhost"
    assert b.of("gateway")[0].resolved["tls"]["server_name"] == config["tls_server_name"]

"""The rendered manifests are wired to the real CLI: every container command is a
chainspec invocation that parses (--dry-run through chainspec.cli.main), the stack it
starts matches the worker groups it lands on, every probe and monitor targets a port the
container declares and the service opens, and selectors pick the pods they should."""

import json

import pytest

from chainspec.gateway.routes import router
from tests.helm.render import CASES, of_kind, one, pod_templates, selects, worker_group

CASE_NAMES = sorted(CASES)
ROLES = ("drafter", "verifier")


def ports(container: dict) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"]
            for p in container.get("ports", [])}


def resolve(container: dict, port) -> int:
    """A probe/targetPort reference (name or number) to a declared container port."""
    declared = ports(container)
    number = declared.get(port) if isinstance(port, str) else port
    assert number in declared.values(), \
        f"{container['name']}: port {port!r} is not declared ({declared})"
    return number


def worker_groups(docs) -> set[str]:
    return {g["groupName"] for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]}


def ray_resources(group: dict) -> dict[str, float]:
    """rayStartParams `resources` ('"{\\"name\\": 1}"', as ray start wants it)."""
    raw = group["rayStartParams"]["resources"]
    assert raw[0] == raw[-1] == '"', raw
    return json.loads(raw[1:-1].replace('\\"', '"'))


@pytest.mark.parametrize("case", CASE_NAMES)
def test_every_container_runs_chainspec_or_ray_start(case, booted):
    runs = booted(case).runs  # each invocation already parsed and dry-run
    assert runs and all(r.resolved for r in runs)
    for pt in pod_templates(booted(case).docs):
        if pt.ray:  # KubeRay writes `ray start` into the first container
            ray = pt.spec["containers"][0]
            assert "command" not in ray and "args" not in ray, pt.where


@pytest.mark.parametrize("case", CASE_NAMES)
def test_gateway_boots_the_stack_then_execs_the_gateway(case, booted):
    b = booted(case)
    order = [r.invocation.command for r in b.runs]
    assert order[:2] == ["status", "up"] and order[-1] == "gateway", order
    assert set(order[2:-1]) <= {"scale"}
    assert b.runs[-1].invocation.exec, "the gateway must get the container's signals"
    cluster = one(b.docs, "RayCluster")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    address = f"ray://{cluster['metadata']['name']}-head-svc:{ports(head)['client']}"
    namespace = b.of("up")[0].resolved["config"]["namespace"]
    for r in b.runs:
        assert r.resolved["address"] == address, r.argv
        assert r.resolved.get("namespace", namespace) == namespace, r.argv


@pytest.mark.parametrize("case", CASE_NAMES)
def test_stack_config_fits_the_worker_groups(case, booted):
    b = booted(case)
    config = b.of("up")[0].resolved["config"]
    assert config["grpc_host"] == "0.0.0.0"  # actors advertise their pod IP
    head = one(b.docs, "RayCluster")["spec"]["headGroupSpec"]
    scaled = {r.resolved["role"]: r.resolved["replicas"] for r in b.of("scale")}
    for role in ROLES:
        if config[role].get("mode") == "local":  # drafting in each verifier: no drafters
            assert role not in worker_groups(b.docs) and config[role]["replicas"] == 0
            assert role not in scaled
            continue
        group, rc = worker_group(b.docs, role), config[role]
        assert ray_resources(group) == {rc["resource"]: rc["resource_amount"]}, \
            "each pod offers exactly what one actor asks for"
        assert ray_resources(head)[rc["resource"]] < rc["resource_amount"], \
            "the head declares the role resource but can never host the role"
        amounts = [*ray_resources(group).values(), *ray_resources(head).values()]
        assert all(float(a).is_integer() for a in amounts), "Ray refuses fractional nodes"
        limits = group["template"]["spec"]["containers"][0]["resources"].get("limits", {})
        assert rc["num_gpus"] == int(limits.get("nvidia.com/gpu", 0))
        assert rc["replicas"] <= group["minReplicas"], "`up` waits only for pods that exist"
        if "replicas" in group:  # fixed size: an actor for every pod the group may have
            assert scaled.get(role, rc["replicas"]) >= group["maxReplicas"], role
        else:  # autoscaled: pending actors would drive the autoscaler to max
            assert role not in scaled


@pytest.mark.parametrize("case", CASE_NAMES)
def test_model_directory_is_mounted_where_it_is_read(case, booted):
    b = booted(case)
    model_dir = b.of("up")[0].resolved["config"]["model"]
    mounted = [pt for pt in pod_templates(b.docs) if "model" in
               {v["name"] for v in pt.spec.get("volumes", [])}]
    if not mounted:  # the bundled demo model: the package's own path
        assert model_dir.endswith("chainspec/assets/demo")
        return
    for pt in mounted:
        mounts = {m["name"]: m for m in pt.spec["containers"][0]["volumeMounts"]}
        assert mounts["model"]["readOnly"] is True
        assert model_dir.startswith(mounts["model"]["mountPath"]), pt.where
    assert {pt.labels["app.kubernetes.io/component"] for pt in mounted} >= {
        *worker_groups(b.docs), "gateway"}


def test_secret_files_are_the_configured_keys(booted):
    argv = " ".join(booted("grpc-probes-pvc-secrets").of("gateway")[0].invocation.argv)
    assert "--token-file /etc/chainspec/token/tk" in argv
    assert "--api-key-file /etc/chainspec/api-key/ak" in argv
    assert booted("grpc-probes-pvc-secrets").of("gateway")[0].resolved["gateway"]["api_key"]
    assert booted("grpc-probes-pvc-secrets").of("up")[0].resolved["config"]["auth_token"]
    assert booted("default").of("up")[0].resolved["config"]["auth_token"] is None


def test_request_chat_templates_are_trusted_only_when_set(booted):
    def trusted(case: str) -> bool:
        return booted(case).of("gateway")[0].resolved["gateway"]["trust_request_chat_template"]
    assert trusted("grpc-probes-pvc-secrets") is True and trusted("default") is False


# -- ports, probes, monitors -------------------------------------------------------------

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


@pytest.mark.parametrize("case", CASE_NAMES)
def test_probes_target_declared_ports(case, booted):
    for pt in pod_templates(booted(case).docs):
        for c in pt.spec["containers"]:
            for probe in (c[k] for k in PROBES if k in c):
                action = next(probe[a] for a in ("httpGet", "tcpSocket", "grpc", "exec")
                              if a in probe)
                if "port" in action:
                    resolve(c, action["port"])


@pytest.mark.parametrize("case", CASE_NAMES)
def test_gateway_listens_where_it_is_probed_and_served(case, booted):
    b = booted(case)
    resolved = b.of("gateway")[0].resolved["gateway"]
    assert resolved["host"] == "0.0.0.0"
    c = one(b.docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert resolve(c, "http") == resolved["port"]
    for k in PROBES:
        action = c[k].get("httpGet") or c[k].get("tcpSocket")
        assert resolve(c, action["port"]) == resolved["port"], k
        if "path" in action:
            assert action["path"] in _gateway_paths(), k
    svc = next(s for s in of_kind(b.docs, "Service")
               if s["metadata"]["name"].endswith("-gateway"))
    assert all(resolve(c, p["targetPort"]) == resolved["port"] for p in svc["spec"]["ports"])


def _gateway_paths() -> set[str]:
    return {route.path for route in router.routes}


# worker probes: test_probes.py


def test_role_metrics_port_is_the_port_the_service_opens(booted):
    b = booted("default")
    config = b.of("up")[0].resolved["config"]
    for role in ROLES:
        c = worker_group(b.docs, role)["template"]["spec"]["containers"][0]
        assert config[role]["metrics_port"] == ports(c)["metrics"], role


@pytest.mark.parametrize("case", CASE_NAMES)
def test_monitors_select_their_role_and_a_declared_port(case, booted):
    docs = booted(case).docs
    templates = list(pod_templates(docs))
    for pm in of_kind(docs, "PodMonitor"):
        matched = [pt for pt in templates if selects(pm["spec"]["selector"], pt.labels)]
        assert len({pt.labels["app.kubernetes.io/component"] for pt in matched}) == 1
        for ep in pm["spec"]["podMetricsEndpoints"]:
            for pt in matched:
                resolve(pt.spec["containers"][0], ep["port"])
    for sm in of_kind(docs, "ServiceMonitor"):
        svcs = [s for s in of_kind(docs, "Service")
                if selects(sm["spec"]["selector"], s["metadata"]["labels"])]
        assert [s["metadata"]["name"].rsplit("-", 1)[-1] for s in svcs] == ["gateway"]
        names = {p["name"] for p in svcs[0]["spec"]["ports"]}
        assert all(ep["port"] in names and ep["path"] in _gateway_paths()
                   for ep in sm["spec"]["endpoints"])


# -- selectors -------------------------------------------------------------------------

def _components(selector: dict, docs) -> set[str]:
    return {pt.labels["app.kubernetes.io/component"] for pt in pod_templates(docs)
            if selects(selector, pt.labels)}


@pytest.mark.parametrize("case", CASE_NAMES)
def test_services_and_budgets_select_their_pods(case, booted):
    docs = booted(case).docs
    for svc in of_kind(docs, "Service"):
        assert _components({"matchLabels": svc["spec"]["selector"]}, docs) == {"gateway"}
    for dep in of_kind(docs, "Deployment"):
        assert selects(dep["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    ray = {pt.labels["app.kubernetes.io/component"] for pt in pod_templates(docs) if pt.ray}
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        component = pdb["metadata"]["labels"]["app.kubernetes.io/component"]
        assert _components(pdb["spec"]["selector"], docs) == {component}
        if component in ray:  # no scale subresource on a RayCluster: integer minAvailable
            assert set(pdb["spec"]) == {"selector", "minAvailable"}
            assert isinstance(pdb["spec"]["minAvailable"], int), component


@pytest.mark.parametrize("case", CASE_NAMES)
def test_network_policy_admits_the_release_and_metrics_only(case, booted):
    docs = booted(case).docs
    policy = one(docs, "NetworkPolicy")["spec"]
    roles = worker_groups(docs)  # no drafter pods with drafter.mode local
    assert _components(policy["podSelector"], docs) == {"head", *roles}
    release, metrics = policy["ingress"][:2]
    assert "ports" not in release  # Ray and the services use many (ephemeral) ports
    assert _components(release["from"][0]["podSelector"], docs) == {"head", "gateway", *roles}
    assert list(metrics["from"][0]) == ["namespaceSelector"]
    allowed = {p["port"] for p in metrics["ports"]}
    for pt in pod_templates(docs):
        if selects(policy["podSelector"], pt.labels):  # `metrics`, the head's `ctrl-metrics`
            scraped = {n: p for n, p in ports(pt.spec["containers"][0]).items()
                       if n.endswith("metrics")}
            assert "metrics" in scraped and set(scraped.values()) <= allowed, pt.where


@pytest.mark.parametrize("case", CASE_NAMES)
def test_mounts_name_volumes_and_tls_goes_where_it_is_used(case, booted):
    for pt in pod_templates(booted(case).docs):
        volumes = {v["name"] for v in pt.spec.get("volumes", [])}
        for c in pt.spec["containers"]:
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= volumes, pt.where
            component = pt.labels["app.kubernetes.io/component"]
            if "tls-server" in volumes:
                assert component in ROLES and "tls-server" in mounts
            if "tls-client" in volumes:  # clients: verifiers, gateways, mTLS probes
                probed = component == "drafter" and "readinessProbe" in c
                assert component in ("verifier", "gateway") or probed, pt.where
                assert "tls-client" in mounts, pt.where
    tls = [pt for pt in pod_templates(booted("autoscaling-mtls-monitoring").docs)
           if "tls-server" in {v["name"] for v in pt.spec.get("volumes", [])}]
    assert len(tls) == 2

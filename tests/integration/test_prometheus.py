"""A real Prometheus server (Debian's package) whose only configuration is the gateway's
http_sd endpoint and deploy/'s rules: it finds the stack's members on the session's local
Ray, finds the second drafter once the stack scales from one to two, evaluates the
recording rules to a non-zero acceptance rate, and accepts every dashboard expression."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time

import httpx
import pytest

from chainspec.cluster import stack
from chainspec.cluster.config import RoleConfig, StackConfig
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.membership import ControllerVerifiers
from chainspec.gateway.server import GatewayServer
from tests.integration.grpc_helpers import free_port
from tests.tools import REPO, prometheus

pytestmark = pytest.mark.timeout(480)
NS = "chainspec-prometheus-test"
RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "chainspec.json"


def wait_for(what: str, fn, timeout: float = 90.0):
    """fn()'s first truthy value, polled; fails naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (httpx.HTTPError, OSError) as e:  # not up yet: keep polling
            last = e
        else:
            if last:
                return last
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}: {last!r}")


class Prom:
    """A Prometheus process scraping every member the gateway's http_sd lists."""

    def __init__(self, tmp_path, targets_url: str) -> None:
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [{"job_name": "chainspec", "http_sd_configs": [
                      {"url": targets_url, "refresh_interval": "1s"}]}]}
        path = tmp_path / "prometheus.yml"
        path.write_text(json.dumps(config))  # JSON is YAML
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (tmp_path / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [prometheus(), f"--config.file={path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for("Prometheus to be ready", lambda: self.proc.poll() is None and
                 httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200, 60)

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


class Load:
    """Completions through the gateway from two threads until stopped: the counters keep
    moving while Prometheus scrapes, and with two sequences in flight a second drafter
    gets one of them (least-loaded assignment)."""

    def __init__(self, url: str, workers: int = 2) -> None:
        self.url, self.done, self.errors = url, 0, []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(w,), daemon=True)
                        for w in range(workers)]
        for t in self.threads:
            t.start()

    def run(self, worker: int) -> None:
        prompts = ["def fibonacci(n):", "hello world", "for i in range(3):"]
        while not self.stopping.is_set():
            body = {"prompt": prompts[(self.done + worker) % 3], "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True}
            try:
                r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)
                if r.status_code != 200:
                    self.errors.append(r.text)
            except httpx.HTTPError as e:
                self.errors.append(str(e))
            self.done += 1

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=90)


@pytest.fixture(scope="module")
def served(ray_cluster, model_dir, loop_thread):
    config = StackConfig(model_dir=str(model_dir), num_steps=3, max_seqs=8, max_len=256,
                         health_interval_s=0.5, health_timeout_s=3.0, drain_timeout_s=20.0,
                         drafter=RoleConfig(replicas=1), namespace=NS)
    stack.up(config)
    gateway = None
    try:
        source = ControllerVerifiers(stack.connect(namespace=NS))
        gateway = loop_thread.run(GatewayServer.start(
            GatewayConfig(port=0, refresh_interval_s=0.2), source))
        assert loop_thread.run(gateway.wait_ready(60, drafters=1))
        yield gateway
    finally:
        if gateway is not None:
            loop_thread.run(gateway.stop())
        stack.down(namespace=NS)


def members_seen(prom: Prom, role: str, metric: str) -> set[str]:
    return {r["metric"]["member"] for r in prom.query(f'{metric}{{role="{role}"}}')}


def test_prometheus_follows_the_stack_through_http_sd(served, tmp_path):
    targets_url = f"{served.url}/v1/metrics/targets"
    groups = httpx.get(targets_url, timeout=10).json()
    assert sorted(g["labels"]["role"] for g in groups) == ["drafter", "gateway", "verifier"]
    prom = Prom(tmp_path, targets_url)
    load = Load(served.url)
    try:
        first = wait_for("the first drafter's series", lambda: members_seen(
            prom, "drafter", "chainspec_drafter_sequences"))
        assert len(first) == 1
        wait_for("the verifier's and the gateway's series", lambda: members_seen(
            prom, "verifier", "chainspec_num_requests_running") and members_seen(
            prom, "gateway", "chainspec_gateway_in_flight_requests"))
        stack.scale("drafter", 2, namespace=NS)
        both = wait_for("both drafters' series", lambda: (
            s := members_seen(prom, "drafter", "chainspec_drafter_sequences")) >= first and
            len(s) == 2 and s)
        # the new drafter drafts for new sequences (least-loaded assignment)
        wait_for("rounds on both drafters", lambda: len({
            r["metric"]["member"] for r in prom.query(
                'chainspec_drafter_round_seconds_count{role="drafter"} > 1')}) == 2)
        rate = wait_for("a non-zero acceptance rate from the recording rule", lambda: [
            float(r["value"][1]) for r in prom.query(
                "chainspec:spec_decode_acceptance_rate:rate5m > 0")])
        assert 0 < rate[0] <= 1
        length = prom.query("chainspec:spec_decode_acceptance_length:rate5m")
        assert 1 < float(length[0]["value"][1]) <= 1 + 3
        assert {r["metric"]["member"] for r in prom.query('up{role="drafter"} == 1')} == both
        rules = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        assert all(rule["health"] == "ok" for g in rules for rule in g["rules"]), rules
        for expr in dashboard_exprs():
            prom.query(expr)  # parses and evaluates (status success)
    finally:
        load.stop()
        prom.stop()
    assert load.done > 0 and not load.errors, load.errors[:3]


def dashboard_exprs() -> list[str]:
    """Every target expression of the dashboard, Grafana's variables filled in."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    subs = {"$__rate_interval": "1m", "$model": ".*"}
    return [re.sub(r"\$__rate_interval|\$model", lambda m: subs[m.group(0)], e) for e in exprs]

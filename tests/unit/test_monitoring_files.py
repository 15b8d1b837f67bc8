"""deploy/'s Grafana dashboard and Prometheus rules: the dashboard is well-formed Grafana
JSON, the rules pass `promtool check rules`, and every PromQL expression in either
references only metrics the services export (or the rules record)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from chainspec.gateway.metrics import GatewayMetrics
from chainspec.metrics.drafter import DrafterMetrics
from chainspec.metrics.verifier import VerifierMetrics
from tests.tools import CHART, REPO, promtool, promtool_check

DASHBOARD = REPO / "deploy" / "grafana" / "chainspec.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
PANEL_TYPES = {"timeseries", "stat", "gauge", "bargauge", "table", "text", "row", "heatmap"}
PROMETHEUS_OWN = {"up"}  # series Prometheus itself writes for every target
KEYWORDS = {"and", "or", "unless", "bool", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric (and recorded series) names a PromQL expression reads."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", " ", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)  # ranges and subqueries
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\b(group_left|group_right)\b|\boffset\s+\S+", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0) in KEYWORDS:
            continue  # a function or an aggregation
        names.add(m.group(0))
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def exported() -> set[str]:
    names = set()
    for metrics in (VerifierMetrics("m", 3), DrafterMetrics("m", 3), GatewayMetrics("m")):
        names |= metrics.names()
    return names


def test_the_name_parser():
    expr = ('sum by (a, le) (rate(x_total{b="c", d=~"e|f"}[5m])) / on (a) group_left '
            'histogram_quantile(0.9, y_bucket) > bool 1 and z:r:rate5m offset 1h '
            'or absent(w[10m:1m])')
    assert metric_names(expr) == {"x_total", "y_bucket", "z:r:rate5m", "w"}


def test_exported_names_follow_the_conventions():
    names = exported()
    vllm = {n for n in names if n.startswith("vllm:")}  # the gateway's view, vLLM's names
    names -= vllm
    assert names and all(n.startswith("chainspec_") and ":" not in n for n in names)
    assert vllm and all(":" not in n.removeprefix("vllm:") for n in vllm)
    for n in names:
        if "seconds" in n:
            assert re.search(r"_seconds(_bucket|_count|_sum|_created)?$", n), n


def test_every_expression_reads_exported_or_recorded_series():
    recorded = {r["record"] for r in rules() if "record" in r}
    known = exported() | recorded | PROMETHEUS_OWN
    exprs = [r["expr"] for r in rules()]
    d = dashboard()
    exprs += [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"].removeprefix("label_values(").split(",")[0]
              for v in d["templating"]["list"] if v["type"] == "query"]
    used = set().union(*(metric_names(e) for e in exprs))
    assert {"chainspec_spec_decode_num_accepted_tokens_total",
            "chainspec:spec_decode_acceptance_rate:rate5m"} <= used  # the parser found names
    assert used <= known, f"not exported by any service: {sorted(used - known)}"
    assert all(":" in name for name in recorded)  # colons only in recorded names


def test_dashboard_is_grafana_dashboard_json():
    d = dashboard()
    for key in ("title", "uid", "panels", "schemaVersion", "templating", "time"):
        assert key in d, key
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids, cells = set(), set()
    for p in d["panels"]:
        where = p.get("title", p.get("id"))
        assert isinstance(p["id"], int) and p["id"] not in ids, where
        ids.add(p["id"])
        assert p["type"] in PANEL_TYPES and p["title"], where
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("h", "w", "x", "y")), where
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["x"] + g["w"] <= 24, where
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{where} overlaps another panel"
        cells |= area
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", where
        assert p["targets"], where
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs), where
        for t in p["targets"]:
            assert isinstance(t["expr"], str) and t["expr"].strip(), where
            assert set(re.findall(r"\$\w+", t["expr"])) <= {"$model", "$__rate_interval"}
    assert len(ids) >= 10


@pytest.mark.parametrize("path", [RULES, CHART / "files" / "prometheus-rules.yaml"])
def test_promtool_checks_the_rules(path):
    promtool_check("rules", str(path))


def test_alerts_cover_the_failure_modes():
    alerts = {r["alert"]: r["expr"] for r in rules() if "alert" in r}
    assert any("acceptance_rate" in e for e in alerts.values())  # acceptance collapse
    assert any("absent(" in e for e in alerts.values())  # missing metrics
    assert any(re.search(r"\bup\b", e) for e in alerts.values())  # targets down
    assert any("fallback" in e for e in alerts.values())  # drafter fallbacks rising
    assert any("requests_waiting" in e for e in alerts.values())  # queue growth
    for r in rules():
        if "alert" in r:
            assert r["labels"]["severity"] in {"warning", "critical"}
            assert r["annotations"]["summary"]


def test_the_speculation_off_alert_fires_only_while_ready_drafters_go_unused(tmp_path):
    """promtool's rule unit test: a verifier with 0 connected drafters while the membership
    lists one fires after 1 minute; 0 connected with none listed (plain serving by
    choice) never fires; a link that heals within the minute never fires."""
    (tmp_path / "rules.yaml").write_text(RULES.read_text())
    rule = next(r for r in rules() if r.get("alert") == "ChainspecSpeculationOff")
    annotations = {"summary": "chainspec verifier verifier-0 has no drafter link while "
                              "drafters are ready",
                   "description": rule["annotations"]["description"]}
    labels = '{model_name="m", member="verifier-0"}'
    other = '{model_name="m", member="verifier-1"}'
    healed = '{model_name="m", member="verifier-2"}'
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": [
            {"series": f"chainspec_drafters_connected{labels}", "values": "0x12"},
            {"series": f"chainspec_drafters_wanted{labels}", "values": "1x12"},
            {"series": f"chainspec_drafters_connected{other}", "values": "0x12"},
            {"series": f"chainspec_drafters_wanted{other}", "values": "0x12"},
            {"series": f"chainspec_drafters_connected{healed}", "values": "0 0 1x10"},
            {"series": f"chainspec_drafters_wanted{healed}", "values": "1x12"},
        ], "alert_rule_test": [
            {"eval_time": "30s", "alertname": "ChainspecSpeculationOff", "exp_alerts": []},
            {"eval_time": "2m", "alertname": "ChainspecSpeculationOff", "exp_alerts": [
                {"exp_labels": {"severity": "critical", "model_name": "m",
                                "member": "verifier-0"}, "exp_annotations": annotations}]},
        ]}]}))
    out = subprocess.run([promtool(), "test", "rules", "test.yaml"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr

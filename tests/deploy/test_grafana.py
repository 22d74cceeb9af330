"""deploy/grafana, offline: the alert rules pass `promtool check rules` and their unit tests
(`promtool test rules`: each alert fires on the series that must fire it and not on the
others), the Kubernetes scrape configuration passes `promtool check config`, and the dashboard
is a Grafana dashboard whose every panel has a PromQL query on the datasource variable.
Debian's prometheus package (scripts/ensure-system-deps) brings promtool. The queries against
a real Prometheus and cluster: test_prometheus.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from . import scrape
from .scrape import Pod, operands

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
RULES = GRAFANA / "tspd-alerts.yml"
DASHBOARD = GRAFANA / "tspd-dashboard.json"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.fail("promtool is missing: scripts/ensure-system-deps installs Debian's prometheus")
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120, check=False)


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that shows data (rows' nested panels included)."""
    out = []
    for panel in dashboard["panels"]:
        out += list(panel.get("panels", [])) if panel["type"] == "row" else [panel]
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in panels(board) for t in p["targets"]]


def test_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 8 rules found" in checked.stdout
    tested = promtool("test", "rules", str(GRAFANA / "tspd-alerts.test.yml"))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_a_rule_that_does_not_fire_as_its_unit_test_says_fails_it(tmp_path: Path) -> None:
    # The unit tests can fail: with TspdPoolLeak's condition inverted they do, naming it.
    broken = RULES.read_text().replace(
        "tspd_node_reclaimable_pages < tspd_node_initial_free_pages",
        "tspd_node_reclaimable_pages > tspd_node_initial_free_pages",
    )
    (tmp_path / "tspd-alerts.yml").write_text(broken)
    shutil.copy(GRAFANA / "tspd-alerts.test.yml", tmp_path)
    tested = promtool("test", "rules", str(tmp_path / "tspd-alerts.test.yml"))
    assert tested.returncode == 1
    assert "alertname: TspdPoolLeak" in tested.stdout + tested.stderr


def test_the_kubernetes_scrape_job_passes_promtool(tmp_path: Path) -> None:
    # Debian's Prometheus has no Kubernetes discovery: the job is checked with static targets
    # in its place (tests/deploy/scrape.py); its relabelling runs for real in
    # test_prometheus.py.
    pods = [Pod("127.0.0.1:8100", "prefill", "http"), Pod("127.0.0.1:8998", "prefill", "bootstrap")]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(scrape.config(pods, 5)))
    checked = promtool("check", "config", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 1 rule files found" in checked.stdout


def test_every_panel_queries_the_datasource_variable() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource"]
    shown = panels(board)
    titles = [p["title"] for p in shown]
    assert len(titles) == len(set(titles)) == 18
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in shown:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert [t["refId"] for t in panel["targets"]] == [
            chr(65 + i) for i in range(len(panel["targets"]))
        ]
        for target in panel["targets"]:
            assert "tspd_" in target["expr"] or target["expr"].startswith("up{")
    # Panels tile the 24-column grid without overlapping.
    cells = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, panel["title"]
        cells |= mine


def test_operands_splits_an_alerts_expression_at_its_top_level() -> None:
    assert operands('up{job=~"a|b"} == 0') == ['up{job=~"a|b"}']
    assert operands(
        "min_over_time(x[10m]) > 0\n  and on (job, instance) increase(y_total[10m]) == 0"
    ) == ["min_over_time(x[10m])", "increase(y_total[10m])"]
    assert operands("sum(rate(a[5m])) / sum(rate(b[5m])) > 0.05") == [
        "sum(rate(a[5m])) / sum(rate(b[5m]))"
    ]
    assert operands("a < b and (c + d) == 0") == ["a", "b", "(c + d)"]

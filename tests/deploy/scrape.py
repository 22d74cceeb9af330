"""The Kubernetes scrape job of deploy/k8s/base/prometheus.yml, for a Prometheus on this
machine: its pod discovery (which Debian's Prometheus is built without) replaced by static
targets carrying the labels that discovery gives a pod, so the shipped relabelling itself
names each target's job."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRAPE = ROOT / "deploy" / "k8s" / "base" / "prometheus.yml"
RULES = ROOT / "deploy" / "grafana" / "tspd-alerts.yml"
#: The comparison and set operators an alert's expression combines its operands with.
OPERATORS = re.compile(r"\s(?:and|or|unless|>=|<=|==|!=|>|<)\s")
MODIFIER = re.compile(r"^(?:on|ignoring)\s*\([^)]*\)\s*|^bool\s+")


@dataclass(frozen=True, slots=True)
class Pod:
    """A container port as Kubernetes' pod discovery reports it."""

    address: str  #: host:port
    component: str  #: app.kubernetes.io/component
    port_name: str
    part_of: str = "tspd"

    def target(self) -> dict[str, Any]:
        meta = "__meta_kubernetes_"
        return {
            "targets": [self.address],
            "labels": {
                f"{meta}pod_label_app_kubernetes_io_part_of": self.part_of,
                f"{meta}pod_label_app_kubernetes_io_component": self.component,
                f"{meta}pod_container_port_name": self.port_name,
                f"{meta}namespace": "local",
                f"{meta}pod_name": f"{self.component}-0",
            },
        }


def config(pods: list[Pod], interval_s: float, rules: Path = RULES) -> dict[str, Any]:
    """The shipped configuration with ``pods`` for its discovery, scraped every ``interval_s``
    (rules evaluated as often), and ``rules`` as its rule file."""
    shipped = yaml.safe_load(SCRAPE.read_text())
    [job] = shipped["scrape_configs"]
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [pod.target() for pod in pods]
    every = f"{interval_s:g}s"
    job["scrape_interval"] = job["scrape_timeout"] = every
    shipped["global"] = {"scrape_interval": every, "evaluation_interval": every}
    shipped["rule_files"] = [str(rules)]
    return dict(shipped)


def operands(expr: str) -> list[str]:
    """The operands an alert's expression compares or combines, at the top level (numbers
    left out): each must return data for the alert to mean anything."""
    parts, depth, start = [], 0, 0
    flat = " ".join(expr.split())
    i = 0
    while i < len(flat):
        ch = flat[i]
        depth += ch in "([{"
        depth -= ch in ")]}"
        match = OPERATORS.match(flat, i) if depth == 0 else None
        if match:
            parts.append(flat[start:i])
            start = i = match.end()
            continue
        i += 1
    parts.append(flat[start:])
    out = []
    for part in parts:
        part = MODIFIER.sub("", part.strip())
        try:
            float(part)
        except ValueError:
            out.append(part)
    return out

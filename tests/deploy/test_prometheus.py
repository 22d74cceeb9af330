"""A real Prometheus (Debian's package) against a real cluster: `tspd-launch local --restart`
(prefill TP 2 hosting its bootstrap server, decode TP 1, router; tests/hardening/cluster.py)
scraped on loopback through the shipped Kubernetes scrape job (its relabelling names the jobs:
tests/deploy/scrape.py) with deploy/grafana's alert rules loaded. Under load — completions,
bad requests, clients that leave at once, then the decode node killed mid-load and restarted
— every dashboard panel's query and every alert's operands return finite values, no alert
fires while the cluster is healthy, and TspdRoleInterrupted fires for the decode node, and
only for it, once it is killed."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.hardening.cluster import MODEL, Cluster, wait_until

from . import scrape
from .scrape import Pod, operands
from .test_grafana import dashboard_queries

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(900)]

#: Scrape and rule-evaluation interval; also the scrape timeout. A node's /metrics asks each
#: rank for its peer's figures (up to 3 s): on a loaded 2-core machine 1 s would time out.
INTERVAL_S = 4.0
#: What the dashboard's $__rate_interval stands for here (a few scrapes).
RATE_WINDOW = "1m"
JOBS = {"tspd-router", "tspd-prefill", "tspd-decode", "tspd-bootstrap"}


class Prometheus:
    """``prometheus`` on 127.0.0.1, port 0 (the port read back from /proc), its data in a
    temporary directory."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        argv = ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={workdir / 'data'}",
                "--web.listen-address=127.0.0.1:0", "--log.level=warn"]  # fmt: skip
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        port = 0

        def listening() -> bool:
            nonlocal port
            assert self.proc.poll() is None, (workdir / "prometheus.log").read_text()
            port = listening_port(self.proc.pid)
            return port > 0

        wait_until(listening, 60, "prometheus to listen")
        self.url = f"http://127.0.0.1:{port}"
        wait_until(lambda: self._ready(), 60, "prometheus to be ready")

    def _ready(self) -> bool:
        try:
            return requests.get(self.url + "/-/ready", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """``promql``'s instant vector now (or at the Unix time ``at``)."""
        params = {"query": promql} | ({} if at is None else {"time": f"{at:.3f}"})
        resp = requests.get(self.url + "/api/v1/query", params=params, timeout=30)
        body = resp.json()
        assert body["status"] == "success", (promql, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def firing(self) -> list[dict[str, str]]:
        """The labels of every firing alert."""
        body = requests.get(self.url + "/api/v1/alerts", timeout=30).json()
        return [a["labels"] for a in body["data"]["alerts"] if a["state"] == "firing"]

    def targets(self) -> list[dict[str, Any]]:
        body = requests.get(self.url + "/api/v1/targets", timeout=30).json()
        active: list[dict[str, Any]] = body["data"]["activeTargets"]
        return active

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def listening_port(pid: int) -> int:
    """The TCP port ``pid`` listens on (0 while none)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                return int(fields[1].rsplit(":", 1)[1], 16)
    return 0


def alert_rules() -> Iterator[tuple[str, str]]:
    for group in yaml.safe_load(scrape.RULES.read_text())["groups"]:
        for rule in group["rules"]:
            yield rule["alert"], rule["expr"]


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def leave_mid_request(cluster: Cluster, n: int) -> None:
    """``n`` completions whose clients close their connections once the router has sent each
    to a node; returns once the router counted them (499 ``client_gone``)."""
    url = cluster.urls["router"]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": MODEL, "prompt": "a client that leaves", "max_tokens": 400})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
               f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}")  # fmt: skip
    gone = 'tspd_router_errors_total{cause="client_gone"}'
    before = cluster.router_metric(gone)
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(n)]
    try:
        for sock in socks:
            sock.sendall(request.encode())
        wait_until(lambda: metric_sum(url, "tspd_router_in_flight{") >= n, 60,
                   f"the router to send the {n} requests on")  # fmt: skip
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: cluster.router_metric(gone) == before + n, 60, "the router to count them")


def metric_sum(url: str, family: str) -> float:
    """The sum of a family's samples in ``url``'s /metrics (``family`` with its ``{``)."""
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(family))  # fmt: skip


def test_the_dashboard_and_alerts_on_a_real_prometheus(tmp_path: Path) -> None:
    cluster = Cluster.start("--max-queued-requests", "64", "--waiting-timeout", "8")
    prom: Prometheus | None = None
    try:
        [boot] = cluster.said(r"^\s+bootstrap http://\S+ \(served by the prefill node\)")
        bootstrap = boot.split()[1]
        pods = [
            Pod(cluster.urls["router"].removeprefix("http://"), "router", "http"),
            Pod(cluster.urls["prefill"].removeprefix("http://"), "prefill", "http"),
            Pod(bootstrap.removeprefix("http://"), "prefill", "bootstrap"),
            Pod(cluster.urls["decode"].removeprefix("http://"), "decode", "http"),
            # Dropped by the shipped relabelling: another app's pod, a port not named for us.
            Pod("127.0.0.1:9", "router", "http", part_of="another-app"),
            Pod("127.0.0.1:10", "prefill", "grpc"),
        ]
        prom = p = Prometheus(scrape.config(pods, INTERVAL_S), tmp_path)
        # The relabelling named one target per role's port, and dropped the other two.
        wait_until(lambda: len(p.targets()) >= 4, 60, "prometheus to take its targets in")
        jobs = sorted((t["labels"]["job"], t["scrapeUrl"]) for t in p.targets())
        assert jobs == sorted(
            [
                ("tspd-router", cluster.urls["router"] + "/metrics"),
                ("tspd-prefill", cluster.urls["prefill"] + "/metrics"),
                ("tspd-bootstrap", bootstrap + "/metrics"),
                ("tspd-decode", cluster.urls["decode"] + "/metrics"),
            ]
        )
        wait_until(
            lambda: {r["metric"]["job"] for r in p.query("up == 1")} == JOBS,
            120,
            "every role to be scraped",
        )

        # Load: completions, requests the router refuses, clients that leave at once.
        def complete(i: int) -> int:
            return cluster.complete(f"prompt number {i} of the load", 16).status_code

        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(complete, range(24)))
        assert codes == [200] * 24
        bad = {"model": MODEL, "prompt": "x", "max_tokens": -1}
        for _ in range(3):
            resp = requests.post(cluster.urls["router"] + "/v1/completions", json=bad, timeout=30)
            assert resp.status_code == 400
        leave_mid_request(cluster, 3)
        # Healthy under load: no alert fires (the clients' own errors are not the cluster's).
        wait_until(
            lambda: bool(p.query('tspd_router_errors_total{cause="bad_request"}')),
            60,
            "a scrape after the load",
        )
        assert p.firing() == []

        # The decode node killed mid-load: --restart brings it back on its port.
        decode = cluster.role_pid("decode")
        stop = threading.Event()
        statuses: list[int] = []

        def keep_loading() -> None:
            i = 0
            while not stop.is_set() and i < 200:
                try:
                    statuses.append(complete(1000 + i))
                except requests.RequestException:
                    statuses.append(0)
                i += 1

        loader = threading.Thread(target=keep_loading, daemon=True)
        loader.start()
        wait_until(lambda: len(statuses) >= 2, 120, "load on the cluster")
        os.kill(decode, signal.SIGKILL)

        def interrupted() -> list[dict[str, str]]:
            return [a for a in p.firing() if a["alertname"] == "TspdRoleInterrupted"]

        fired_s = wait_until(lambda: bool(interrupted()), 120, "TspdRoleInterrupted to fire")
        print(f"TspdRoleInterrupted fired {fired_s:.1f} s after the decode node was killed")
        assert [(a["job"], a["instance"]) for a in interrupted()] == [
            ("tspd-decode", cluster.urls["decode"].removeprefix("http://"))
        ]
        wait_until(lambda: bool(cluster.said(r"decode restarted in")), 300, "decode's restart")
        wait_until(cluster.answers_known, 120, "the cluster to serve again")
        stop.set()
        loader.join(120)
        assert 200 in statuses

        # A room whose KV never comes: a decode-only request naming a room no prefill node
        # serves fails on D at its --waiting-timeout (cause timeout), as a room does whose
        # prefill side is lost; the room failure panel and alert have their data.
        orphan = {"text": "an orphan room", "max_tokens": 4, "rid": "orphan-room",
                  "pd": {"room": 12345, "bootstrap_host": bootstrap.split("//")[1].split(":")[0],
                         "bootstrap_port": int(bootstrap.rsplit(":", 1)[1])}}  # fmt: skip
        failed = requests.post(cluster.urls["decode"] + "/generate", json=orphan, timeout=120)
        assert failed.status_code == 503
        assert (failed.json()["finish_reason"], failed.json()["error"]) == (
            "transfer", "KV transfer failed: no Success from P ranks [0, 1] in 8 s")  # fmt: skip

        # Fresh load, then every panel's query and every alert's operands as Prometheus saw
        # the cluster once it had scraped that load (rates over the last minute).
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, range(2000, 2016))) == [200] * 16
        answered = metric_sum(cluster.urls["router"], "tspd_router_requests_total{")
        scraped = 'sum(tspd_router_requests_total{job="tspd-router"})'
        wait_until(lambda: finite(p.query(scraped)) and float(p.query(scraped)[0]["value"][1])
                   == answered, 60, "prometheus to scrape the fresh load")  # fmt: skip
        queries = [(title, q.replace("$__rate_interval", RATE_WINDOW)) for title, q in
                   dashboard_queries()]  # fmt: skip
        queries += [(name, operand) for name, expr in alert_rules() for operand in operands(expr)]
        empty = queries

        def all_answer() -> bool:
            # A counter's rate needs two samples in its window: the room failure's counter
            # appeared with that failure, a scrape or two ago. The load's rates stay for the
            # minute of RATE_WINDOW.
            nonlocal empty
            empty = [(name, q) for name, q in queries if not finite(p.query(q))]
            return not empty

        try:
            wait_until(all_answer, 40, "every query to return data")
        except AssertionError:
            raise AssertionError(f"queries without a finite value: {empty}") from None
    finally:
        if prom is not None:
            prom.stop()
        assert cluster.stop() == 0

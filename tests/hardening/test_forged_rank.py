"""Issue 35 item 2: one anonymous ``PUT /route`` hijacked a cluster. Performed against real
clusters (``launch_pd.py local``: prefill node at TP 2 hosting its bootstrap server, decode node
at TP 1, router; KV over Mooncake TCP):

* the forged registration (engine_rank 0, the layout read from ``GET /route?...=-1``, a real
  ZMQ PULL socket as its address) is refused with a 409 naming the holder, counted, and the
  registry is unchanged; D never contacts the forger and the known prompt keeps its exact text;
* D does not trust its cache forever: with the admin route an operator puts a wrong address in
  place (the forger's), D finds it only once a room failed (its cached address was dropped),
  the forger sees D's registration, and once the operator removes it, D looks rank 0 up again
  and answers exactly, without a restart;
* with the cluster credential, unsealed ``PUT``/``GET /route`` are 401s, a forged ZMQ
  registration to a prefill rank (unsealed, or sealed with another secret) is dropped and
  counted, and the cluster answers exactly throughout.

The last two wait out PD timeouts or build a cluster of their own (~38 s together): they are
heavy, so the README's test command leaves them to `nox -s faults`, which CI runs (it runs this
whole module). tests/pd/test_credential.py checks the credential on the peers in the README's run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import zmq

from tspd_bootstrap import BootstrapClient, ClusterCredential
from tspd_core.pd.wire.frames import Registration, encode_registration, seal_frames

from .cluster import KNOWN, Cluster, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

#: PD timeouts short enough that a room with a wrong P address ends within a test.
FLAGS = ("--bootstrap-timeout", "6", "--waiting-timeout", "7")
TOKEN = "hardening cluster token 0123456789abcdef"
LEASE_S = 20  # tspd_bootstrap.registry.DEFAULT_LEASE_S


@pytest.fixture(scope="module")
def plain() -> Iterator[Cluster]:
    """A cluster without the credential, its bootstrap server's admin route on."""
    started = Cluster.start(*FLAGS, "--bootstrap-admin")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def sealed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster with the credential (a token file, as an operator would give it)."""
    path = tmp_path_factory.mktemp("credential") / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    started = Cluster.start(*FLAGS, "--cluster-token-file", str(path))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def forger() -> Iterator[tuple[zmq.Socket[bytes], int]]:
    """A real ZMQ PULL socket: where a forged rank 0 would have D send its messages."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, port
    sock.close(linger=0)


def _bootstrap(cluster: Cluster) -> str:
    address = requests.get(cluster.urls["prefill"] + "/info", timeout=10).json()["bootstrap"]
    return f"http://{address}"


def _forged_body(url: str, port: int, headers: dict[str, str] | None = None) -> bytes:
    """What the attack sends: rank 0 at the forger, with the deployment's own layout."""
    info = requests.get(f"{url}/route?engine_rank=-1&target_dp_group=-1", headers=headers,
                        timeout=10).json()  # fmt: skip
    body = {
        "role": "Prefill",
        "world_size": info["prefill_tp_size"],
        "dp_size": info["prefill_dp_size"],
        "rank_ip": "127.0.0.1",
        "rank_port": port,
        "engine_rank": 0,
        "cache_layout": info["cache_layout"],
        "tspd_extensions": ["tspd.stage/2"],  # so that D would also offer it staging slots
    }
    return json.dumps(body).encode()


def _metric(url: str, sample: str) -> float:
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _answers_known(cluster: Cluster, times: int = 3) -> None:
    for _ in range(times):
        resp = cluster.complete(KNOWN, 8)
        assert resp.status_code == 200, resp.text[:300]
        assert resp.json()["choices"][0]["text"] == cluster.known


def _drain(sock: zmq.Socket[bytes]) -> list[list[bytes]]:
    got = []
    while sock.poll(0):
        got.append(sock.recv_multipart())
    return got


HELD = 'tspd_bootstrap_errors_total{status="409",reason="rank_held"}'


def test_a_forged_registration_is_refused_and_d_never_contacts_the_forger(
    plain: Cluster, forger: tuple[zmq.Socket[bytes], int]
) -> None:
    sock, port = forger
    url = _bootstrap(plain)
    _answers_known(plain, times=1)  # whether or not D had rank 0 cached before
    before = requests.get(url + "/ranks", timeout=10).json()
    holder = before["ranks"][0]
    refused_before = _metric(url, HELD)
    resp = requests.put(url + "/route", data=_forged_body(url, port), timeout=10)
    assert resp.status_code == 409
    assert resp.json() == {
        "status": 409,
        "error": "rank_held",
        "message": f"engine_rank 0 is registered at {holder['rank_ip']}:{holder['rank_port']}, "
        f"which renews its lease (it lapses {LEASE_S} s after the last renewal); "
        f"127.0.0.1:{port} may take it over only once that lease lapses, after an operator's "
        "DELETE /ranks/0, or with the cluster credential",
    }
    assert 1 <= int(resp.headers["Retry-After"]) <= LEASE_S
    assert _metric(url, HELD) == refused_before + 1
    after = requests.get(url + "/ranks", timeout=10).json()
    assert [(r["rank_ip"], r["rank_port"]) for r in after["ranks"]] == [
        (r["rank_ip"], r["rank_port"]) for r in before["ranks"]
    ]
    _answers_known(plain)
    assert not sock.poll(1000)  # D sent the forger nothing: no registration, offer, manifest
    wait_until(plain.pools_whole, 30, "both pools whole")


@pytest.mark.heavy
def test_d_looks_rank_0_up_again_once_its_rooms_fail(
    plain: Cluster, forger: tuple[zmq.Socket[bytes], int]
) -> None:
    sock, port = forger
    url = _bootstrap(plain)
    _answers_known(plain, times=1)  # D has rank 0's real address cached
    real = requests.get(url + "/ranks", timeout=10).json()["ranks"][0]
    for _ in range(5):  # the operator's wrong address (the real rank renews every 5 s)
        assert requests.delete(url + "/ranks/0", timeout=10).json() == {"removed": 1}
        put = requests.put(url + "/route", data=_forged_body(url, port), timeout=10)
        if put.status_code == 200:
            break
    assert (put.status_code, put.text) == (200, "OK")
    # D keeps its cached address until a room fails: a decode room nothing prefills for
    # times out (--waiting-timeout), and D forgets rank 0 and 1's addresses.
    host, _, boot_port = url.removeprefix("http://").rpartition(":")
    orphan = {"room": 35_000_002, "bootstrap_host": host, "bootstrap_port": int(boot_port)}
    body = {"input_ids": [104, 105], "max_tokens": 1, "pd": orphan}
    resp = requests.post(plain.urls["decode"] + "/generate", json=body, timeout=60)
    assert resp.status_code == 503, resp.text[:300]
    assert not sock.poll(0)  # nothing for the forger yet: D used its cache
    # The next request looks rank 0 up: the wrong address. Its room fails (P's bootstrap
    # timeout), and the forger got what D sends a P rank: the registration first.
    failed = plain.complete(KNOWN, 8, timeout=120)
    assert failed.status_code == 502, failed.text[:300]
    assert failed.json()["error"]["code"] == "transfer_failed"
    # What D sent the address it was given: its registration, a staging offer (the entry
    # announced tspd.stage/2) and the room's pre-allocation (with its manifest).
    got = _drain(sock)
    assert [(len(m), m[0]) for m in got[:2]] == [(8, b"None"), (6, b"tspd.stage/2")]
    assert [len(m) for m in got] == [8, 6, 3]
    # The operator removes the wrong address; the real rank 0 renews within 5 s.
    assert requests.delete(url + "/ranks/0", timeout=10).json() == {"removed": 1}

    def restored() -> bool:
        ranks = requests.get(url + "/ranks", timeout=10).json()["ranks"]
        return bool(ranks) and ranks[0]["rank_port"] == real["rank_port"]

    wait_until(restored, 15, "rank 0's renewal")
    _answers_known(plain)  # D looked rank 0 up again: no restart
    assert _drain(sock) == []
    wait_until(plain.pools_whole, 60, "both pools whole")


def _refused_seals(cluster: Cluster, reason: str) -> float:
    text = requests.get(cluster.urls["prefill"] + "/metrics", timeout=10).text
    pattern = re.compile(
        r'^tspd_pd_refused_seals_total\{.*message="registration".*reason="' + reason + r'".*\} '
    )
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if pattern.match(x))


@pytest.mark.heavy
def test_with_the_credential_nothing_unsealed_gets_in(
    sealed: Cluster, forger: tuple[zmq.Socket[bytes], int]
) -> None:
    sock, port = forger
    url = _bootstrap(sealed)
    credential = ClusterCredential.from_text(TOKEN)
    for method, path in (("PUT", "/route"), ("GET", "/route?engine_rank=-1&target_dp_group=-1"),
                         ("GET", "/route?engine_rank=0&target_dp_group=0")):  # fmt: skip
        resp = requests.request(method, url + path, data=b"{}" if method == "PUT" else None,
                                timeout=10)  # fmt: skip
        assert (resp.status_code, resp.json()) == (401, {
            "status": 401,
            "error": "unauthenticated",
            "message": f"{method} /route: this bootstrap server requires the cluster "
            "credential: the request carries no 'Authorization: TSPD-HMAC-SHA256 ...' seal",
        })  # fmt: skip
    _answers_known(sealed)
    with BootstrapClient(url, credential=credential) as client:
        p0 = client.list_ranks().ranks[0]
        assert "tspd.auth/1" in p0.extensions
        info = client.parallel_info()
    assert info is not None
    assert info.cache_layout is not None
    # A forged D registration straight to P rank 0's control socket, as the forger.
    registration = encode_registration(
        Registration("127.0.0.1", port, "127.0.0.1:9", 1 << 40, info.cache_layout.encode(), 1, 0)
    )
    other = ClusterCredential.from_text("not this cluster's token 0123456789")
    push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(f"tcp://{p0.rank_ip}:{p0.rank_port}")
    try:
        unsealed, bad = _refused_seals(sealed, "unsealed"), _refused_seals(sealed, "bad_seal")
        push.send_multipart(registration)
        push.send_multipart(seal_frames(registration, other))
        wait_until(lambda: _refused_seals(sealed, "unsealed") == unsealed + 1, 20, "unsealed")
        wait_until(lambda: _refused_seals(sealed, "bad_seal") == bad + 1, 20, "bad seal")
    finally:
        push.close(linger=0)
    _answers_known(sealed)
    assert not sock.poll(500)  # P pushed the forger nothing: its session was never taken
    wait_until(sealed.pools_whole, 30, "both pools whole")
    # The token reached the roles through the file and the environment, never an argv.
    for pid in [sealed.proc.pid, *(sealed.role_pid(r) for r in ("prefill", "decode"))]:
        assert TOKEN not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")

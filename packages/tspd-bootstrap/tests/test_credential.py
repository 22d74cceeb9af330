"""The cluster credential: loading it, its seals, and a real server that requires them."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tspd_bootstrap import (
    BootstrapClient,
    BootstrapServer,
    BootstrapUnauthorized,
    ClusterCredential,
    CredentialConfigError,
    CredentialError,
    ParallelInfo,
    RankAddress,
)
from tspd_bootstrap.auth import (
    FRAMES_DOMAIN,
    HTTP_DOMAIN,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    WINDOW_S,
    ReplayGuard,
    Seal,
    sign_request,
)

TOKEN = "0123456789abcdef0123456789abcdef"
CRED = ClusterCredential.from_text(TOKEN)
OTHER = ClusterCredential.from_text("another cluster's secret, 36 bytes!")


# ---- loading ------------------------------------------------------------------------------


def test_the_credential_comes_from_a_flag_a_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n\nignored second line\n")
    assert ClusterCredential.resolve(token=TOKEN, env={}) == CRED
    assert ClusterCredential.resolve(token_file=path, env={}) == CRED
    assert ClusterCredential.resolve(env={TOKEN_ENV: TOKEN + "\n"}) == CRED
    assert ClusterCredential.resolve(env={TOKEN_FILE_ENV: str(path)}) == CRED
    assert ClusterCredential.resolve(env={}) is None
    assert ClusterCredential.resolve(token=TOKEN, env={TOKEN_ENV: "x"}) == CRED  # flags win
    assert TOKEN not in repr(CRED)
    assert repr(CRED) == f"ClusterCredential(fingerprint={CRED.fingerprint})"
    assert len(CRED.fingerprint) == 8
    assert CRED.fingerprint != OTHER.fingerprint


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"token": "short"}, "the cluster token is 5 bytes; it must be 16..4096"),
        ({"token": TOKEN, "token_file": "x"}, "give the cluster token or its file, not both"),
        (
            {"env": {TOKEN_ENV: TOKEN, TOKEN_FILE_ENV: "x"}},
            f"set {TOKEN_ENV} or {TOKEN_FILE_ENV}, not both",
        ),
        ({"token_file": "/nonexistent/token"}, "cannot read the cluster token file"),
    ],
)
def test_an_unusable_credential_is_refused_with_the_reason(
    kwargs: dict[str, object], why: str
) -> None:
    with pytest.raises(CredentialConfigError, match=why) as info:
        ClusterCredential.resolve(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


# ---- seals --------------------------------------------------------------------------------


def test_a_seal_verifies_only_its_own_content_domain_and_secret() -> None:
    parts = [b"None", b"10.0.0.1", b"5555"]
    now = time.time()
    seal = CRED.seal(FRAMES_DOMAIN, parts, now)
    assert CRED.check(FRAMES_DOMAIN, parts, seal.text, now) == seal
    assert CRED.seal(FRAMES_DOMAIN, parts, now).nonce != seal.nonce  # fresh every time
    altered = [b"None", b"10.0.0.1", b"5556"]
    split = [b"None", b"10.0.0.15", b"555"]  # same bytes, other boundaries
    for domain, content, who in (
        (FRAMES_DOMAIN, altered, CRED),
        (FRAMES_DOMAIN, split, CRED),
        (HTTP_DOMAIN, parts, CRED),
        (FRAMES_DOMAIN, parts, OTHER),
    ):
        with pytest.raises(CredentialError, match="the seal does not verify") as info:
            who.check(domain, content, seal.text, now)
        assert info.value.code == "bad_seal"
    with pytest.raises(CredentialError, match=re.escape("not <seconds>.<32 hex>.<64 hex>")):
        CRED.check(FRAMES_DOMAIN, parts, seal.text + "0", now)


def test_a_seal_goes_stale_and_is_admitted_once() -> None:
    now = 1_700_000_000.0
    seal = CRED.seal(HTTP_DOMAIN, [b"x"], now)
    CRED.check(HTTP_DOMAIN, [b"x"], seal.text, now + WINDOW_S)
    with pytest.raises(CredentialError, match="made 61 s from now") as late:
        CRED.check(HTTP_DOMAIN, [b"x"], seal.text, now + WINDOW_S + 1)
    assert late.value.code == "stale_seal"
    with pytest.raises(CredentialError, match="made -61 s from now"):
        CRED.check(HTTP_DOMAIN, [b"x"], seal.text, now - WINDOW_S - 1)
    guard = ReplayGuard()
    guard.admit(seal, now)
    with pytest.raises(CredentialError, match="used already") as again:
        guard.admit(seal, now + 30)
    assert again.value.code == "replayed_seal"
    other = CRED.seal(HTTP_DOMAIN, [b"x"], now + 62)
    guard.admit(other, now + 62)  # the first one's window has passed: it was forgotten
    assert len(guard) == 1


def test_the_replay_guard_is_bounded() -> None:
    guard = ReplayGuard(capacity=3)
    seals = [Seal(100, f"{i:032x}", "0" * 64) for i in range(4)]
    for seal in seals:
        guard.admit(seal, 100.0)
    assert len(guard) == 3
    guard.admit(seals[0], 100.0)  # the oldest was dropped to make room
    with pytest.raises(CredentialError):
        guard.admit(seals[3], 100.0)


# ---- a server that requires it ------------------------------------------------------------


@pytest.fixture
def sealed_server() -> Iterator[BootstrapServer]:
    with BootstrapServer("127.0.0.1", 0, allow_admin=True, credential=CRED) as srv:
        yield srv


def body(rank: int, port: int, layout: str) -> bytes:
    reg = {
        "role": "Prefill",
        "world_size": 2,
        "dp_size": 1,
        "rank_ip": "127.0.0.1",
        "rank_port": port,
        "engine_rank": rank,
        "cache_layout": layout,
    }
    return json.dumps(reg).encode()


def refusal(method: str, path: str, code: str, message: str) -> dict[str, object]:
    return {"status": 401, "error": code, "message": f"{method} {path}: {message}"}


UNSEALED = (
    "this bootstrap server requires the cluster credential: the request carries no "
    "'Authorization: TSPD-HMAC-SHA256 ...' seal"
)


def test_unsealed_requests_are_refused_and_sealed_ones_served(
    sealed_server: BootstrapServer, layout: str
) -> None:
    url = sealed_server.url
    info = "/route?engine_rank=-1&target_dp_group=-1"
    for method, path in (
        ("PUT", "/route"),
        ("GET", info),
        ("GET", "/route?engine_rank=0&target_dp_group=0"),
        ("GET", "/ranks"),
        ("DELETE", "/ranks"),
        ("DELETE", "/ranks/0"),
    ):
        data = body(0, 30000, layout) if method == "PUT" else None
        resp = requests.request(method, url + path, data=data, timeout=5)
        shown = path.split("?")[0]
        assert (resp.status_code, resp.json()) == (401, refusal(method, shown, "unauthenticated",
                                                                UNSEALED))  # fmt: skip
        assert resp.headers["WWW-Authenticate"] == "TSPD-HMAC-SHA256"
    assert sealed_server.snapshot().ranks == ()
    for path in ("/health", "/metrics"):  # monitoring stays open
        assert requests.get(url + path, timeout=5).status_code == 200
    with BootstrapClient(url, credential=CRED) as client:
        for rank in range(2):
            client.register_rank(
                engine_rank=rank,
                world_size=2,
                dp_size=1,
                rank_ip="127.0.0.1",
                rank_port=30000 + rank,
                cache_layout=layout,
            )
        assert client.parallel_info() == ParallelInfo(2, 1, layout)
        assert client.rank_address(1, 0) == RankAddress("127.0.0.1", 30001)
        # Sealed: a restarted rank takes its engine rank over from its old address at once.
        client.register_rank(
            engine_rank=1,
            world_size=2,
            dp_size=1,
            rank_ip="127.0.0.1",
            rank_port=30101,
            cache_layout=layout,
        )
        assert client.rank_address(1, 0) == RankAddress("127.0.0.1", 30101)
        assert len(client.list_ranks().ranks) == 2
        client.deregister_rank(1)
    text = requests.get(url + "/metrics", timeout=5).text
    assert 'tspd_bootstrap_errors_total{status="401",reason="unauthenticated"} 6\n' in text
    assert 'tspd_bootstrap_replacements_total{how="credential"} 1\n' in text


def test_bad_stale_and_replayed_seals_are_refused(
    sealed_server: BootstrapServer, layout: str
) -> None:
    url = sealed_server.url
    data = body(0, 30000, layout)

    def put(header: str, payload: bytes = data) -> requests.Response:
        headers = {"Authorization": header}
        return requests.put(url + "/route", data=payload, headers=headers, timeout=5)

    wrong = put(sign_request(OTHER, "PUT", "/route", data))
    message = "the seal does not verify: another cluster token, or altered content"
    assert (wrong.status_code, wrong.json()) == (401, refusal("PUT", "/route", "bad_seal",
                                                              message))  # fmt: skip
    moved = body(0, 39999, layout)  # a seal of one body does not cover another
    assert put(sign_request(CRED, "PUT", "/route", data), moved).json()["error"] == "bad_seal"
    old = CRED.seal(HTTP_DOMAIN, [b"PUT", b"/route", hashlib.sha256(data).digest()], 1e9)
    stale = put(f"TSPD-HMAC-SHA256 {old.text}")
    assert (stale.status_code, stale.json()["error"]) == (401, "stale_seal")
    assert put("Bearer x").json()["message"] == (
        "PUT /route: the Authorization header is not 'TSPD-HMAC-SHA256 <seal>'"
    )
    fresh = sign_request(CRED, "PUT", "/route", data)
    assert put(fresh).status_code == 200
    replayed = put(fresh)
    assert (replayed.status_code, replayed.json()) == (401, refusal("PUT", "/route",
        "replayed_seal", "this seal was used already (a replay)"))  # fmt: skip
    # A look-up changes nothing: the same sealed GET may be sent again.
    path = "/route?engine_rank=-1&target_dp_group=-1"
    header = {"Authorization": sign_request(CRED, "GET", path)}
    for _ in range(2):
        assert requests.get(url + path, headers=header, timeout=5).status_code == 200
    assert [e.rank_port for e in sealed_server.snapshot().ranks] == [30000]


def test_the_client_reports_a_refused_seal_and_is_ignored_without_one(layout: str) -> None:
    with BootstrapServer("127.0.0.1", 0, credential=CRED) as server:
        with BootstrapClient(server.url, retries=0) as bare:
            with pytest.raises(BootstrapUnauthorized, match="401 unauthenticated: ") as info:
                bare.parallel_info()
            assert (info.value.status, info.value.code) == (401, "unauthenticated")
        with (
            BootstrapClient(server.url, retries=0, credential=OTHER) as wrong,
            pytest.raises(BootstrapUnauthorized, match="401 bad_seal: "),
        ):
            wrong.parallel_info()
    # A server without a credential (or TokenSpeed's) ignores the seal.
    with (
        BootstrapServer("127.0.0.1", 0) as plain,
        BootstrapClient(plain.url, credential=CRED) as client,
    ):
        client.register_rank(
            engine_rank=0,
            world_size=1,
            dp_size=1,
            rank_ip="127.0.0.1",
            rank_port=30000,
            cache_layout=layout,
        )
        assert client.rank_address(0, 0) == RankAddress("127.0.0.1", 30000)

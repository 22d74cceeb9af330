"""The Prometheus exposition, rendered exactly."""

from __future__ import annotations

from tspd_bootstrap.metrics import Gauges, Metrics
from tspd_bootstrap.model import Role, ServerKind


def test_render_is_exact_for_a_scripted_history() -> None:
    metrics = Metrics(ServerKind.EMBEDDING, started=1700000000.5, version="0.1.0")
    metrics.registered(Role.ENCODE, again=False, redeployed=False)
    metrics.registered(Role.ENCODE, again=True, redeployed=True)
    metrics.registered(Role.PREFILL, again=False, redeployed=False)
    metrics.looked_up("parallel_info", hit=True)
    metrics.looked_up("rank", hit=False)
    metrics.looked_up("rank", hit=False)
    metrics.refused(409, "deployment_conflict")
    metrics.refused(400, "bad_json")
    metrics.refused(400, "bad_json")
    metrics.deregistrations += 2
    metrics.replaced("credential")
    text = metrics.render(Gauges(registered=2, expected=4, complete=False))
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert samples == [
        'tspd_bootstrap_registrations_total{role="Prefill"} 1',
        'tspd_bootstrap_registrations_total{role="Encode"} 2',
        "tspd_bootstrap_reregistrations_total 1",
        'tspd_bootstrap_replacements_total{how="lease_lapsed"} 0',
        'tspd_bootstrap_replacements_total{how="credential"} 1',
        "tspd_bootstrap_redeployments_total 1",
        "tspd_bootstrap_deregistrations_total 2",
        'tspd_bootstrap_lookups_total{kind="parallel_info",result="hit"} 1',
        'tspd_bootstrap_lookups_total{kind="parallel_info",result="miss"} 0',
        'tspd_bootstrap_lookups_total{kind="rank",result="hit"} 0',
        'tspd_bootstrap_lookups_total{kind="rank",result="miss"} 2',
        'tspd_bootstrap_errors_total{status="400",reason="bad_json"} 2',
        'tspd_bootstrap_errors_total{status="409",reason="deployment_conflict"} 1',
        "tspd_bootstrap_registered_ranks 2",
        "tspd_bootstrap_expected_ranks 4",
        "tspd_bootstrap_deployment_complete 0",
        "tspd_bootstrap_start_time_seconds 1700000000.5",
        'tspd_bootstrap_info{kind="embedding",version="0.1.0"} 1',
    ]
    assert text.endswith("\n")


def test_every_family_has_help_and_type_before_its_samples() -> None:
    text = Metrics(ServerKind.KV, 0.0, "v").render(Gauges(0, 0, False))
    lines = text.splitlines()
    families = [line.split()[2] for line in lines if line.startswith("# TYPE")]
    assert len(families) == len(set(families)) == 12
    for family in families:
        help_at = lines.index(next(x for x in lines if x.startswith(f"# HELP {family} ")))
        assert lines[help_at + 1].startswith(f"# TYPE {family} ")
        has_sample = lines[help_at + 2].startswith(family) if help_at + 2 < len(lines) else False
        # errors_total has no sample until something is refused; every other family has one
        assert has_sample == (family != "tspd_bootstrap_errors_total")
    assert 'tspd_bootstrap_registrations_total{role="Encode"}' not in text  # KV: Prefill only

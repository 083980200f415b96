"""Routing policies over replica loads."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servelm.router.policies import ReplicaLoad, RouteRequest, make_policy, policy_names


def _load(tokens=0, healthy=True, kv=0.0):
    return ReplicaLoad(0, 0, tokens, kv, healthy)


def test_round_robin_takes_turns_and_skips_the_unhealthy():
    rr = make_policy("round_robin")
    loads = [_load(), _load(healthy=False), _load()]
    assert [rr.pick(loads, RouteRequest()) for _ in range(4)] == [0, 2, 0, 2]
    with pytest.raises(RuntimeError, match="no healthy"):
        rr.pick([_load(healthy=False)], RouteRequest())


def test_least_loaded_counts_tokens_then_kv_usage():
    ll = make_policy("least_loaded")
    assert ll.pick([_load(500), _load(20), _load(30)], RouteRequest()) == 1
    assert ll.pick([_load(20, kv=0.5), _load(20, kv=0.1)], RouteRequest()) == 1
    assert ll.pick([_load(0, healthy=False), _load(900)], RouteRequest()) == 1


@given(users=st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=40, unique=True),
       gone=st.integers(0, 3))
def test_session_is_sticky_and_a_lost_replica_moves_only_its_sessions(users, gone):
    s = make_policy("session")
    loads = [_load() for _ in range(4)]
    before = {u: s.pick(loads, RouteRequest(10, u)) for u in users}
    assert before == {u: s.pick(loads, RouteRequest(10, u)) for u in users}  # sticky
    loads[gone] = _load(healthy=False)
    after = {u: s.pick(loads, RouteRequest(10, u)) for u in users}
    for u in users:
        assert after[u] != gone
        if before[u] != gone:
            assert after[u] == before[u]  # rendezvous: only the lost replica's users move


def _cached(tokens, cached, healthy=True):
    return ReplicaLoad(0, 0, tokens, 0.0, healthy, cached)


def test_prefix_affinity_follows_the_cache_until_load_outweighs_it():
    pa = make_policy("prefix_affinity")
    assert pa.pick([_cached(1000, 0), _cached(1200, 2000)], RouteRequest(200)) == 1
    assert pa.pick([_cached(1000, 0), _cached(1200, 0)], RouteRequest(200)) == 0
    assert pa.pick([_cached(1000, 0), _cached(1200, 90)], RouteRequest(200)) == 0  # 90 < 0.5 x 200
    # Cache on a replica far above the mean: the bound keeps the request off it.
    assert pa.pick([_cached(0, 0), _cached(5000, 4000)], RouteRequest(100)) == 0
    # An idle fleet: the cache decides (capacity counts load before the request).
    assert pa.pick([_cached(0, 0), _cached(0, 160)], RouteRequest(300)) == 1


@given(loads=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 8192), st.booleans()),
                      min_size=1, max_size=8),
       need=st.integers(1, 3000), eps=st.sampled_from([0.1, 0.25, 0.5]))
def test_prefix_affinity_never_picks_a_replica_at_or_over_capacity(loads, need, eps):
    from servelm.router.policies import PrefixAffinity

    view = [_cached(t, c, h) for t, c, h in loads]
    healthy = [i for i, x in enumerate(view) if x.is_healthy]
    if not healthy:
        return
    i = PrefixAffinity(epsilon=eps).pick(view, RouteRequest(need))
    assert view[i].is_healthy
    cap = (1 + eps) * (sum(view[j].num_tokens_in_flight for j in healthy) + need) / len(healthy)
    assert any(view[j].num_tokens_in_flight < cap for j in healthy)  # the least loaded is
    assert view[i].num_tokens_in_flight < cap  # so the pick ends at most one request above cap


def test_unknown_policy_is_refused_by_name():
    assert {"round_robin", "least_loaded", "session", "prefix_affinity"} <= set(policy_names())
    with pytest.raises(ValueError, match="routing policy 'nope' is unknown"):
        make_policy("nope")


def test_least_busy_counts_requests_then_routed_then_index():
    lb = make_policy("least_busy")
    busy = [ReplicaLoad(0, 0, 0, 0.0, True, 0, n, r) for n, r in ((2, 0), (1, 9), (1, 3))]
    assert lb.pick(busy, RouteRequest()) == 2  # fewest in flight, then fewest routed
    tied = [ReplicaLoad(0, 0, 0, 0.0, h, 0, 0, 0) for h in (False, True, True)]
    assert lb.pick(tied, RouteRequest()) == 1
    with pytest.raises(RuntimeError, match="no healthy"):
        lb.pick([ReplicaLoad(0, 0, 0, 0.0, False)], RouteRequest())


def _parse(argv: list[str]):
    from servelm.cli import build_parser

    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("argv, dest", [
    (["router", "--replica", "http://a"], "policy"),
    (["serve"], "router_policy"),
    (["sim"], "policy"),
])
def test_every_command_defaults_to_the_registrys_policy(argv, dest):
    from servelm.router.policies import DEFAULT_POLICY

    assert getattr(_parse(argv), dest) == DEFAULT_POLICY
    # ...and every command takes every registered policy by the same flag
    flag = "--router-policy" if dest == "router_policy" else "--policy"
    for name in policy_names():
        assert getattr(_parse([*argv, flag, name]), dest) == name


def test_every_command_shows_the_registrys_help(capsys):
    from servelm.router.policies import policy_help

    wanted = " ".join(policy_help().split())
    for command in ("router", "serve", "sim"):
        with pytest.raises(SystemExit):
            _parse([command, "--help"])
        assert wanted in " ".join(capsys.readouterr().out.split()), command

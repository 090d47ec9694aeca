"""The prefill profile fit and the router client's request building (no daemon needed)."""

import pytest

from kvferry.profile import ProfileFit, pairs
from kvferry.router import RouterClient


def test_fit_recovers_a_known_profile():
    f = ProfileFit(min_tokens=1)
    a, b = 2e-4, 3e-8
    for c, n in [(0, 100), (0, 400), (256, 64), (512, 512), (0, 1000), (128, 300)]:
        f.add(c, n, a * n + b * pairs(c, n))
    fit = f.fit()
    assert fit is not None and fit.samples == 6
    assert fit.linear_s_per_token == pytest.approx(a, rel=1e-6)
    assert fit.attention_s_per_pair == pytest.approx(b, rel=1e-6)


def test_fit_recovers_a_fixed_cost_per_step():
    # vLLM's CPU build: every step costs ~20 ms whatever its tokens. Without the fixed term a
    # fit over short and long steps read it as a per-token cost.
    f = ProfileFit(min_tokens=1)
    fixed, a, b = 0.02, 2e-4, 3e-8
    shapes = [(0, 16), (4096, 16), (0, 128), (0, 384), (256, 64), (0, 1024), (128, 300)]
    for c, n in shapes:
        f.add(c, n, fixed + a * n + b * pairs(c, n))
    fit = f.fit()
    assert fit is not None and fit.samples == len(shapes)
    assert fit.fixed_s == pytest.approx(fixed, rel=1e-6)
    assert fit.linear_s_per_token == pytest.approx(a, rel=1e-6)
    assert fit.attention_s_per_pair == pytest.approx(b, rel=1e-6)
    # Steps that fit no fixed cost get none (not a negative one): exact data from the profile
    # without it.
    g = ProfileFit(min_tokens=1)
    for c, n in shapes:
        g.add(c, n, a * n + b * pairs(c, n) - (1e-6 if n == 16 else 0.0))
    fit = g.fit()
    assert (
        fit is not None
        and fit.fixed_s == 0.0
        and fit.linear_s_per_token > 0
        and fit.attention_s_per_pair >= 0
    )


def test_fit_clamps_to_a_positive_linear_term():
    f = ProfileFit(min_tokens=1)
    assert f.fit() is None
    f.add(0, 100, 0.01)
    fit = f.fit()
    assert fit is not None and fit.linear_s_per_token == pytest.approx(1e-4) and fit.attention_s_per_pair == 0
    f.add(0, 5, 1.0)  # below min_tokens? no: min 1; a noisy sample must not make a term negative
    fit = f.fit()
    assert fit.linear_s_per_token > 0 and fit.attention_s_per_pair >= 0


def test_router_request_and_policy_names():
    r = RouterClient.request("s", "t", [1, 2, 3], model_id="m", policy="fetch", source_region="a")
    assert r.policy.mode == 1 and list(r.token_ids) == [1, 2, 3] and r.source_region == "a"
    with pytest.raises(ValueError):
        RouterClient.request("s", "t", [1], policy="teleport")
    c = RouterClient("127.0.0.1:1", token="secret")
    assert ("authorization", "Bearer secret") in c._metadata
    c.close()

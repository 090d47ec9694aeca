"""An example GORGO-style router over kvferry's Migration API: for a request of a conversation
whose KV prefix lives somewhere, it picks between running it where the prefix already is
(*redirect*: the user pays the longer network round trip on every remaining turn) and running
it in the region nearest the user after kvferry moves or recomputes the prefix there
(*migrate*: paid once, priced by the daemon's own plan). It learns where prefixes live from
`GetResidency`, which asks the regions live, so an engine's eviction is seen at once (GORGO's
paper names replica-side eviction as its blind spot).

Costs, in seconds, for `turns` remaining turns of the conversation:

- stay:     the home region holds the whole prefix: `turns x rtt(home)`;
- redirect: to a region holding the whole prefix: `turns x rtt(region)`;
- migrate:  `turns x rtt(home)` plus the daemon's predicted seconds for the action it would
  take (`PlanMigration`, asked with the holders as `source_regions`).

The cheapest wins; a migration is then executed with `MigrateSession` on the home daemon.
This is an example of how the calls fit together, not a production router (no caching of
views, no load terms beyond what the daemon prices)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvferry.router import MigrationResult, RouterClient
from kvferry.v1 import kvferry_pb2 as pb


@dataclass
class Route:
    action: str  # "stay" | "redirect" | "migrate"
    region: str  # where the request runs
    cost_s: float
    reason: str
    migration: MigrationResult | None = None


def _chosen_seconds(d: pb.Decision) -> float:
    """The predicted seconds of the action the daemon decided (0 when already local)."""
    for c in d.candidates:
        if c.kind == d.kind:
            return c.seconds
    return 0.0


class ExampleRouter:
    def __init__(self, clients: Mapping[str, RouterClient]) -> None:
        """`clients`: a Migration API client per region, by region name."""
        self.clients = dict(clients)

    def route(
        self,
        session_id: str,
        tenant: str,
        token_ids: Sequence[int],
        user_rtt_s: Mapping[str, float],
        turns: int = 1,
        model_id: str = "",
        execute: bool = True,
    ) -> Route:
        """Routes one request of a conversation; `user_rtt_s`: the user's round trip to each
        region. With `execute`, a chosen migration is carried out before returning."""
        home = min(user_rtt_s, key=lambda r: user_rtt_s[r])
        view = self.clients[home].residency(tenant, token_ids, model_id=model_id)
        full = view.prefix_tokens
        held = {h.region: h.tokens for h in view.holdings if h.reachable}
        if held.get(home, 0) >= full:
            return Route("stay", home, turns * user_rtt_s[home], f"{home} holds all {full} tokens")
        options: list[Route] = []
        for region, tokens in held.items():
            if region != home and tokens >= full and region in user_rtt_s:
                options.append(
                    Route("redirect", region, turns * user_rtt_s[region], f"{region} holds all {full} tokens")
                )
        holders = [r for r, t in held.items() if r != home and t > 0]
        req = RouterClient.request(session_id, tenant, token_ids, model_id=model_id, source_regions=holders)
        plan = self.clients[home].plan(req)
        move_s = _chosen_seconds(plan)
        options.append(
            Route(
                "migrate",
                home,
                turns * user_rtt_s[home] + move_s,
                f"{plan.action} into {home} in {move_s:.3f} s ({plan.reason})",
            )
        )
        best = min(options, key=lambda o: o.cost_s)
        if best.action == "migrate" and execute:
            best.migration = self.clients[home].migrate(req)
        return best

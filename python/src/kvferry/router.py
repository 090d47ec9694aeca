"""A router client for kvferry's Migration API: `MigrateSession` (decision, progress and
receipt as a stream), `PlanMigration`, `GetLinks`, `GetResidency` (which regions hold how much
of a prefix); plain TCP, bearer token, or mutual TLS."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvferry.v1 import kvferry_pb2 as pb
from kvferry.v1 import kvferry_pb2_grpc as rpc

POLICIES = {"auto": pb.POLICY_MODE_AUTO, "fetch": pb.POLICY_MODE_FETCH, "recompute": pb.POLICY_MODE_RECOMPUTE}


@dataclass(frozen=True)
class TlsOptions:
    """Mutual TLS to the daemon's router port (`[router_tls]`): PEM bytes."""

    ca_pem: bytes
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    server_name: str | None = None


@dataclass
class MigrationResult:
    decision: pb.Decision | None = None
    progress: list[pb.Progress] = field(default_factory=list)
    receipt: pb.Receipt | None = None


class RouterClient:
    def __init__(
        self,
        addr: str,
        token: str | None = None,
        tls: TlsOptions | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.timeout_s = timeout_s
        self._metadata: list[tuple[str, str]] = [("authorization", f"Bearer {token}")] if token else []
        if tls is not None:
            creds = grpc.ssl_channel_credentials(tls.ca_pem, tls.key_pem, tls.cert_pem)
            opts = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
            self._channel = grpc.secure_channel(addr, creds, options=opts)
        else:
            self._channel = grpc.insecure_channel(addr)
        self._stub = rpc.MigrationStub(self._channel)

    @staticmethod
    def request(
        session_id: str,
        tenant: str,
        token_ids: Sequence[int],
        model_id: str = "",
        policy: str = "auto",
        source_region: str = "",
        target_engine: str = "",
        deadline_ms: int = 0,
        allow_split: bool = False,
        source_regions: Sequence[str] = (),
    ) -> pb.MigrateSessionRequest:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {sorted(POLICIES)}")
        return pb.MigrateSessionRequest(
            session_id=session_id,
            tenant=tenant,
            model_id=model_id,
            token_ids=list(token_ids),
            source_region=source_region,
            source_regions=list(source_regions),
            target_engine=target_engine,
            deadline_ms=deadline_ms,
            policy=pb.Policy(mode=POLICIES[policy], allow_split=allow_split),
        )

    def events(self, req: pb.MigrateSessionRequest) -> Iterator[pb.MigrationEvent]:
        yield from self._stub.MigrateSession(req, timeout=self.timeout_s, metadata=self._metadata)

    def migrate(self, req: pb.MigrateSessionRequest) -> MigrationResult:
        out = MigrationResult()
        for ev in self.events(req):
            kind = ev.WhichOneof("event")
            if kind == "decision":
                out.decision = ev.decision
            elif kind == "progress":
                out.progress.append(ev.progress)
            elif kind == "receipt":
                out.receipt = ev.receipt
        return out

    def plan(self, req: pb.MigrateSessionRequest) -> pb.Decision:
        return self._stub.PlanMigration(req, timeout=self.timeout_s, metadata=self._metadata)

    def links(self) -> pb.GetLinksResponse:
        return self._stub.GetLinks(pb.GetLinksRequest(), timeout=self.timeout_s, metadata=self._metadata)

    def residency(
        self,
        tenant: str,
        token_ids: Sequence[int],
        model_id: str = "",
        regions: Sequence[str] = (),
        deadline_ms: int = 0,
    ) -> pb.ResidencyResponse:
        """How much of the prefix each region holds now: this daemon's region first, then its
        peers (best source first; unreachable ones last, `reachable` false)."""
        req = pb.ResidencyRequest(
            tenant=tenant,
            model_id=model_id,
            token_ids=list(token_ids),
            regions=list(regions),
            deadline_ms=deadline_ms,
        )
        return self._stub.GetResidency(req, timeout=self.timeout_s, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

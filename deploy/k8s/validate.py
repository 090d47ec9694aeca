#!/usr/bin/env python3
"""Validates rendered kvferry Kubernetes manifests offline (run by validate.sh).

For every rendered region file:
  1. each core object against the Kubernetes JSON schemas bundled in PyPI's
     kubernetes-validate (strict: unknown fields fail), for every version in --k8s-versions;
  2. each cert-manager / prometheus-operator object against the vendored CRD schemas in
     schemas/ (made strict the way the API server's strict field validation is: an object
     schema with `properties` accepts no other field unless it preserves unknown fields);
  3. the kvferry.toml inside ConfigMap kvferry-config-*: parsed with tomllib, every key
     checked against the fields of the config structs read from crates/daemon/src/config.rs
     (all are deny_unknown_fields), value types, and the rules of Config::validate();
  4. consistency: the peer Certificate's one URI SAN is spiffe://<trust_domain>/region/<region>,
     TLS paths lie in the mounted certificate Secrets, run_dir is the shared emptyDir in both
     containers and the connector's daemon_socket is <run_dir>/engine.sock, listen ports are
     the container ports the Services and probes use; across regions, each region's peers are
     exactly the other regions, at their peer load balancer IP and port.
Writes each region's kvferry.toml to --out. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import copy
import ipaddress
import json
import re
import sys
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CRD_SCHEMAS = {
    ("cert-manager.io/v1", "Certificate"): "certificate-cert-manager.io-v1.json",
    ("cert-manager.io/v1", "Issuer"): "issuer-cert-manager.io-v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
}
PLACEHOLDERS = re.compile(r"\b(REGION|TRUST_DOMAIN|NAMESPACE|ROUTER)\b")
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class Failures:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, where: str, msg: str) -> None:
        self.items.append(f"{where}: {msg}")
        print(f"  FAIL {where}: {msg}")


# --- config.rs: the accepted keys --------------------------------------------------------


def config_schema(config_rs: Path) -> dict:
    """{struct name: {field: rust type}} for every `pub struct` in config.rs."""
    text = config_rs.read_text()
    structs: dict[str, dict[str, str]] = {}
    for m in re.finditer(r"pub struct (\w+) \{(.*?)\n\}", text, re.S):
        fields = {}
        for fm in re.finditer(r"^\s*pub (\w+): ([^,\n]+),", m.group(2), re.M):
            fields[fm.group(1)] = fm.group(2).strip()
        structs[m.group(1)] = fields
        pre = text[: m.start()].rsplit("\n\n", 1)[-1]
        if "deny_unknown_fields" not in pre:
            raise SystemExit(f"config.rs: struct {m.group(1)} is not deny_unknown_fields; update validate.py")
    if "Config" not in structs:
        raise SystemExit("config.rs: no `pub struct Config` found; update validate.py")
    return structs


def required_fields(config_rs: Path, struct: str) -> set[str]:
    """Fields of a struct without #[serde(default)] at struct or field level."""
    text = config_rs.read_text()
    m = re.search(r"((?:#\[[^\n]*\]\n)*)pub struct " + struct + r" \{(.*?)\n\}", text, re.S)
    if not m or "default" in m.group(1):
        return set()
    req, pending_default = set(), False
    for line in m.group(2).splitlines():
        s = line.strip()
        if s.startswith("#[serde(") and "default" in s:
            pending_default = True
        fm = re.match(r"pub (\w+):", s)
        if fm:
            if not pending_default:
                req.add(fm.group(1))
            pending_default = False
    return req


def check_toml_types(where: str, value, rust: str, structs: dict, config_rs: Path, fail: Failures) -> None:
    opt = re.fullmatch(r"Option<(.+)>", rust)
    if opt:  # an absent key is None; a present one has the inner type
        check_toml_types(where, value, opt.group(1), structs, config_rs, fail)
        return
    vec = re.fullmatch(r"Vec<(\w+)>", rust)
    if vec:
        if not isinstance(value, list):
            fail.add(where, f"must be an array ({rust})")
            return
        for i, v in enumerate(value):
            check_toml_types(f"{where}[{i}]", v, vec.group(1), structs, config_rs, fail)
        return
    if rust in structs:
        if not isinstance(value, dict):
            fail.add(where, f"must be a table ({rust})")
            return
        fields = structs[rust]
        for k, v in value.items():
            if k not in fields:
                fail.add(f"{where}.{k}" if where else k, f"unknown key (config.rs {rust} has: {', '.join(fields)})")
                continue
            check_toml_types(f"{where}.{k}" if where else k, v, fields[k], structs, config_rs, fail)
        for k in required_fields(config_rs, rust) - set(value):
            fail.add(where, f"missing required key {k!r} ({rust})")
        return
    ok = {
        "String": lambda v: isinstance(v, str),
        "PathBuf": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
        "f64": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "u64": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64,
        "u32": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32,
        "SocketAddr": lambda v: isinstance(v, str) and socket_addr(v) is not None,
        # config.rs / transport.rs enums (the daemon's own parse is the authority; step 4
        # starts a real daemon on every rendered config).
        "TlsMode": lambda v: v in ("dev", "files"),
        "RouterTlsMode": lambda v: v in ("off", "dev", "files"),
        "Congestion": lambda v: isinstance(v, str) and v.lower() in ("cubic", "bbr", "newreno", "new-reno", "reno"),
        "HedgeMode": lambda v: v in ("off", "on_request", "always"),
        "TransportChoice": lambda v: v in ("quic", "tcp", "auto"),
    }.get(rust)
    if ok is None:
        fail.add(where, f"validate.py does not know the Rust type {rust}; update it")
    elif not ok(value):
        fail.add(where, f"{value!r} is not a valid {rust}")


def socket_addr(s: str):
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d+)|([0-9.]+):(\d+)", s)
    if not m:
        return None
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not 0 <= int(port) <= 65535:
        return None
    return ip, int(port)


def check_rules(where: str, c: dict, fail: Failures) -> None:
    """Config::validate(), over the values the file sets (defaults are valid)."""
    name_ok = lambda s: isinstance(s, str) and re.fullmatch(r"[A-Za-z0-9._-]+", s) is not None
    region = c.get("region", "region-a")
    for k in ("region", "trust_domain"):
        if k in c and not name_ok(c[k]):
            fail.add(f"{where} {k}", "must be non-empty: letters, digits, '-', '.', '_'")
    if c.get("faults", {}).get("corrupt"):
        fail.add(f"{where} faults.corrupt", "fault injection is for test builds only")
    tls = c.get("tls", {})
    mode = tls.get("mode", "dev")
    if mode not in ("dev", "files"):
        fail.add(f"{where} tls.mode", f"must be dev or files, got {mode!r}")
    if mode == "files":
        for k in ("ca", "cert", "key"):
            if not tls.get(k):
                fail.add(f"{where} tls.{k}", 'is required with tls.mode = "files"')
    if mode == "dev":
        fail.add(f"{where} tls.mode", "is dev (throwaway CA): a deployment must use files")
    rt = c.get("router_tls", {})
    rmode = rt.get("mode", "off")
    if rmode not in ("off", "dev", "files"):
        fail.add(f"{where} router_tls.mode", f"must be off, dev or files, got {rmode!r}")
    if rmode == "files":
        for k in ("cert", "key", "client_ca"):
            if not rt.get(k):
                fail.add(f"{where} router_tls.{k}", 'is required with router_tls.mode = "files"')
    if rmode != "files":
        fail.add(f"{where} router_tls.mode", "the router port must be behind mutual TLS (files)")
    seen = set()
    for i, p in enumerate(c.get("peers", [])):
        w = f"{where} peers[{i}]"
        if not name_ok(p.get("region")):
            fail.add(f"{w}.region", "must be a region name")
        if p.get("region") == region:
            fail.add(f"{w}.region", "must differ from this daemon's region")
        if p.get("region") in seen:
            fail.add(f"{w}.region", "is listed twice")
        seen.add(p.get("region"))
        if not p.get("gbps", 1.0) > 0:
            fail.add(f"{w}.gbps", "must be > 0")
        if not p.get("rtt_ms", 50.0) >= 0:
            fail.add(f"{w}.rtt_ms", "must be >= 0")
        if not p.get("max_egress_gbps", 0.0) >= 0:
            fail.add(f"{w}.max_egress_gbps", "must be >= 0")
    lim = c.get("limits", {})
    if lim.get("staging_bytes", 256 << 20) < (8 << 20):
        fail.add(f"{where} limits.staging_bytes", "must be at least 8 MiB")
    if lim.get("landing_zone_bytes", 1 << 30) < (16 << 20):
        fail.add(f"{where} limits.landing_zone_bytes", "must be at least 16 MiB")
    for k in ("max_tokens", "max_concurrent_migrations", "default_deadline_ms", "attach_grace_ms"):
        if k in lim and lim[k] == 0:
            fail.add(f"{where} limits.{k}", "must be > 0")
    t = c.get("transfer", {})
    if not (64 << 10) <= t.get("chunk_bytes", 4 << 20) <= (64 << 20):
        fail.add(f"{where} transfer.chunk_bytes", "must be between 64 KiB and 64 MiB")
    if not 1 <= t.get("streams", 4) <= 64:
        fail.add(f"{where} transfer.streams", "must be between 1 and 64")
    congestion = str(t.get("congestion", "cubic")).lower()
    if congestion not in ("cubic", "bbr", "newreno", "new-reno", "reno", "tolerant", "loss-tolerant"):
        fail.add(f"{where} transfer.congestion", "must be cubic, bbr, newreno or tolerant")
    if not 0.0 <= t.get("loss_tolerance", 0.01) <= 0.5:
        fail.add(f"{where} transfer.loss_tolerance", "must be between 0 and 0.5")
    if not 500 <= t.get("idle_timeout_ms", 10000) <= 600000:
        fail.add(f"{where} transfer.idle_timeout_ms", "must be between 500 and 600000")
    if not 0 <= t.get("max_retries_per_chunk", 3) <= 100:
        fail.add(f"{where} transfer.max_retries_per_chunk", "must be at most 100")
    if not 10 <= t.get("missing_grace_ms", 2000) <= 600000:
        fail.add(f"{where} transfer.missing_grace_ms", "must be between 10 and 600000")
    if not 0 <= t.get("reconnect_backoff_ms", 50) <= 10000:
        fail.add(f"{where} transfer.reconnect_backoff_ms", "must be at most 10000")
    pol = c.get("policy", {})
    if not pol.get("split_overhead_ms", 5.0) >= 0:
        fail.add(f"{where} policy.split_overhead_ms", "must be >= 0")
    for k in ("split_min_gain", "eviction_hint_pool_use"):
        if k in pol and not 0.0 <= pol[k] <= 1.0:
            fail.add(f"{where} policy.{k}", "must be in [0, 1]")


# --- Kubernetes objects --------------------------------------------------------------------


def strict(schema: dict) -> dict:
    """Rejects unknown fields wherever the CRD schema lists properties (strict field validation)."""
    s = copy.deepcopy(schema)

    def walk(n):
        if isinstance(n, dict):
            if (
                "properties" in n
                and "additionalProperties" not in n
                and not n.get("x-kubernetes-preserve-unknown-fields")
            ):
                n["additionalProperties"] = False
            for v in n.values():
                walk(v)
        elif isinstance(n, list):
            for v in n:
                walk(v)

    walk(s)
    return s


def validate_object(where: str, doc: dict, versions: list[str], crd: dict, fail: Failures) -> None:
    key = (doc.get("apiVersion"), doc.get("kind"))
    name = (doc.get("metadata") or {}).get("name", "")
    if not DNS1123.match(name or "") or len(name) > 253:
        fail.add(where, f"metadata.name {name!r} is not a DNS-1123 name")
    if key in CRD_SCHEMAS:
        try:
            jsonschema.validate(doc, crd[key])
        except jsonschema.ValidationError as e:
            path = "/".join(str(p) for p in e.absolute_path)
            fail.add(where, f"{key[1]} schema: {path}: {e.message}")
        return
    for v in versions:
        try:
            kubernetes_validate.validate(doc, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            fail.add(where, f"k8s {v}: {path}: {e.message}")
        except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
            fail.add(where, f"k8s {v}: no schema for {key}: {e}")


def one(docs, kind, name_prefix, where, fail):
    found = [d for d in docs if d.get("kind") == kind and d["metadata"]["name"].startswith(name_prefix)]
    if len(found) != 1:
        fail.add(where, f"expected one {kind} {name_prefix}*, found {len(found)}")
        return None
    return found[0]


def check_region(where: str, docs: list[dict], cfg: dict, fail: Failures) -> dict:
    """Cross-object consistency inside one region; returns facts for the cross-region check."""
    region, td = cfg.get("region"), cfg.get("trust_domain")
    facts = {"region": region, "trust_domain": td, "peers": cfg.get("peers", [])}
    for d in docs:
        if d.get("kind") == "Certificate":
            text = json.dumps(d.get("spec", {}))
            if PLACEHOLDERS.search(text):
                fail.add(where, f"Certificate {d['metadata']['name']} still has a placeholder: {PLACEHOLDERS.search(text).group(0)}")
    peer_cert = one(docs, "Certificate", "kvferry-peer", where, fail)
    if peer_cert:
        uris = peer_cert["spec"].get("uris", [])
        want = f"spiffe://{td}/region/{region}"
        if uris != [want]:
            fail.add(where, f"peer Certificate uris {uris} != [{want!r}] (the daemon needs exactly one URI SAN)")
        for k in ("dnsNames", "ipAddresses", "emailAddresses"):
            if peer_cert["spec"].get(k):
                fail.add(where, f"peer Certificate has {k}: keep its identity to the one URI SAN")
    client = one(docs, "Certificate", "kvferry-router-client", where, fail)
    if client:
        for u in client["spec"].get("uris", []):
            if not u.startswith(f"spiffe://{td}/router/"):
                fail.add(where, f"router client URI {u} is not spiffe://{td}/router/<name>")
    dep = one(docs, "Deployment", "vllm-kvferry", where, fail)
    if not dep:
        return facts
    pod = dep["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod.get("initContainers", []) + pod.get("containers", [])}
    kvf, vllm = containers.get("kvferry"), containers.get("vllm")
    if not kvf or not vllm:
        fail.add(where, "Deployment needs containers kvferry and vllm")
        return facts
    if kvf.get("restartPolicy") != "Always":
        fail.add(where, "kvferry must be a native sidecar (init container, restartPolicy: Always)")
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = lambda c: {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    km, vm = mounts(kvf), mounts(vllm)
    run_dir = cfg.get("run_dir", "/run/kvferry").rstrip("/")
    for cname, m in (("kvferry", km), ("vllm", vm)):
        vol = vols.get(m.get(run_dir, ""), {})
        if "emptyDir" not in vol:
            fail.add(where, f"run_dir {run_dir} is not an emptyDir mount in container {cname}")
    if km.get(run_dir) != vm.get(run_dir):
        fail.add(where, "run_dir is not the same volume in both containers")
    args = " ".join(vllm.get("args", []))
    m = re.search(r"--kv-transfer-config=(\{.*\})", args, re.S)
    if not m:
        fail.add(where, "vllm has no --kv-transfer-config")
    else:
        try:
            ktc = json.loads(m.group(1))
            extra = ktc["kv_connector_extra_config"]
            if extra.get("daemon_socket") != f"{run_dir}/engine.sock":
                fail.add(where, f"daemon_socket {extra.get('daemon_socket')} != {run_dir}/engine.sock")
            if ktc.get("kv_connector") != "KvferryConnector" or ktc.get("kv_load_failure_policy") != "recompute":
                fail.add(where, "kv-transfer-config must use KvferryConnector with kv_load_failure_policy recompute")
        except (ValueError, KeyError) as e:
            fail.add(where, f"--kv-transfer-config is not the connector's JSON: {e}")

    def in_secret(path: str, secret_prefix: str) -> bool:
        for mp, vname in km.items():
            v = vols.get(vname, {})
            if path.startswith(mp.rstrip("/") + "/") and v.get("secret", {}).get("secretName", "").startswith(secret_prefix):
                return path[len(mp.rstrip("/")) + 1 :] in ("ca.crt", "tls.crt", "tls.key")
        return False

    tls, rt = cfg.get("tls", {}), cfg.get("router_tls", {})
    for k in ("ca", "cert", "key"):
        if tls.get(k) and not in_secret(tls[k], peer_cert["spec"]["secretName"] if peer_cert else "kvferry-peer-tls"):
            fail.add(where, f"tls.{k} {tls[k]} is not a file of the mounted peer certificate Secret")
    server = one(docs, "Certificate", "kvferry-router-server", where, fail)
    if server:
        ns = server["metadata"].get("namespace", "default")
        if f"kvferry.{ns}.svc" not in server["spec"].get("dnsNames", []):
            fail.add(where, f"router server Certificate lacks DNS name kvferry.{ns}.svc (namespace changed without the patch?)")
    for k in ("cert", "key", "client_ca"):
        if rt.get(k) and not in_secret(rt[k], server["spec"]["secretName"] if server else "kvferry-router-server-tls"):
            fail.add(where, f"router_tls.{k} {rt[k]} is not a file of the mounted router server Secret")
    ports = {p["name"]: (p["containerPort"], p.get("protocol", "TCP")) for p in kvf.get("ports", [])}
    listen = cfg.get("listen", {})
    for key, pname, proto, default in (
        ("grpc", "router-grpc", "TCP", "127.0.0.1:7070"),
        ("peer", "peer-quic", "UDP", "127.0.0.1:7071"),
        ("http", "http", "TCP", "127.0.0.1:7072"),
    ):
        sa = socket_addr(listen.get(key, default))
        if not sa:
            continue
        if not sa[0].is_unspecified:
            fail.add(where, f"listen.{key} {listen.get(key, default)} is not reachable from outside the pod (use 0.0.0.0)")
        if ports.get(pname) != (sa[1], proto):
            fail.add(where, f"container port {pname} {ports.get(pname)} != listen.{key} port {sa[1]}/{proto}")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        pr = kvf.get(probe, {}).get("httpGet", {})
        want = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}[probe]
        if pr.get("port") != "http" or pr.get("path") != want:
            fail.add(where, f"kvferry {probe} must GET {want} on port http")
    peer_svc = one(docs, "Service", "kvferry-peer", where, fail)
    if peer_svc:
        spec = peer_svc["spec"]
        p = spec["ports"][0]
        if spec.get("type") != "LoadBalancer" or p.get("protocol") != "UDP" or p.get("targetPort") != "peer-quic":
            fail.add(where, "Service kvferry-peer must be a UDP LoadBalancer to port peer-quic")
        facts["lb"] = f"{spec.get('loadBalancerIP')}:{p.get('port')}"
    return facts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rendered", nargs="+", type=Path, help="kubectl kustomize output, one file per region")
    ap.add_argument("--out", type=Path, required=True, help="where to write each region's kvferry.toml")
    ap.add_argument("--k8s-versions", default="1.30.0,1.37.0")
    args = ap.parse_args()
    fail = Failures()
    versions = args.k8s_versions.split(",")
    config_rs = REPO / "crates/daemon/src/config.rs"
    structs = config_schema(config_rs)
    # The template documents every key; a key it has that config.rs lacks (or the reverse,
    # faults aside) means this checker's reading of config.rs is off.
    tmpl = tomllib.loads((REPO / "deploy/kvferry.toml").read_text())
    check_toml_types("deploy/kvferry.toml", tmpl, "Config", structs, config_rs, fail)
    for f, rust in structs["Config"].items():
        if f != "faults" and f not in tmpl:
            fail.add("deploy/kvferry.toml", f"config.rs field {f} is not in the template (checker out of date?)")
    crd = {k: strict(json.loads((HERE / "schemas" / v).read_text())) for k, v in CRD_SCHEMAS.items()}
    allfacts = []
    for path in args.rendered:
        where = path.stem
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        kinds: dict[str, int] = {}
        for d in docs:
            kinds[d.get("kind", "?")] = kinds.get(d.get("kind", "?"), 0) + 1
            validate_object(f"{where} {d.get('kind')}/{d.get('metadata', {}).get('name')}", d, versions, crd, fail)
        cm = one(docs, "ConfigMap", "kvferry-config", where, fail)
        if not cm or "kvferry.toml" not in cm.get("data", {}):
            fail.add(where, "no ConfigMap kvferry-config-* with key kvferry.toml")
            continue
        text = cm["data"]["kvferry.toml"]
        out = args.out / f"{where}.kvferry.toml"
        out.write_text(text)
        try:
            cfg = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            fail.add(where, f"kvferry.toml does not parse: {e}")
            continue
        check_toml_types(f"{where} kvferry.toml", cfg, "Config", structs, config_rs, fail)
        check_rules(f"{where} kvferry.toml", cfg, fail)
        allfacts.append(check_region(where, docs, cfg, fail))
        print(f"{where}: {len(docs)} objects ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}); kvferry.toml -> {out}")
    # Across regions: one trust domain, and every region peers with every other at its LB.
    tds = {f["trust_domain"] for f in allfacts}
    if len(tds) > 1:
        fail.add("regions", f"more than one trust_domain: {sorted(tds)}")
    lbs = {f["region"]: f.get("lb") for f in allfacts}
    for f in allfacts:
        got = {p["region"]: p["addr"] for p in f["peers"]}
        want = {r: lb for r, lb in lbs.items() if r != f["region"]}
        if got != want:
            fail.add(f"region {f['region']}", f"peers {got} != the other regions' peer load balancers {want}")
    if fail.items:
        print(f"validate: {len(fail.items)} failure(s)")
        return 1
    print(f"validate: {len(allfacts)} regions, all objects valid (k8s {', '.join(versions)}; CRDs from schemas/), configs consistent")
    return 0


if __name__ == "__main__":
    sys.exit(main())

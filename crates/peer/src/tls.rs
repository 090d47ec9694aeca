//! Region identities and mutual TLS for peer connections.
//!
//! Every daemon holds a certificate naming its region with exactly one SPIFFE-style URI SAN,
//! `spiffe://<trust-domain>/region/<name>`. A peer is accepted only when its chain verifies
//! against the configured CA **and** its identity is in our trust domain and on the allow-list
//! (server side), or is exactly the region we dialled (client side). Both checks run inside the
//! TLS handshake, so a rejected peer never gets a stream, let alone a KV byte.
//!
//! TLS 1.3 only (QUIC requires it), AES-128-GCM preferred (cheaper than AES-256 for bulk data,
//! same security margin for our purposes), and no 0-RTT: the server accepts no early data, so
//! no request that reads or writes KV can ride in replayable early data.
//!
//! [`DevPki`] mints a throwaway CA and region certificates so the demo needs no setup; it logs
//! loudly that it is in use.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use thiserror::Error;

/// ALPN protocol id of the peer protocol.
pub const ALPN: &[u8] = b"kvferry/1";

/// A region's identity: `spiffe://<trust_domain>/region/<region>`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RegionId {
    pub trust_domain: String,
    pub region: String,
}

impl RegionId {
    /// Builds an identity; both parts must be non-empty and free of `/`.
    pub fn new(trust_domain: &str, region: &str) -> Result<Self, IdentityError> {
        let ok = |s: &str| {
            !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        };
        if !ok(trust_domain) || !ok(region) {
            return Err(IdentityError::BadUri(format!("spiffe://{trust_domain}/region/{region}")));
        }
        Ok(Self { trust_domain: trust_domain.to_owned(), region: region.to_owned() })
    }

    /// The URI form.
    pub fn uri(&self) -> String {
        format!("spiffe://{}/region/{}", self.trust_domain, self.region)
    }

    /// Parses the URI form.
    pub fn parse(uri: &str) -> Result<Self, IdentityError> {
        let rest = uri.strip_prefix("spiffe://").ok_or_else(|| IdentityError::BadUri(uri.to_owned()))?;
        let (td, path) = rest.split_once('/').ok_or_else(|| IdentityError::BadUri(uri.to_owned()))?;
        let region = path.strip_prefix("region/").ok_or_else(|| IdentityError::BadUri(uri.to_owned()))?;
        Self::new(td, region).map_err(|_| IdentityError::BadUri(uri.to_owned()))
    }
}

impl std::fmt::Display for RegionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.uri())
    }
}

/// Why a certificate or identity was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum IdentityError {
    #[error("certificate is not valid X.509: {0}")]
    BadCertificate(String),
    #[error("certificate has {0} URI SANs; exactly one is required")]
    UriSanCount(usize),
    #[error("not a region identity: {0}")]
    BadUri(String),
    #[error("peer {got} is not in trust domain {want}")]
    WrongTrustDomain { got: String, want: String },
    #[error("peer region {0} is not on the allow-list")]
    NotAllowed(String),
    #[error("peer is {got}, expected {want}")]
    Unexpected { got: String, want: String },
    #[error("tls configuration: {0}")]
    Config(String),
}

/// Extracts the single region identity from a DER certificate.
pub fn identity_of(cert: &CertificateDer<'_>) -> Result<RegionId, IdentityError> {
    let (_, x509) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| IdentityError::BadCertificate(e.to_string()))?;
    let mut uris = Vec::new();
    if let Ok(Some(san)) = x509.subject_alternative_name() {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::URI(u) = name {
                uris.push((*u).to_owned());
            }
        }
    }
    if uris.len() != 1 {
        return Err(IdentityError::UriSanCount(uris.len()));
    }
    RegionId::parse(&uris[0])
}

/// A daemon's own certificate chain and key.
#[derive(Debug)]
pub struct TlsIdentity {
    pub id: RegionId,
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

impl Clone for TlsIdentity {
    fn clone(&self) -> Self {
        Self { id: self.id.clone(), chain: self.chain.clone(), key: self.key.clone_key() }
    }
}

/// Whom we trust.
#[derive(Debug, Clone)]
pub struct TrustPolicy {
    /// CA certificates peer chains must verify against.
    pub roots: Arc<RootCertStore>,
    /// Our trust domain; peers must be in it.
    pub trust_domain: String,
    /// Regions allowed to connect to us.
    pub allowed_regions: Vec<String>,
}

impl TrustPolicy {
    fn check_server_side(&self, id: &RegionId) -> Result<(), IdentityError> {
        if id.trust_domain != self.trust_domain {
            return Err(IdentityError::WrongTrustDomain { got: id.uri(), want: self.trust_domain.clone() });
        }
        if !self.allowed_regions.contains(&id.region) {
            return Err(IdentityError::NotAllowed(id.uri()));
        }
        Ok(())
    }
}

/// The crypto provider: aws-lc-rs, TLS 1.3 suites only, AES-128-GCM first.
pub fn provider() -> Arc<CryptoProvider> {
    use rustls::crypto::aws_lc_rs::{self, cipher_suite};
    Arc::new(CryptoProvider {
        cipher_suites: vec![
            cipher_suite::TLS13_AES_128_GCM_SHA256,
            cipher_suite::TLS13_AES_256_GCM_SHA384,
            cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
        ],
        ..aws_lc_rs::default_provider()
    })
}

fn rustls_err(e: IdentityError) -> rustls::Error {
    tracing::warn!(error = %e, "peer certificate refused");
    rustls::Error::InvalidCertificate(rustls::CertificateError::ApplicationVerificationFailure)
}

/// The handshake-signature methods both verifiers share: a TLS 1.2 signature is refused (the
/// endpoints speak TLS 1.3 only), a TLS 1.3 one is checked with the provider's algorithms
/// (`self.algs`, the same set rustls' WebPKI verifiers use).
macro_rules! tls13_only_signatures {
    () => {
        fn verify_tls12_signature(
            &self,
            _message: &[u8],
            _cert: &CertificateDer<'_>,
            _dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Err(rustls::Error::PeerIncompatible(rustls::PeerIncompatible::Tls13RequiredForQuic))
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            verify_tls13_signature(message, cert, dss, &self.algs)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.algs.supported_schemes()
        }
    };
}

/// Server side: WebPKI chain verification for client certificates, then the identity policy.
#[derive(Debug)]
struct RegionClientVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    policy: TrustPolicy,
    /// The provider's signature algorithms (those `inner` was built with).
    algs: WebPkiSupportedAlgorithms,
}

impl ClientCertVerifier for RegionClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner.verify_client_cert(end_entity, intermediates, now)?;
        let id = identity_of(end_entity).map_err(rustls_err)?;
        self.policy.check_server_side(&id).map_err(rustls_err)?;
        Ok(ClientCertVerified::assertion())
    }

    tls13_only_signatures!();
}

/// Client side: the server's chain must verify against our roots, and its identity must be
/// exactly the region we dialled (DNS names play no part).
#[derive(Debug)]
struct RegionServerVerifier {
    roots: Arc<RootCertStore>,
    expected: RegionId,
    algs: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for RegionServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.algs.all,
        )?;
        let id = identity_of(end_entity).map_err(rustls_err)?;
        if id != self.expected {
            return Err(rustls_err(IdentityError::Unexpected { got: id.uri(), want: self.expected.uri() }));
        }
        Ok(ServerCertVerified::assertion())
    }

    tls13_only_signatures!();
}

/// rustls server configuration for the peer endpoint (mutual TLS, TLS 1.3, no early data).
pub fn server_crypto(me: &TlsIdentity, policy: &TrustPolicy) -> Result<rustls::ServerConfig, IdentityError> {
    let cfg = |e: &dyn std::fmt::Display| IdentityError::Config(e.to_string());
    let provider = provider();
    let inner =
        rustls::server::WebPkiClientVerifier::builder_with_provider(policy.roots.clone(), provider.clone())
            .build()
            .map_err(|e| cfg(&e))?;
    let algs = provider.signature_verification_algorithms;
    let verifier = Arc::new(RegionClientVerifier { inner, policy: policy.clone(), algs });
    let mut c = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| cfg(&e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(me.chain.clone(), me.key.clone_key())
        .map_err(|e| cfg(&e))?;
    c.alpn_protocols = vec![ALPN.to_vec()];
    c.max_early_data_size = 0;
    Ok(c)
}

/// rustls client configuration for dialling `peer`.
pub fn client_crypto(
    me: &TlsIdentity,
    roots: Arc<RootCertStore>,
    peer: &RegionId,
) -> Result<rustls::ClientConfig, IdentityError> {
    let cfg = |e: &dyn std::fmt::Display| IdentityError::Config(e.to_string());
    let provider = provider();
    let verifier = Arc::new(RegionServerVerifier {
        roots,
        expected: peer.clone(),
        algs: provider.signature_verification_algorithms,
    });
    let mut c = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| cfg(&e))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(me.chain.clone(), me.key.clone_key())
        .map_err(|e| cfg(&e))?;
    c.alpn_protocols = vec![ALPN.to_vec()];
    c.enable_early_data = false;
    Ok(c)
}

/// Which side of a live connection the peer was when its chain was verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerSide {
    /// The peer dialled us: its chain was checked as a client certificate.
    Client,
    /// We dialled the peer: its chain was checked as a server certificate.
    Server,
}

/// Whether a chain a peer presented still verifies against `roots` at `now`: the check a
/// rotation of the trust bundle runs over the connections it finds open (a connection whose
/// peer is no longer trusted is retired; the identity checks of the handshake are not
/// repeated, the identity itself cannot have changed on a live connection).
pub fn chain_still_trusted(
    chain: &[CertificateDer<'static>],
    roots: &Arc<RootCertStore>,
    side: PeerSide,
    now: UnixTime,
) -> bool {
    let Some((leaf, intermediates)) = chain.split_first() else { return false };
    let provider = provider();
    match side {
        PeerSide::Server => {
            let Ok(cert) = ParsedCertificate::try_from(leaf) else { return false };
            rustls::client::verify_server_cert_signed_by_trust_anchor(
                &cert,
                roots,
                intermediates,
                now,
                provider.signature_verification_algorithms.all,
            )
            .is_ok()
        }
        PeerSide::Client => {
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider)
                .build()
                .is_ok_and(|v| v.verify_client_cert(leaf, intermediates, now).is_ok())
        }
    }
}

/// Checks a candidate identity before a node adopts it (a reload): it must name `expected`,
/// its key must match its certificate, and its own chain must verify against `roots` as a
/// server certificate now — a bundle that does not trust this daemon's own certificate would
/// not let its peers (who share the bundle) trust it either. Builds the server configuration
/// as a last check, so that what passes here also starts serving.
pub fn check_identity(
    me: &TlsIdentity,
    roots: &Arc<RootCertStore>,
    expected: &RegionId,
) -> Result<(), IdentityError> {
    if &me.id != expected {
        return Err(IdentityError::Unexpected { got: me.id.uri(), want: expected.uri() });
    }
    if !chain_still_trusted(&me.chain, roots, PeerSide::Server, UnixTime::now()) {
        return Err(IdentityError::Config(format!(
            "the certificate of {} does not verify against the CA bundle (another CA, expired, or not a server certificate)",
            me.id
        )));
    }
    let policy = TrustPolicy {
        roots: roots.clone(),
        trust_domain: me.id.trust_domain.clone(),
        allowed_regions: vec![],
    };
    server_crypto(me, &policy).map(|_| ())
}

impl TlsIdentity {
    /// The chain and the key as PEM text (certificate, key), as `tls.mode = "files"` reads them.
    pub fn to_pem(&self) -> (String, String) {
        let chain: String = self.chain.iter().map(|c| pem_encode("CERTIFICATE", c.as_ref())).collect();
        let label = match &self.key {
            PrivateKeyDer::Pkcs1(_) => "RSA PRIVATE KEY",
            PrivateKeyDer::Sec1(_) => "EC PRIVATE KEY",
            _ => "PRIVATE KEY",
        };
        (chain, pem_encode(label, self.key.secret_der()))
    }
}

/// A throwaway CA for development and tests.
pub struct DevPki {
    trust_domain: String,
    ca_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for DevPki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevPki").field("trust_domain", &self.trust_domain).finish_non_exhaustive()
    }
}

impl DevPki {
    /// Generates a fresh CA. Logs a warning: dev certificates are not for production.
    pub fn generate(trust_domain: &str) -> Result<Self, IdentityError> {
        tracing::warn!(
            trust_domain,
            "DEV MODE: generating a throwaway CA and region certificates; peers are authenticated only against this process's CA"
        );
        let e = |e: rcgen::Error| IdentityError::Config(e.to_string());
        let key = KeyPair::generate().map_err(e)?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(e)?;
        params.distinguished_name.push(DnType::CommonName, format!("kvferry dev CA ({trust_domain})"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = params.self_signed(&key).map_err(e)?;
        Ok(Self {
            trust_domain: trust_domain.to_owned(),
            ca_der: ca.der().clone(),
            issuer: Issuer::new(params, key),
        })
    }

    /// Loads the dev CA kept in `dir` (`ca.pem`, `ca.key`), creating it first if absent, so
    /// that several daemons on one machine trust each other. Creation is race-free: the
    /// files are written under temporary names and linked into place, and a loser of the race
    /// re-reads the winner's files.
    pub fn load_or_create(dir: &std::path::Path, trust_domain: &str) -> Result<Self, IdentityError> {
        let io = |e: std::io::Error| IdentityError::Config(format!("dev CA in {}: {e}", dir.display()));
        std::fs::create_dir_all(dir).map_err(io)?;
        let (cert, key) = (dir.join("ca.pem"), dir.join("ca.key"));
        if !cert.exists() {
            let fresh = Self::generate(trust_domain)?;
            let tmp = dir.join(format!(".ca-{}", std::process::id()));
            std::fs::create_dir_all(&tmp).map_err(io)?;
            let pem = pem_encode("CERTIFICATE", fresh.ca_der.as_ref());
            std::fs::write(tmp.join("ca.pem"), pem).map_err(io)?;
            write_private(&tmp.join("ca.key"), fresh.issuer.key().serialize_pem().as_bytes()).map_err(io)?;
            // The key first, then the certificate: a reader that sees ca.pem finds ca.key.
            let _ = std::fs::hard_link(tmp.join("ca.key"), &key);
            let _ = std::fs::hard_link(tmp.join("ca.pem"), &cert);
            let _ = std::fs::remove_dir_all(&tmp);
        }
        tracing::warn!(dir = %dir.display(), "DEV MODE: using the throwaway dev CA; not for production");
        let e = |e: rcgen::Error| IdentityError::Config(e.to_string());
        let cert_pem = std::fs::read_to_string(&cert).map_err(io)?;
        let key_pem = std::fs::read_to_string(&key).map_err(io)?;
        let signing = KeyPair::from_pem(&key_pem).map_err(e)?;
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, signing).map_err(e)?;
        let ca_der = load_certs_pem(&cert_pem)?
            .into_iter()
            .next()
            .ok_or_else(|| IdentityError::Config("empty ca.pem".into()))?;
        Ok(Self { trust_domain: trust_domain.to_owned(), ca_der, issuer })
    }

    /// The CA certificate.
    pub fn ca(&self) -> &CertificateDer<'static> {
        &self.ca_der
    }

    /// The CA certificate as PEM text (a `tls.ca` bundle).
    pub fn ca_pem(&self) -> String {
        pem_encode("CERTIFICATE", self.ca_der.as_ref())
    }

    /// A root store holding this CA.
    pub fn roots(&self) -> Arc<RootCertStore> {
        let mut r = RootCertStore::empty();
        // The CA was just generated by us; adding it cannot fail short of a bug.
        let _ = r.add(self.ca_der.clone());
        Arc::new(r)
    }

    /// A certificate for `region` with the one URI SAN it must carry.
    pub fn issue(&self, region: &str) -> Result<TlsIdentity, IdentityError> {
        let id = RegionId::new(&self.trust_domain, region)?;
        self.issue_with_uris(id, &[])
    }

    /// Like [`DevPki::issue`], with extra URI SANs (tests use it to build invalid identities).
    pub fn issue_with_uris(&self, id: RegionId, extra_uris: &[&str]) -> Result<TlsIdentity, IdentityError> {
        let e = |e: rcgen::Error| IdentityError::Config(e.to_string());
        let key = KeyPair::generate().map_err(e)?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(e)?;
        params.distinguished_name.push(DnType::CommonName, format!("kvferry region {}", id.region));
        let mut sans = vec![SanType::URI(id.uri().try_into().map_err(e)?)];
        for u in extra_uris {
            sans.push(SanType::URI((*u).try_into().map_err(e)?));
        }
        params.subject_alt_names = sans;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &self.issuer).map_err(e)?;
        Ok(TlsIdentity {
            id,
            chain: vec![cert.der().clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        })
    }
}

fn pem_encode(label: &str, der: &[u8]) -> String {
    const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::new();
    for c in der.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                b64.push(B64[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

fn write_private(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    f.write_all(bytes)
}

/// Parses every certificate in a PEM text.
pub fn load_certs_pem(pem: &str) -> Result<Vec<CertificateDer<'static>>, IdentityError> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| IdentityError::Config(format!("bad PEM certificate: {e}")))
}

/// Loads an identity and trust roots from PEM files (`tls.mode = "files"`).
pub fn load_identity_files(
    ca: &std::path::Path,
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<(TlsIdentity, Arc<RootCertStore>), IdentityError> {
    use rustls::pki_types::pem::PemObject;
    let read = |p: &std::path::Path| {
        std::fs::read_to_string(p).map_err(|e| IdentityError::Config(format!("{}: {e}", p.display())))
    };
    let mut roots = RootCertStore::empty();
    for c in load_certs_pem(&read(ca)?)? {
        roots.add(c).map_err(|e| IdentityError::Config(format!("{}: {e}", ca.display())))?;
    }
    let chain = load_certs_pem(&read(cert)?)?;
    let leaf =
        chain.first().ok_or_else(|| IdentityError::Config(format!("{}: no certificate", cert.display())))?;
    let id = identity_of(leaf)?;
    let key = PrivateKeyDer::from_pem_slice(read(key)?.as_bytes())
        .map_err(|e| IdentityError::Config(format!("{}: {e}", key.display())))?;
    Ok((TlsIdentity { id, chain, key }, Arc::new(roots)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_persisted_dev_ca_is_shared() {
        let dir = std::env::temp_dir().join(format!("kvferry-devca-{}", std::process::id()));
        let a = DevPki::load_or_create(&dir, "kvferry.test").unwrap();
        let b = DevPki::load_or_create(&dir, "kvferry.test").unwrap();
        assert_eq!(a.ca(), b.ca());
        let id = b.issue("x").unwrap();
        // A certificate issued through the reloaded CA verifies against the original's roots.
        let cert = ParsedCertificate::try_from(&id.chain[0]).unwrap();
        let algs = provider().signature_verification_algorithms;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &a.roots(),
            &[],
            UnixTime::now(),
            algs.all,
        )
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn region_ids_round_trip_and_refuse_junk() {
        let id = RegionId::new("kvferry.test", "eu-west").unwrap();
        assert_eq!(id.uri(), "spiffe://kvferry.test/region/eu-west");
        assert_eq!(RegionId::parse(&id.uri()).unwrap(), id);
        for bad in ["https://x/region/a", "spiffe://x/zone/a", "spiffe://x/region/", "spiffe://x/region/a/b"]
        {
            assert!(RegionId::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn dev_certificates_carry_exactly_one_identity() {
        let pki = DevPki::generate("kvferry.test").unwrap();
        let me = pki.issue("us-east").unwrap();
        assert_eq!(identity_of(&me.chain[0]).unwrap(), RegionId::new("kvferry.test", "us-east").unwrap());
        let two = pki
            .issue_with_uris(RegionId::new("kvferry.test", "x").unwrap(), &["spiffe://kvferry.test/region/y"])
            .unwrap();
        assert_eq!(identity_of(&two.chain[0]), Err(IdentityError::UriSanCount(2)));
    }

    #[test]
    fn server_refuses_early_data() {
        let pki = DevPki::generate("kvferry.test").unwrap();
        let me = pki.issue("a").unwrap();
        let policy =
            TrustPolicy { roots: pki.roots(), trust_domain: "kvferry.test".into(), allowed_regions: vec![] };
        let c = server_crypto(&me, &policy).unwrap();
        assert_eq!(c.max_early_data_size, 0);
        let c = client_crypto(&me, pki.roots(), &RegionId::new("kvferry.test", "b").unwrap()).unwrap();
        assert!(!c.enable_early_data);
    }
}

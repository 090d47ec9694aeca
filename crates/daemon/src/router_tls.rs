//! Mutual TLS on the router-facing Migration API (`[router_tls]`).
//!
//! The daemon terminates TLS itself (tokio-rustls over the workspace's aws-lc-rs provider,
//! TLS 1.3 only, ALPN `h2`) and hands tonic the decrypted streams, so that a refused handshake
//! (no client certificate, one from another CA) is logged with its reason and never reaches
//! the service. Handshakes run concurrently, each bounded in time, off the accept loop.
//!
//! The configuration in use sits in a [`RouterTlsConfig`], read once per accepted connection:
//! a reload ([`crate::reload`]) replaces it for new handshakes while established router
//! connections keep theirs.
//!
//! Dev mode reuses the dev CA of `tls.dev_dir`: it issues the router server certificate and a
//! router client certificate for `kvferry migrate` ([`ensure_dev_router_client`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use rcgen::{CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose, SanType};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::config::{Config, RouterTlsMode};
use crate::conn::{ConnTable, Guarded};

/// File names of the dev router client identity in `tls.dev_dir`.
pub const DEV_CLIENT_CERT: &str = "router-client.pem";
pub const DEV_CLIENT_KEY: &str = "router-client.key";

/// The router API's TLS configuration in use now; replaced whole on a reload.
#[derive(Debug)]
pub struct RouterTlsConfig(std::sync::Mutex<Arc<rustls::ServerConfig>>);

impl RouterTlsConfig {
    pub fn new(c: Arc<rustls::ServerConfig>) -> Arc<Self> {
        Arc::new(Self(std::sync::Mutex::new(c)))
    }

    /// The configuration new handshakes use.
    pub fn current(&self) -> Arc<rustls::ServerConfig> {
        kvferry_pool::sync::LockExt::locked(&self.0).clone()
    }

    /// Replaces it (established connections keep the one they were accepted with).
    pub fn replace(&self, c: Arc<rustls::ServerConfig>) {
        *kvferry_pool::sync::LockExt::locked(&self.0) = c;
    }
}

/// The rustls server configuration for the router API, or `None` with `router_tls.mode = "off"`.
pub fn server_config(cfg: &Config) -> anyhow::Result<Option<Arc<rustls::ServerConfig>>> {
    let (chain, key, client_roots) = match cfg.router_tls.mode {
        RouterTlsMode::Off => return Ok(None),
        RouterTlsMode::Dev => {
            let ca = DevCa::load(&cfg.tls.dev_dir, &cfg.trust_domain)?;
            ensure_dev_router_client(&cfg.tls.dev_dir, &cfg.trust_domain)?;
            let (chain, key) = ca.issue_server(cfg.listen.grpc)?;
            tracing::warn!(dir = %cfg.tls.dev_dir.display(),
                "DEV MODE: router TLS with the throwaway dev CA; router client identity in {DEV_CLIENT_CERT} / {DEV_CLIENT_KEY}");
            (chain, key, vec![ca.cert])
        }
        RouterTlsMode::Files => {
            let r = &cfg.router_tls;
            let chain = read_certs(&r.cert)?;
            if chain.is_empty() {
                anyhow::bail!("router_tls.cert {}: no certificate", r.cert.display());
            }
            let key = PrivateKeyDer::from_pem_slice(&read(&r.key)?)
                .map_err(|e| anyhow::anyhow!("router_tls.key {}: {e}", r.key.display()))?;
            let roots = read_certs(&r.client_ca)?;
            if roots.is_empty() {
                anyhow::bail!("router_tls.client_ca {}: no certificate", r.client_ca.display());
            }
            (chain, key, roots)
        }
    };
    build(chain, key, client_roots).map(Some)
}

fn build(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    client_roots: Vec<CertificateDer<'static>>,
) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let provider = kvferry_peer::tls::provider();
    let mut roots = rustls::RootCertStore::empty();
    for c in client_roots {
        roots.add(c).context("router client CA")?;
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .context("router client certificate verifier")?;
    let mut c = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("router TLS protocol versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .context("router TLS certificate and key")?;
    c.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(c))
}

fn read(p: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(p).with_context(|| format!("reading {}", p.display()))
}

fn read_certs(p: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    CertificateDer::pem_slice_iter(&read(p)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("{}: bad PEM certificate: {e}", p.display()))
}

/// The dev CA of a `tls.dev_dir` (created if missing, as the peer side does).
struct DevCa {
    cert: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

impl DevCa {
    fn load(dir: &Path, trust_domain: &str) -> anyhow::Result<Self> {
        kvferry_peer::DevPki::load_or_create(dir, trust_domain)?;
        let cert_pem = String::from_utf8(read(&dir.join("ca.pem"))?).context("ca.pem is not UTF-8")?;
        let key_pem = String::from_utf8(read(&dir.join("ca.key"))?).context("ca.key is not UTF-8")?;
        let signing = KeyPair::from_pem(&key_pem).context("dev CA key")?;
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, signing).context("dev CA certificate")?;
        let cert = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .next()
            .ok_or_else(|| anyhow::anyhow!("{}: no certificate", dir.join("ca.pem").display()))?
            .context("dev CA certificate")?;
        Ok(Self { cert, issuer })
    }

    fn issue(
        &self,
        cn: &str,
        sans: Vec<SanType>,
        eku: ExtendedKeyUsagePurpose,
    ) -> anyhow::Result<(String, KeyPair)> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name.push(DnType::CommonName, cn);
        params.subject_alt_names = sans;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![eku];
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key))
    }

    /// A server certificate for the router API at `listen`.
    fn issue_server(
        &self,
        listen: SocketAddr,
    ) -> anyhow::Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
        let mut ips = vec![IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V6(Ipv6Addr::LOCALHOST)];
        if !listen.ip().is_unspecified() && !ips.contains(&listen.ip()) {
            ips.push(listen.ip());
        }
        let mut sans = vec![SanType::DnsName("localhost".try_into()?)];
        sans.extend(ips.into_iter().map(SanType::IpAddress));
        let (pem, key) = self.issue("kvferry dev router API", sans, ExtendedKeyUsagePurpose::ServerAuth)?;
        let chain = CertificateDer::pem_slice_iter(pem.as_bytes()).collect::<Result<Vec<_>, _>>()?;
        Ok((chain, PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()))))
    }
}

/// Makes sure `dir` holds a router client identity signed by the dev CA of `dir` (creating the
/// CA too if missing); returns (certificate, key) paths. Race-free among daemons sharing `dir`:
/// written under temporary names, then linked into place, key first.
pub fn ensure_dev_router_client(dir: &Path, trust_domain: &str) -> anyhow::Result<(PathBuf, PathBuf)> {
    let (cert, key) = (dir.join(DEV_CLIENT_CERT), dir.join(DEV_CLIENT_KEY));
    if cert.exists() && key.exists() {
        return Ok((cert, key));
    }
    let ca = DevCa::load(dir, trust_domain)?;
    let uri = format!("spiffe://{trust_domain}/router/dev");
    let (pem, pair) = ca.issue(
        "kvferry dev router",
        vec![SanType::URI(uri.as_str().try_into()?)],
        ExtendedKeyUsagePurpose::ClientAuth,
    )?;
    let tmp = dir.join(format!(".router-client-{}-{:x}", std::process::id(), rand::random::<u32>()));
    std::fs::create_dir_all(&tmp)?;
    let io = |e: std::io::Error| {
        anyhow::anyhow!("writing the dev router client identity in {}: {e}", dir.display())
    };
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(tmp.join(DEV_CLIENT_KEY))
            .map_err(io)?;
        f.write_all(pair.serialize_pem().as_bytes()).map_err(io)?;
    }
    std::fs::write(tmp.join(DEV_CLIENT_CERT), pem).map_err(io)?;
    if std::fs::hard_link(tmp.join(DEV_CLIENT_KEY), &key).is_ok() {
        let _ = std::fs::hard_link(tmp.join(DEV_CLIENT_CERT), &cert);
    }
    let _ = std::fs::remove_dir_all(&tmp);
    // Another daemon may have won the race: wait briefly for its certificate to appear.
    for _ in 0..100 {
        if cert.exists() {
            return Ok((cert, key));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    anyhow::bail!("{} did not appear", cert.display())
}

/// A router connection after a successful TLS handshake.
pub struct RouterTlsStream(tokio_rustls::server::TlsStream<TcpStream>);

/// A TLS router connection admitted by the router's [`ConnTable`].
pub type GuardedTls = Guarded<RouterTlsStream>;

impl std::fmt::Debug for RouterTlsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RouterTlsStream").field(&self.0.get_ref().0.peer_addr().ok()).finish()
    }
}

impl crate::conn::PeerProcess for RouterTlsStream {}

impl Connected for RouterTlsStream {
    type ConnectInfo = TcpConnectInfo;
    fn connect_info(&self) -> TcpConnectInfo {
        self.0.get_ref().0.connect_info()
    }
}

impl AsyncRead for RouterTlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for RouterTlsStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

/// Accepts router connections (Nagle off), admits each into `table` (its connection cap
/// counts handshakes in progress), runs each TLS handshake in its own task bounded by
/// `listeners.handshake_timeout_ms` (or until the table closes the connection), and yields
/// the established streams. Refused handshakes are logged with the reason. The returned task
/// owns the listener; abort it to stop accepting. Each handshake uses the configuration
/// `config` holds when the connection is accepted (certificate rotation).
pub fn incoming(
    listener: TcpListener,
    config: Arc<RouterTlsConfig>,
    table: Arc<ConnTable>,
) -> (tokio_stream::wrappers::ReceiverStream<std::io::Result<GuardedTls>>, tokio::task::AbortHandle) {
    let (tx, rx) = mpsc::channel(64);
    let handshake_timeout = table.limits.handshake;
    let task = tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "router API accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            if tx.is_closed() {
                return;
            }
            let Some(admission) = table.admit() else { continue };
            let (acceptor, tx) = (tokio_rustls::TlsAcceptor::from(config.current()), tx.clone());
            tokio::spawn(async move {
                // Registered before the check, so a close between the two is not missed.
                let state = admission.state.clone();
                let closing = state.closing.notified();
                tokio::pin!(closing);
                closing.as_mut().enable();
                if admission.state.is_closed() {
                    return;
                }
                let handshake = tokio::time::timeout(handshake_timeout, acceptor.accept(tcp));
                let outcome = tokio::select! {
                    r = handshake => r,
                    () = closing => return,
                };
                match outcome {
                    Ok(Ok(s)) => {
                        admission.state.mark_seen();
                        let _ = tx.send(Ok(Guarded::new(RouterTlsStream(s), admission))).await;
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(%peer, error = %e, "router TLS handshake refused (mutual TLS: a client certificate signed by the router client CA is required)");
                    }
                    Err(_) => tracing::warn!(%peer, "router TLS handshake timed out"),
                }
            });
        }
    });
    (tokio_stream::wrappers::ReceiverStream::new(rx), task.abort_handle())
}

//! Certificate rotation without a restart: the daemon re-reads its peer identity (`[tls]`,
//! `files` mode) and its router TLS files (`[router_tls]`, `files` mode) when they change, and
//! on `SIGHUP`.
//!
//! cert-manager and SPIRE's helpers rewrite a mounted Secret by an atomic symlink swap (the
//! kubelet writes a new timestamped directory and renames `..data` onto it), so a path's
//! *target* changes inode rather than being rewritten in place. The poll therefore compares a
//! [`Stamp`] of what each path resolves to (device, inode, size, mtime) every
//! `tls.reload_poll_ms`; `SIGHUP` reloads at once, changed or not.
//!
//! A reload builds the new configuration completely before it replaces anything: a missing,
//! unparsable or inconsistent file (another region's certificate, a key that is not the
//! certificate's, a certificate the new CA bundle does not verify) is refused with an error
//! log line naming the listener and the reason, counted in `kvferry_tls_reloads_total{result=
//! "refused"}`, and the identity in use stays. New handshakes use the new material;
//! established connections keep running (see `kvferry_peer::PeerNode::reload_tls` for peer
//! connections whose peer the new bundle no longer trusts).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvferry_pool::sync::LockExt;

use crate::Shared;
use crate::config::{RouterTlsMode, TlsMode};
use crate::router_tls::RouterTlsConfig;

/// What a watched path resolves to, as far as telling a rewrite goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub dev: u64,
    pub ino: u64,
    pub len: u64,
    pub mtime_ns: i128,
}

/// The stamp of what `path` resolves to now (symlinks followed); `None` when it cannot be read.
pub fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        len: m.len(),
        mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
    })
}

/// Which TLS listener a reload is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// The peer QUIC endpoint (server and client side).
    Peer,
    /// The router-facing gRPC API.
    Router,
}

impl Listener {
    pub fn name(self) -> &'static str {
        match self {
            Self::Peer => "peer",
            Self::Router => "router",
        }
    }
}

/// What one reload attempt of one listener came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The new material is in use.
    Reloaded,
    /// The files were refused; the old identity stays.
    Refused(String),
    /// Nothing to reload (dev mode or TLS off).
    NotFromFiles,
}

/// A set of watched files and their stamps at the last reload attempt.
#[derive(Debug, Clone, PartialEq)]
pub struct Watched {
    paths: Vec<PathBuf>,
    last: Vec<Option<Stamp>>,
}

impl Watched {
    /// Watches `paths`, taking their stamps now (the material just loaded).
    pub fn new(paths: Vec<PathBuf>) -> Self {
        let last = paths.iter().map(|p| stamp(p)).collect();
        Self { paths, last }
    }

    /// Whether `now` (stamps of the same paths, in order) differs from the last attempt;
    /// records `now` either way, so a refused set is retried only after it changes again.
    pub fn changed(&mut self, now: Vec<Option<Stamp>>) -> bool {
        let changed = now != self.last;
        self.last = now;
        changed
    }

    /// The stamps of the watched paths now.
    pub fn stamps(&self) -> Vec<Option<Stamp>> {
        self.paths.iter().map(|p| stamp(p)).collect()
    }
}

/// Reloads the daemon's TLS material: on demand ([`Reloader::reload`]) and from the watch task.
pub struct Reloader {
    shared: Arc<Shared>,
    router: Option<Arc<RouterTlsConfig>>,
    peer_files: Mutex<Watched>,
    router_files: Mutex<Watched>,
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader").finish_non_exhaustive()
    }
}

impl Reloader {
    /// The files the config names for the peer and the router listener (none in dev mode),
    /// stamped now: take them *before* loading the material at start, so that a rotation
    /// landing between the load and the first poll is still seen as a change.
    pub fn watch_files(c: &crate::Config) -> (Watched, Watched) {
        let peer = match c.tls.mode {
            TlsMode::Files => vec![c.tls.ca.clone(), c.tls.cert.clone(), c.tls.key.clone()],
            TlsMode::Dev => Vec::new(),
        };
        let r = &c.router_tls;
        let router = match r.mode {
            RouterTlsMode::Files => vec![r.cert.clone(), r.key.clone(), r.client_ca.clone()],
            RouterTlsMode::Off | RouterTlsMode::Dev => Vec::new(),
        };
        (Watched::new(peer), Watched::new(router))
    }

    /// A reloader over `files` ([`Reloader::watch_files`], stamped before the initial load).
    pub fn new(shared: Arc<Shared>, router: Option<Arc<RouterTlsConfig>>, files: (Watched, Watched)) -> Self {
        Self { router, peer_files: Mutex::new(files.0), router_files: Mutex::new(files.1), shared }
    }

    /// Reloads `which` now, whether or not its files changed, and logs and counts the outcome.
    pub fn reload(&self, which: Listener) -> Outcome {
        let out = match which {
            Listener::Peer => self.reload_peer(),
            Listener::Router => self.reload_router(),
        };
        let m = &self.shared.metrics;
        match &out {
            Outcome::Reloaded => {
                m.tls_reloaded(which);
                tracing::info!(
                    listener = which.name(),
                    "{} TLS files reloaded; new connections use them",
                    which.name()
                );
            }
            Outcome::Refused(why) => {
                m.tls_refused(which);
                tracing::error!(listener = which.name(), error = %why,
                    "{}: refused the new TLS files; the current identity stays in use", which.name());
            }
            Outcome::NotFromFiles => {
                tracing::info!(listener = which.name(), "TLS material is not from files; nothing to reload")
            }
        }
        out
    }

    fn reload_peer(&self) -> Outcome {
        let c = &self.shared.config;
        if c.tls.mode != TlsMode::Files {
            return Outcome::NotFromFiles;
        }
        let (identity, roots) =
            match kvferry_peer::tls::load_identity_files(&c.tls.ca, &c.tls.cert, &c.tls.key) {
                Ok(x) => x,
                Err(e) => return Outcome::Refused(e.to_string()),
            };
        match self.shared.node.reload_tls(identity, roots) {
            Ok(r) => {
                tracing::info!(kept = r.kept, retired = r.retired, "peer connections after the reload");
                Outcome::Reloaded
            }
            Err(e) => Outcome::Refused(e.to_string()),
        }
    }

    fn reload_router(&self) -> Outcome {
        let Some(holder) = &self.router else { return Outcome::NotFromFiles };
        if self.shared.config.router_tls.mode != RouterTlsMode::Files {
            return Outcome::NotFromFiles;
        }
        match crate::router_tls::server_config(&self.shared.config) {
            Ok(Some(cfg)) => {
                holder.replace(cfg);
                Outcome::Reloaded
            }
            Ok(None) => Outcome::NotFromFiles,
            Err(e) => Outcome::Refused(format!("{e:#}")),
        }
    }

    /// One poll: reloads each listener whose files changed since its last attempt.
    pub fn poll(&self) {
        for (which, files) in [(Listener::Peer, &self.peer_files), (Listener::Router, &self.router_files)] {
            let changed = {
                let mut w = files.locked();
                let now = w.stamps();
                w.changed(now)
            };
            if changed {
                self.reload(which);
            }
        }
    }

    /// Watches until aborted: polls every `interval` (none when zero) and reloads both
    /// listeners on `SIGHUP`.
    pub async fn watch(self: Arc<Self>, interval: Duration) {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGHUP; TLS files are reloaded by polling only");
                None
            }
        };
        let mut tick = (!interval.is_zero()).then(|| {
            let mut t = tokio::time::interval(interval);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        loop {
            tokio::select! {
                Some(()) = async { match &mut hup { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    tracing::info!("SIGHUP: reloading TLS files");
                    for (which, files) in [(Listener::Peer, &self.peer_files), (Listener::Router, &self.router_files)] {
                        {
                            let mut w = files.locked();
                            let now = w.stamps();
                            w.changed(now);
                        }
                        self.reload(which);
                    }
                }
                _ = async { match &mut tick { Some(t) => { t.tick().await; } None => std::future::pending().await } } => {
                    self.poll();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(ino: u64) -> Option<Stamp> {
        Some(Stamp { dev: 1, ino, len: 10, mtime_ns: 5 })
    }

    #[test]
    fn a_change_is_seen_once_and_a_refused_set_waits_for_the_next_change() {
        let mut w = Watched { paths: vec!["a".into(), "b".into()], last: vec![s(1), s(2)] };
        assert!(!w.changed(vec![s(1), s(2)]));
        assert!(w.changed(vec![s(1), s(3)]), "a new inode behind one path");
        assert!(!w.changed(vec![s(1), s(3)]), "the same set again (say, refused) is not retried");
        assert!(w.changed(vec![None, s(3)]), "a path that disappeared");
        assert!(w.changed(vec![s(1), s(3)]), "and came back");
    }

    #[test]
    fn a_symlink_swap_changes_the_stamp() {
        let d = tempfile::tempdir().unwrap();
        let (v1, v2) = (d.path().join("..v1"), d.path().join("..v2"));
        for v in [&v1, &v2] {
            std::fs::create_dir(v).unwrap();
            std::fs::write(v.join("tls.crt"), "same length").unwrap();
        }
        std::os::unix::fs::symlink("..v1", d.path().join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/tls.crt", d.path().join("tls.crt")).unwrap();
        let path = d.path().join("tls.crt");
        let before = stamp(&path).unwrap();
        std::os::unix::fs::symlink("..v2", d.path().join("..data_tmp")).unwrap();
        std::fs::rename(d.path().join("..data_tmp"), d.path().join("..data")).unwrap();
        assert_ne!(stamp(&path).unwrap(), before, "the kubelet's atomic swap must be seen");
        assert_eq!(stamp(&d.path().join("missing")), None);
    }
}

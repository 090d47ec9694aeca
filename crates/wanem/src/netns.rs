//! Named network namespaces (`ip netns`), threads running inside them, and clean-up of
//! namespaces left behind by processes that died without running their destructors.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread::JoinHandle;

use crate::error::{Result, WanemError};
use crate::sys;

/// The prefix of every namespace this crate creates: `kvf-<pid>-<n>-<side>`.
pub const PREFIX: &str = "kvf-";

/// Where iproute2 binds named namespaces.
const NETNS_DIR: &str = "/var/run/netns";

static NEXT_ID: AtomicU32 = AtomicU32::new(0);

/// Runs `ip` with `args`; a non-zero exit becomes [`WanemError::Ip`] carrying stderr.
pub fn ip(args: &[&str]) -> Result<()> {
    let cmd_line = || format!("ip {}", args.join(" "));
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| WanemError::Ip { cmd: cmd_line(), detail: e.to_string() })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(WanemError::Ip {
            cmd: cmd_line(),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// A named network namespace, deleted (with every process still inside it killed) on drop.
#[derive(Debug)]
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// A fresh base name `kvf-<pid>-<n>`, `n` unique in this process; append `-a`, `-b`.
    pub fn unique_base() -> String {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        format!("{PREFIX}{}-{id}", std::process::id())
    }

    /// Creates a namespace with this name and brings its loopback up.
    pub fn create(name: String) -> Result<Self> {
        ip(&["netns", "add", &name])?;
        let ns = Self { name };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace's name, as `ip netns` shows it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bind-mounted namespace file, for `setns`.
    pub fn path(&self) -> PathBuf {
        ns_path(&self.name)
    }

    /// Runs `f` on a new thread that has entered this namespace. Sockets and devices the
    /// thread creates belong to the namespace and stay there when handed to other threads.
    pub fn spawn_thread<T, F>(&self, f: F) -> Result<JoinHandle<Result<T>>>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let path = self.path();
        std::thread::Builder::new()
            .name(format!("ns:{}", self.name))
            .spawn(move || {
                sys::enter_netns(&path)?;
                Ok(f())
            })
            .map_err(|e| WanemError::Thread(e.to_string()))
    }

    /// Runs `f` inside this namespace and returns its result (a scoped, joined thread).
    pub fn run<T, F>(&self, f: F) -> Result<T>
    where
        T: Send,
        F: FnOnce() -> T + Send,
    {
        let path = self.path();
        std::thread::scope(|s| {
            let h = std::thread::Builder::new()
                .name(format!("ns:{}", self.name))
                .spawn_scoped(s, move || {
                    sys::enter_netns(&path)?;
                    Ok(f())
                })
                .map_err(|e| WanemError::Thread(e.to_string()))?;
            h.join().map_err(|_| WanemError::Thread("panicked".into()))?
        })
    }

    /// A `Command` that runs `program` inside this namespace (`ip netns exec`).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        kill_pids_in(&self.name);
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("kvferry-wanem: removing namespace {}: {e}", self.name);
        }
    }
}

fn ns_path(name: &str) -> PathBuf {
    PathBuf::from(NETNS_DIR).join(name)
}

/// SIGKILLs every process in the named namespace (a process left inside would keep the
/// namespace, and the routes in it, alive after its name is gone).
fn kill_pids_in(name: &str) {
    let Ok(out) = Command::new("ip").args(["netns", "pids", name]).stderr(Stdio::null()).output() else {
        return;
    };
    let me = std::process::id();
    for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        let Ok(pid) = pid.parse::<i32>() else { continue };
        if pid as u32 == me || pid <= 1 {
            continue;
        }
        // SAFETY: kill has no memory-safety preconditions; the pid came from the kernel's
        // list of processes in a namespace we created.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

/// The namespaces this crate created in this or other processes, by name.
pub fn list_ours() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(NETNS_DIR) else { return Vec::new() };
    dir.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|n| n.starts_with(PREFIX)).collect()
}

/// Deletes `kvf-<pid>-…` namespaces whose creating process no longer exists (left behind by
/// a SIGKILL or a crash). Returns the names removed.
pub fn cleanup_stale() -> Vec<String> {
    let mut removed = Vec::new();
    for name in list_ours() {
        let pid = name[PREFIX.len()..].split('-').next().and_then(|p| p.parse::<u32>().ok());
        let Some(pid) = pid else { continue };
        if process_alive(pid) {
            continue;
        }
        kill_pids_in(&name);
        if ip(&["netns", "del", &name]).is_ok() {
            removed.push(name);
        }
    }
    removed
}

/// Whether `pid` names a live process (a zombie, dead but not yet reaped, does not count).
fn process_alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
    !matches!(state, Some("Z" | "X") | None)
}

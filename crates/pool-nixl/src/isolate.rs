//! Loading untrusted metadata in a throwaway process first.
//!
//! NIXL's `loadRemoteMD` hands the blob's packed UCX remote keys to UCX, which trusts them: a
//! blob with a valid framing but corrupted key bytes crashes the loading process (observed:
//! SIGSEGV in `ucp_proto_init_add_buffer_copy_time` under `ucp_ep_rkey_unpack`, UCX bundled
//! with nixl-cu12 1.5.1). Header checks cannot catch that, so a daemon that must survive bad
//! engines sets [`crate::NixlOptions::metadata_checker`]: the blob is first loaded by a
//! checker process (`kvferry-nixl-engine --check-metadata`), and a crash there becomes
//! `PoolError::BadMetadata` instead of the daemon's death.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvferry_pool::PoolError;

use crate::agent::new_agent;
use crate::{BACKEND, ensure_nixl};

/// Exit code of the checker when NIXL refused the blob (a clean error, no crash).
pub const CHECK_REFUSED_EXIT: i32 = 2;

/// Load `md` into a throwaway agent in this process and return the agent name it carries.
/// This is what the checker process runs; call it only where a crash is acceptable.
pub fn load_metadata_here(md: &[u8]) -> Result<String, PoolError> {
    ensure_nixl()?;
    crate::metadata_agent_name(md)?;
    let agent = new_agent(&format!("kvferry-md-check-{}", std::process::id()))?;
    agent.load_remote_md(md).map_err(|e| PoolError::BadMetadata(format!("NIXL refused the metadata: {e}")))
}

/// Run `checker --check-metadata` with `md` (hex, one line) on stdin and wait up to `timeout`.
pub(crate) fn check_in_subprocess(checker: &Path, md: &[u8], timeout: Duration) -> Result<(), PoolError> {
    let backend_err = |detail: String| PoolError::Backend { backend: BACKEND, retryable: false, detail };
    let mut child = Command::new(checker)
        .arg("--check-metadata")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| backend_err(format!("cannot start metadata checker {}: {e}", checker.display())))?;
    let mut line: String = md.iter().map(|b| format!("{b:02x}")).collect();
    line.push('\n');
    let wrote = child.stdin.take().map(|mut s| s.write_all(line.as_bytes()));
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(PoolError::BadMetadata(format!(
                    "loading the metadata hung for {timeout:?} in the checker"
                )));
            }
            Err(e) => return Err(backend_err(format!("waiting for the metadata checker: {e}"))),
        }
    };
    let mut stderr = String::new();
    if let Some(mut s) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut s, &mut stderr);
    }
    let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").to_owned();
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(0), _) => Ok(()),
        (Some(CHECK_REFUSED_EXIT), _) => Err(PoolError::BadMetadata(format!("checker: {last}"))),
        (_, Some(sig)) => Err(PoolError::BadMetadata(format!(
            "the metadata crashed NIXL in an isolated checker (signal {sig}); refusing to load it here"
        ))),
        (code, _) => {
            let _ = wrote;
            Err(backend_err(format!("metadata checker failed (exit {code:?}): {last}")))
        }
    }
}

//! The process on each side of the NIXL baseline (`kvferry-nixl-baseline`).
//!
//! ```text
//! kvferry-nixl-baseline --side src|dst --bytes N [--op read|write] [--timeout-s T]
//! ```
//! Line protocol with the parent (stdout → parent, stdin ← parent):
//! 1. child: `SKIP <reason>` (NIXL not loadable; exits 0) or `READY <buffer addr> <metadata hex>`.
//! 2. parent → initiator (`dst` for READ, `src` for WRITE): `PEER <remote addr> <remote metadata
//!    hex>`; parent → passive side: `GO`.
//! 3. child: `DONE <wall s> <cpu s> <verified 0|1>`. The initiator's clock starts before it
//!    loads the peer's metadata (connection set-up included) and stops when the request
//!    completed (READ: after the buffer verified). The passive side waits for the initiator's
//!    notification; as `dst` (WRITE) it then verifies and its clock (from `GO`) is the wall time.
//!    CPU is `getrusage(RUSAGE_SELF)` over the same window: every thread of the process.
//! 4. parent: `QUIT` (or closes stdin): the child releases everything and exits 0.
//!
//! Errors: `ERROR <message>` on stdout, exit 1. The UCX transport is whatever the environment
//! says (the parent sets `UCX_TLS=tcp`, `UCX_NET_DEVICES=kvf0`).

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, MemType, MemoryRegion, NixlDescriptor, NotificationMap, OptArgs, XferDescList,
    XferOp, XferStatus,
};

use crate::{PATTERN_SEED, Pattern, cpu_seconds};

/// The notification the initiator attaches to its request.
const NOTIF: &[u8] = b"kvferry-baseline-done";
/// Sleep between polls of a transfer or of notifications.
const POLL: Duration = Duration::from_micros(100);

/// A heap buffer described to NIXL.
#[derive(Debug)]
struct Region {
    addr: usize,
    len: usize,
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        // Only an address handed to NIXL; never dereferenced through this pointer.
        std::ptr::with_exposed_provenance(self.addr)
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }

    fn device_id(&self) -> u64 {
        0
    }
}

struct Args {
    src: bool,
    bytes: usize,
    op: XferOp,
    timeout: Duration,
}

fn parse_args(args: &[String]) -> Result<Args, String> {
    let (mut side, mut bytes, mut op, mut timeout) = (None, None, XferOp::Read, Duration::from_secs(600));
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().cloned().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--side" => side = Some(val()?),
            "--bytes" => bytes = Some(val()?.parse::<usize>().map_err(|e| format!("--bytes: {e}"))?),
            "--op" => {
                op = match val()?.as_str() {
                    "read" => XferOp::Read,
                    "write" => XferOp::Write,
                    o => return Err(format!("--op must be read or write, not {o:?}")),
                }
            }
            "--timeout-s" => {
                timeout =
                    Duration::from_secs_f64(val()?.parse::<f64>().map_err(|e| format!("--timeout-s: {e}"))?)
            }
            o => return Err(format!("unknown argument {o:?}")),
        }
    }
    let src = match side.as_deref() {
        Some("src") => true,
        Some("dst") => false,
        _ => return Err("--side src|dst is required".into()),
    };
    let bytes = bytes.filter(|&b| b > 0).ok_or("--bytes N (> 0) is required")?;
    Ok(Args { src, bytes, op, timeout })
}

fn hex(b: &[u8]) -> String {
    const H: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(H[usize::from(x >> 4)] as char);
        s.push(H[usize::from(x & 15)] as char);
    }
    s
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err("odd-length hex".into());
    }
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|e| format!("bad hex: {e}")))
        .collect()
}

fn say(line: &str) -> Result<(), String> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}").and_then(|()| out.flush()).map_err(|e| format!("stdout: {e}"))
}

fn read_line() -> Result<String, String> {
    let mut line = String::new();
    match std::io::stdin().lock().read_line(&mut line) {
        Ok(0) => Err("parent closed stdin".into()),
        Ok(_) => Ok(line.trim().to_owned()),
        Err(e) => Err(format!("stdin: {e}")),
    }
}

/// Entry point of `kvferry-nixl-baseline` (also callable from another binary that re-executes
/// itself): `args` without the program name.
pub fn peer_main(args: &[String]) -> ExitCode {
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = say(&format!("ERROR {}", e.replace('\n', " ")));
            eprintln!("kvferry-nixl-baseline: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let args = parse_args(args)?;
    if let Err(e) = kvferry_pool_nixl::ensure_nixl() {
        return say(&format!("SKIP {}", e.to_string().replace('\n', " ")));
    }
    let e = |what: &'static str| move |err: nixl_sys::NixlError| format!("{what}: {err}");
    let name = if args.src { "kvferry-baseline-src" } else { "kvferry-baseline-dst" };
    // NIXL's defaults (progress thread on, no locking: we use the agent from one thread).
    let agent = Agent::new_configured(name, &AgentConfig::default()).map_err(e("create agent"))?;
    let (_mems, params) = agent.get_plugin_params("UCX").map_err(e("UCX plugin params"))?;
    agent.create_backend("UCX", &params).map_err(e("create UCX backend"))?;

    // The source holds the pattern; the target's buffer is pre-faulted with a filler so that
    // page faults are not part of the transfer (an engine's pool is resident too).
    let mut buf = vec![0u8; args.bytes];
    if args.src {
        Pattern::new(PATTERN_SEED).fill(&mut buf);
    } else {
        buf.fill(0x5A);
    }
    let region = Region { addr: buf.as_mut_ptr().expose_provenance(), len: buf.len() };
    let reg = agent.register_memory(&region, None).map_err(e("register buffer"))?;
    let md = agent.get_local_md().map_err(e("local metadata"))?;
    say(&format!("READY {} {}", region.addr, hex(&md)))?;

    let initiator = args.src == matches!(args.op, XferOp::Write);
    let line = read_line()?;
    let (t0, c0) = (Instant::now(), cpu_seconds(libc::RUSAGE_SELF));
    let deadline = t0 + args.timeout;
    let mut request = None;
    if initiator {
        let mut parts = line.split_whitespace();
        if parts.next() != Some("PEER") {
            return Err(format!("expected PEER, got {line:?}"));
        }
        let raddr: usize = parts.next().and_then(|a| a.parse().ok()).ok_or("PEER without an address")?;
        let rmd = unhex(parts.next().ok_or("PEER without metadata")?)?;
        let peer = agent.load_remote_md(&rmd).map_err(e("load the peer's metadata"))?;
        let mut local = XferDescList::new(MemType::Dram).map_err(e("descriptor list"))?;
        local.add_desc(region.addr, region.len, 0);
        let mut remote = XferDescList::new(MemType::Dram).map_err(e("descriptor list"))?;
        remote.add_desc(raddr, region.len, 0);
        let mut opt = OptArgs::new().map_err(e("opt args"))?;
        opt.set_notification_message(NOTIF).map_err(e("notification"))?;
        opt.set_has_notification(true).map_err(e("notification"))?;
        let req = agent
            .create_xfer_req(args.op, &local, &remote, &peer, Some(&opt))
            .map_err(e("create request"))?;
        let mut pending = agent.post_xfer_req(&req, Some(&opt)).map_err(e("post request"))?;
        while pending {
            match agent.get_xfer_status(&req).map_err(e("transfer failed"))? {
                XferStatus::Success => pending = false,
                XferStatus::InProgress => {
                    if Instant::now() >= deadline {
                        return Err(format!("transfer still in progress after {:?}", args.timeout));
                    }
                    std::thread::sleep(POLL);
                }
            }
        }
        request = Some(req);
    } else {
        if line != "GO" {
            return Err(format!("expected GO, got {line:?}"));
        }
        let mut notifs = NotificationMap::new().map_err(e("notification map"))?;
        'wait: loop {
            agent.get_notifications(&mut notifs, None).map_err(e("get notifications"))?;
            if !notifs.is_empty().map_err(e("notification map"))? {
                for (_, msgs) in notifs.take_notifs().map_err(e("notifications"))? {
                    if msgs.iter().any(|m| m.as_bytes() == NOTIF) {
                        break 'wait;
                    }
                }
            }
            if Instant::now() >= deadline {
                return Err(format!("no completion notification after {:?}", args.timeout));
            }
            std::thread::sleep(POLL);
        }
    }
    let verified = if args.src { true } else { Pattern::new(PATTERN_SEED).check(&buf) };
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(libc::RUSAGE_SELF) - c0;
    say(&format!("DONE {wall} {cpu} {}", u8::from(verified)))?;
    // Serve (the peer may still be using our memory) until the parent says so.
    while let Ok(l) = read_line() {
        if l == "QUIT" {
            break;
        }
    }
    drop(request);
    drop(reg);
    drop(agent);
    drop(buf);
    Ok(())
}

//! `kvferry-nixl-engine`: a minimal engine-side process that exports pool memory over NIXL.
//!
//! ```text
//! kvferry-nixl-engine --name AGENT [--region PATH:LEN]... [--anon LEN]...
//! ```
//! Each `--region` maps `LEN` bytes of the file `PATH` shared (a memfd reopened through
//! `/proc/<pid>/fd/<n>` lets another process see the same pages); each `--anon` allocates
//! `LEN` private bytes. Regions are registered in command-line order (all `--region`s, then
//! all `--anon`s) with a NIXL agent named AGENT. The descriptor is printed as one line,
//! `KVFERRY-NIXL-DESCRIPTOR <json>`, then the process serves until its stdin closes.
//! Used by this crate's tests and benchmark as the "engine" in a separate process.
//!
//! `kvferry-nixl-engine --nixl-helper` instead runs the daemon-side NIXL helper process
//! (`kvferry_pool_nixl::helper_main`; the `kvferry` binary's hidden `nixl-helper` does the same).

use std::io::{BufRead, Write};
use std::process::ExitCode;

use kvferry_pool_nixl::{DESCRIPTOR_LINE_PREFIX, MemKind, NixlPoolExport, NixlRegion};

/// A shared or anonymous mapping, unmapped on drop.
struct Mapping {
    addr: *mut libc::c_void,
    len: usize,
}

impl Mapping {
    fn file(path: &str, len: usize) -> Result<Self, String> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| format!("{path}: {e}"))?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        // SAFETY: mapping a file we opened read-write; the kernel picks the address, so no
        // existing memory is affected. The mapping outlives `file` (mmap holds its own ref).
        let addr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if addr == libc::MAP_FAILED {
            return Err(format!("mmap {path} ({len} bytes): {}", std::io::Error::last_os_error()));
        }
        Ok(Self { addr, len })
    }

    fn anon(len: usize) -> Result<Self, String> {
        // SAFETY: a fresh private anonymous mapping at a kernel-chosen address.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(format!("mmap anonymous ({len} bytes): {}", std::io::Error::last_os_error()));
        }
        Ok(Self { addr, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` came from a successful mmap and are unmapped exactly once; the
        // NIXL export that registered them is dropped before the mappings (see `serve`).
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

fn parse_len(s: &str) -> Result<usize, String> {
    s.parse().map_err(|e| format!("bad length {s:?}: {e}"))
}

fn serve() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let mut name = None;
    let mut files = Vec::new();
    let mut anons = Vec::new();
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--name" => name = Some(val()?),
            "--region" => {
                let v = val()?;
                let (path, len) = v.rsplit_once(':').ok_or(format!("--region wants PATH:LEN, got {v:?}"))?;
                files.push((path.to_owned(), parse_len(len)?));
            }
            "--anon" => anons.push(parse_len(&val()?)?),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let name = name.ok_or("--name is required")?;
    let mut maps = Vec::new();
    for (path, len) in &files {
        maps.push(Mapping::file(path, *len)?);
    }
    for len in &anons {
        maps.push(Mapping::anon(*len)?);
    }
    // Declared after `maps`, so it is dropped (deregistered) before they are unmapped.
    let mut export = NixlPoolExport::new(&name).map_err(|e| e.to_string())?;
    for m in &maps {
        let region = NixlRegion { addr: m.addr as u64, len: m.len as u64, mem_type: MemKind::Dram, dev: 0 };
        // SAFETY: the mapping is live and read-write, and stays mapped until after `export`
        // is dropped (drop order above). Nothing in this process touches it meanwhile.
        unsafe { export.register(region) }.map_err(|e| e.to_string())?;
    }
    let desc = export.descriptor().map_err(|e| e.to_string())?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{DESCRIPTOR_LINE_PREFIX}{}", desc.to_json()).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    drop(out);
    // Serve until the parent closes our stdin (or says "quit").
    let mut line = String::new();
    let stdin = std::io::stdin();
    loop {
        line.clear();
        match stdin.lock().read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) if line.trim() == "quit" => break,
            Ok(_) => {}
        }
    }
    drop(export);
    Ok(())
}

fn main() -> ExitCode {
    if std::env::args().nth(1).as_deref() == Some("--nixl-helper") {
        return kvferry_pool_nixl::helper_main();
    }
    match serve() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvferry-nixl-engine: {e}");
            ExitCode::FAILURE
        }
    }
}

//! The workspace's rules, checked by machine. Each rule below quotes the ARCHITECTURE.md (or
//! ENGINEERING notes) line it enforces; a failure names the crate or file and the rule.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// The workspace's resolved dependency graph for this platform: crate name → the names of the
/// crates it depends on as normal (not dev, not build) dependencies.
struct Graph {
    members: BTreeSet<String>,
    normal: HashMap<String, BTreeSet<String>>,
}

fn graph() -> Graph {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--offline", "--filter-platform"])
        .arg(env!("KVFERRY_TIDY_TARGET"))
        .arg("--manifest-path")
        .arg(root().join("Cargo.toml"))
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    let m: Value = serde_json::from_slice(&out.stdout).unwrap();
    let name_of: HashMap<&str, &str> = m["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap()))
        .collect();
    let members = m["workspace_members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| name_of[id.as_str().unwrap()].to_owned())
        .collect();
    let mut normal: HashMap<String, BTreeSet<String>> = HashMap::new();
    for node in m["resolve"]["nodes"].as_array().unwrap() {
        let from = name_of[node["id"].as_str().unwrap()].to_owned();
        let deps = normal.entry(from).or_default();
        for d in node["deps"].as_array().unwrap() {
            if d["dep_kinds"].as_array().unwrap().iter().any(|k| k["kind"].is_null()) {
                deps.insert(name_of[d["pkg"].as_str().unwrap()].to_owned());
            }
        }
    }
    Graph { members, normal }
}

impl Graph {
    /// Every crate `krate` links, directly or through others.
    fn closure(&self, krate: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![krate.to_owned()];
        while let Some(k) = todo.pop() {
            for d in self.normal.get(&k).into_iter().flatten() {
                if seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    }

    fn direct(&self, krate: &str) -> BTreeSet<String> {
        self.normal.get(krate).cloned().unwrap_or_default()
    }
}

/// Crates that do I/O: runtimes, sockets, RPC, OS and accelerator bindings, and our own crates
/// that own sockets, processes or foreign memory.
const IO_CRATES: &[&str] = &[
    "tokio",
    "mio",
    "socket2",
    "quinn",
    "quinn-udp",
    "tonic",
    "hyper",
    "h2",
    "rustix",
    "nix",
    "cudarc",
    "nixl-sys",
    "kvferry-peer",
    "kvferry-daemon",
    "kvferry-pool-shm",
    "kvferry-pool-nixl",
    "kvferry-pool-cuda",
    "kvferry-engine-node",
    "kvferry-wanem",
];

const BACKENDS: &[&str] = &["kvferry-pool-shm", "kvferry-pool-nixl", "kvferry-pool-cuda"];

/// Where a forbidden edge was found: crate → what it must not link.
fn violations(
    g: &Graph,
    krates: &[&str],
    forbidden: &[&str],
    transitive: bool,
) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    for k in krates {
        assert!(g.members.contains(*k), "{k} is not a workspace member (rename? update this test)");
        let deps = if transitive { g.closure(k) } else { g.direct(k) };
        let bad: Vec<String> =
            forbidden.iter().filter(|f| deps.contains(**f)).map(|f| f.to_string()).collect();
        if !bad.is_empty() {
            out.insert(k.to_string(), bad);
        }
    }
    out
}

#[test]
fn boundaries_hold() {
    let g = graph();
    // "kvferry-model, kvferry-layout, kvferry-wire depend on no I/O crate."
    let pure = violations(&g, &["kvferry-model", "kvferry-layout", "kvferry-wire"], IO_CRATES, true);
    assert!(pure.is_empty(), "pure crates that link I/O crates: {pure:?}");
    // "kvferry-pool never depends on a backend; backends depend on it."
    let pool = violations(&g, &["kvferry-pool"], BACKENDS, true);
    assert!(pool.is_empty(), "kvferry-pool links a backend: {pool:?}");
    for b in BACKENDS {
        assert!(g.direct(b).contains("kvferry-pool"), "backend {b} does not depend on kvferry-pool");
    }
    // "kvferry-peer knows pools only through the MemoryBackend trait."
    let peer = violations(&g, &["kvferry-peer"], BACKENDS, true);
    assert!(peer.is_empty(), "kvferry-peer links a backend: {peer:?}");
    // "No core crate depends on tonic."
    let cores = [
        "kvferry-model",
        "kvferry-layout",
        "kvferry-pool",
        "kvferry-pool-shm",
        "kvferry-pool-nixl",
        "kvferry-pool-cuda",
        "kvferry-wire",
        "kvferry-peer",
        "kvferry-engine",
        "kvferry-engine-sdk",
    ];
    let grpc = violations(&g, &cores, &["tonic", "kvferry-proto"], true);
    assert!(grpc.is_empty(), "core crates that link tonic: {grpc:?}");
    // "FFI (cudarc, nixl-sys) only in the backends, and nixl-sys in the NIXL baseline."
    let ffi_ok = |m: &str| BACKENDS.contains(&m) || m == "kvferry-baselines";
    let others: Vec<&str> = g.members.iter().map(String::as_str).filter(|m| !ffi_ok(m)).collect();
    let ffi = violations(&g, &others, &["cudarc", "nixl-sys"], false);
    assert!(ffi.is_empty(), "FFI crates outside the backends: {ffi:?}");
}

#[test]
fn boundaries_check_finds_a_forbidden_edge() {
    // The check itself can fail: the daemon links tokio (directly) and the backends (through
    // its registry), so asking the same of it reports both.
    let g = graph();
    let v = violations(&g, &["kvferry-daemon"], &["tokio", "kvferry-pool-shm"], true);
    assert_eq!(v.get("kvferry-daemon").map(Vec::len), Some(2), "{v:?}");
}

/// Every Rust file the repository tracks, or would (below `crates/`, outside `target`).
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_source_file_opens_with_a_module_doc() {
    // ENGINEERING: "Module docs (//!) in every file, saying what the module owns."
    let mut files = Vec::new();
    rust_files(&root().join("crates"), &mut files);
    assert!(files.len() > 100, "found only {} files: wrong root?", files.len());
    let missing: Vec<String> = files
        .iter()
        .filter(|f| !std::fs::read_to_string(f).unwrap().trim_start().starts_with("//!"))
        .map(|f| f.strip_prefix(root()).unwrap().display().to_string())
        .collect();
    assert!(missing.is_empty(), "files without a leading //! doc: {missing:?}");
}

/// `[*dependencies]` entries of a manifest: (name, whether it names its own version), skipping
/// path dependencies.
fn declared(manifest: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let mut in_deps = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line.trim_matches(['[', ']']).ends_with("dependencies");
            continue;
        }
        let Some((name, spec)) = line.split_once('=') else { continue };
        if !in_deps || line.starts_with('#') {
            continue;
        }
        let name = name.trim().trim_end_matches(".workspace").to_owned();
        let inherits = line.split_once('=').is_some_and(|(k, _)| k.trim().ends_with(".workspace"))
            || spec.contains("workspace = true");
        if !spec.contains("path =") {
            out.push((name, !inherits));
        }
    }
    out
}

#[test]
fn shared_dependency_versions_live_in_the_workspace() {
    // ENGINEERING: "[workspace.dependencies]": a dependency two crates use has one version.
    let mut users: BTreeMap<String, Vec<(String, bool)>> = BTreeMap::new();
    for e in std::fs::read_dir(root().join("crates")).unwrap() {
        let dir = e.unwrap().path();
        let Ok(text) = std::fs::read_to_string(dir.join("Cargo.toml")) else { continue };
        let krate = dir.file_name().unwrap().to_string_lossy().into_owned();
        let mut seen = BTreeSet::new();
        for (name, own_version) in declared(&text) {
            if seen.insert((name.clone(), own_version)) {
                users.entry(name).or_default().push((krate.clone(), own_version));
            }
        }
    }
    let bad: Vec<String> = users
        .iter()
        .filter(|(_, u)| {
            u.iter().map(|(k, _)| k).collect::<BTreeSet<_>>().len() > 1 && u.iter().any(|(_, own)| *own)
        })
        .map(|(name, u)| {
            format!("{name}: {:?}", u.iter().filter(|(_, own)| *own).map(|(k, _)| k).collect::<Vec<_>>())
        })
        .collect();
    assert!(
        bad.is_empty(),
        "shared dependencies with a version of their own (move to [workspace.dependencies]): {bad:?}"
    );
    // The parser itself: an inline version is seen, an inherited one and a path are not.
    assert_eq!(
        declared(
            "[dependencies]\na = \"1\"\nb.workspace = true\nc = { workspace = true, features = [\"x\"] }\nd = { path = \"../d\" }\n[features]\ne = []"
        ),
        vec![("a".into(), true), ("b".into(), false), ("c".into(), false)]
    );
}

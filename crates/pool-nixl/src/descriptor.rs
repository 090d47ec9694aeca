//! What an engine hands the daemon: [`NixlPoolDescriptor`] (agent name, NIXL metadata blob,
//! regions), its JSON form, and validation of both before anything reaches NIXL.
//!
//! The metadata blob is NIXL's own serialization (`nixlSerDes|Agent<u64 len><name>|Conns...`),
//! the same from the C++, Rust and Python APIs. [`metadata_agent_name`] reads its header
//! without trusting it, so a foreign or truncated blob is refused with a typed error before it
//! is handed to `loadRemoteMD`.

use kvferry_pool::PoolError;
use serde::{Deserialize, Serialize};

/// Kind of memory a region lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemKind {
    /// Host memory (NIXL `DRAM_SEG`).
    Dram,
    /// GPU memory (NIXL `VRAM_SEG`); `dev` is the CUDA device id.
    Vram,
}

impl MemKind {
    #[cfg(feature = "nixl")]
    pub(crate) fn nixl(self) -> nixl_sys::MemType {
        match self {
            MemKind::Dram => nixl_sys::MemType::Dram,
            MemKind::Vram => nixl_sys::MemType::Vram,
        }
    }
}

/// One registered memory region of an engine's pool (index = `Extent::region`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlRegion {
    /// Start address in the engine process (or device address for VRAM).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// DRAM or VRAM.
    pub mem_type: MemKind,
    /// Device id (0 for DRAM).
    pub dev: u64,
}

/// Everything the daemon needs to reach an engine's pool through NIXL.
///
/// JSON form (what a Python engine prints): `{"agent_name": "...", "agent_metadata": "<hex>",
/// "regions": [{"addr": 1234, "len": 4096, "mem_type": "dram", "dev": 0}]}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlPoolDescriptor {
    /// Name of the engine's NIXL agent; must match the name inside `agent_metadata`.
    pub agent_name: String,
    /// The engine agent's metadata (`getLocalMD` / Python `get_agent_metadata()`).
    #[serde(with = "hex_bytes")]
    pub agent_metadata: Vec<u8>,
    /// The pool's regions, registered with that agent.
    pub regions: Vec<NixlRegion>,
}

/// Largest metadata blob accepted (a real one is a few hundred bytes per region).
pub const MAX_METADATA_BYTES: usize = 64 << 20;
const MAX_NAME_BYTES: u64 = 4096;
const SERDES_HEADER: &[u8] = b"nixlSerDes|";
const AGENT_TAG: &[u8] = b"Agent";

fn bad(msg: impl Into<String>) -> PoolError {
    PoolError::BadMetadata(msg.into())
}

/// Read the agent name out of a NIXL metadata blob's header without loading it.
///
/// Refuses (with `PoolError::BadMetadata`) an empty blob, one that is not NIXL serialization
/// (no `nixlSerDes|Agent` header), and one truncated inside the name or right after it.
/// Truncation further in is caught by NIXL itself when the blob is loaded.
pub fn metadata_agent_name(md: &[u8]) -> Result<String, PoolError> {
    if md.is_empty() {
        return Err(bad("empty NIXL metadata"));
    }
    if md.len() > MAX_METADATA_BYTES {
        return Err(bad(format!("NIXL metadata of {} bytes exceeds {MAX_METADATA_BYTES}", md.len())));
    }
    let Some(rest) = md.strip_prefix(SERDES_HEADER) else {
        return Err(bad(format!(
            "not NIXL metadata: missing `nixlSerDes|` header (starts with {:?})",
            String::from_utf8_lossy(&md[..md.len().min(16)])
        )));
    };
    let Some(rest) = rest.strip_prefix(AGENT_TAG) else {
        return Err(bad("not NIXL agent metadata: first field is not `Agent` (truncated or foreign)"));
    };
    let Some((len_bytes, rest)) = rest.split_first_chunk::<8>() else {
        return Err(bad("truncated NIXL metadata: agent name length cut off"));
    };
    let n = u64::from_le_bytes(*len_bytes);
    if n == 0 || n > MAX_NAME_BYTES {
        return Err(bad(format!("NIXL metadata names an agent of {n} bytes (corrupt or foreign)")));
    }
    let n = n as usize;
    if rest.len() < n + 1 {
        return Err(bad("truncated NIXL metadata: agent name cut off"));
    }
    if rest[n] != b'|' {
        return Err(bad("corrupt NIXL metadata: no field separator after the agent name"));
    }
    let name = std::str::from_utf8(&rest[..n]).map_err(|_| bad("NIXL metadata agent name is not UTF-8"))?;
    if rest.len() == n + 1 {
        return Err(bad("truncated NIXL metadata: nothing after the agent name"));
    }
    Ok(name.to_owned())
}

impl NixlPoolDescriptor {
    /// Parse the JSON form; any error is `PoolError::BadMetadata`.
    pub fn from_json(s: &str) -> Result<Self, PoolError> {
        serde_json::from_str(s).map_err(|e| bad(format!("NIXL pool descriptor JSON: {e}")))
    }

    /// The JSON form (one line).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a descriptor always serializes")
    }

    /// Check everything that can be checked without NIXL: a sane agent name that matches the
    /// metadata's header, at least one region, non-empty regions that do not wrap the address
    /// space, and one memory kind for the whole pool. Returns that memory kind.
    pub fn validate(&self) -> Result<MemKind, PoolError> {
        if self.agent_name.is_empty() || self.agent_name.contains('\0') {
            return Err(bad(format!("invalid agent name {:?}", self.agent_name)));
        }
        let in_md = metadata_agent_name(&self.agent_metadata)?;
        if in_md != self.agent_name {
            return Err(bad(format!(
                "metadata belongs to agent {in_md:?}, descriptor names {:?}",
                self.agent_name
            )));
        }
        let Some(first) = self.regions.first() else {
            return Err(bad("descriptor has no regions"));
        };
        if u32::try_from(self.regions.len()).is_err() {
            return Err(bad("too many regions"));
        }
        for (i, r) in self.regions.iter().enumerate() {
            if r.len == 0 {
                return Err(bad(format!("region {i} is empty")));
            }
            if r.addr == 0 || r.addr.checked_add(r.len).is_none() || usize::try_from(r.addr + r.len).is_err()
            {
                return Err(bad(format!("region {i} has an invalid range addr {:#x} len {}", r.addr, r.len)));
            }
            if r.mem_type != first.mem_type {
                return Err(bad(format!(
                    "region {i} is {:?} but region 0 is {:?}: one memory kind per pool",
                    r.mem_type, first.mem_type
                )));
            }
            if r.mem_type == MemKind::Dram && r.dev != 0 {
                return Err(bad(format!("region {i} is DRAM with device id {}", r.dev)));
            }
        }
        Ok(first.mem_type)
    }
}

mod hex_bytes {
    //! Bytes as a lowercase hex string in JSON.
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub(super) fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        let mut out = String::with_capacity(v.len() * 2);
        for b in v {
            out.push(char::from_digit(u32::from(b >> 4), 16).expect("nibble"));
            out.push(char::from_digit(u32::from(b & 15), 16).expect("nibble"));
        }
        s.serialize_str(&out)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        if s.len() % 2 != 0 {
            return Err(D::Error::custom("hex string of odd length"));
        }
        s.as_bytes()
            .chunks_exact(2)
            .map(|p| {
                let hi = (p[0] as char).to_digit(16);
                let lo = (p[1] as char).to_digit(16);
                match (hi, lo) {
                    (Some(h), Some(l)) => Ok((h * 16 + l) as u8),
                    _ => Err(D::Error::custom("invalid hex digit")),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(name: &str) -> Vec<u8> {
        let mut v = b"nixlSerDes|Agent".to_vec();
        v.extend_from_slice(&(name.len() as u64).to_le_bytes());
        v.extend_from_slice(name.as_bytes());
        v.extend_from_slice(b"|Conns\x08\0\0\0\0\0\0\0");
        v
    }

    fn desc(name: &str) -> NixlPoolDescriptor {
        NixlPoolDescriptor {
            agent_name: name.into(),
            agent_metadata: md(name),
            regions: vec![NixlRegion { addr: 0x1000, len: 4096, mem_type: MemKind::Dram, dev: 0 }],
        }
    }

    #[test]
    fn reads_agent_name() {
        assert_eq!(metadata_agent_name(&md("py-engine")).unwrap(), "py-engine");
    }

    #[test]
    fn refuses_empty_foreign_and_truncated() {
        let good = md("engine-7");
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", vec![]),
            ("foreign", b"hello world, not nixl".to_vec()),
            ("json", br#"{"agent":"x"}"#.to_vec()),
            ("header only", b"nixlSerDes|".to_vec()),
            ("cut in length", good[..20].to_vec()),
            ("cut in name", good[..good.len() - 14].to_vec()),
            ("cut after name", good[..16 + 8 + 8 + 1].to_vec()),
        ];
        for (what, blob) in cases {
            match metadata_agent_name(&blob) {
                Err(PoolError::BadMetadata(msg)) => assert!(!msg.is_empty(), "{what}"),
                other => panic!("{what}: expected BadMetadata, got {other:?}"),
            }
        }
        let mut huge_len = good.clone();
        huge_len[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(metadata_agent_name(&huge_len), Err(PoolError::BadMetadata(_))));
    }

    #[test]
    fn validate_checks_name_and_regions() {
        assert_eq!(desc("a").validate().unwrap(), MemKind::Dram);
        let mut d = desc("a");
        d.agent_name = "b".into();
        assert!(matches!(d.validate(), Err(PoolError::BadMetadata(m)) if m.contains("\"a\"")));
        let mut d = desc("a");
        d.regions.clear();
        assert!(matches!(d.validate(), Err(PoolError::BadMetadata(_))));
        let mut d = desc("a");
        d.regions[0].len = 0;
        assert!(matches!(d.validate(), Err(PoolError::BadMetadata(_))));
        let mut d = desc("a");
        d.regions[0].addr = u64::MAX - 10;
        assert!(matches!(d.validate(), Err(PoolError::BadMetadata(_))));
        let mut d = desc("a");
        d.regions.push(NixlRegion { addr: 0x9000, len: 1, mem_type: MemKind::Vram, dev: 0 });
        assert!(matches!(d.validate(), Err(PoolError::BadMetadata(m)) if m.contains("one memory kind")));
    }

    #[test]
    fn json_round_trip_and_bad_json() {
        let d = desc("engine");
        let j = d.to_json();
        assert!(j.contains("\"mem_type\":\"dram\""), "{j}");
        assert_eq!(NixlPoolDescriptor::from_json(&j).unwrap(), d);
        for bad_json in ["", "{}", "not json", r#"{"agent_name":"x","agent_metadata":"abc","regions":[]}"#] {
            assert!(
                matches!(NixlPoolDescriptor::from_json(bad_json), Err(PoolError::BadMetadata(_))),
                "{bad_json}"
            );
        }
    }
}

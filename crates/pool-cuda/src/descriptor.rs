//! The description of an engine's KV pool as CUDA IPC handles: what an engine sends the daemon
//! so that the daemon can open the pool's device memory (`cuIpcOpenMemHandle`).
//!
//! Compiled with and without the `cuda` feature: it is plain data (serde), so control-plane code
//! can pass it along on machines with no GPU. Handles are serialized as lowercase hex strings.

use serde::{Deserialize, Serialize};

/// Size of a CUDA IPC memory or event handle (`CUipcMemHandle`, `CUipcEventHandle`).
pub const IPC_HANDLE_LEN: usize = 64;

/// One region of a pool: a range inside a device allocation exported with `cuIpcGetMemHandle`.
///
/// The handle always names the *base* of an allocation (that is what `cuIpcGetMemHandle`
/// exports); `offset` locates the region inside it. Several regions may share one handle (one
/// allocation carved into regions): the daemon opens each distinct handle once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcRegion {
    /// The 64-byte `CUipcMemHandle` of the allocation.
    #[serde(with = "hex_handle")]
    pub handle: [u8; IPC_HANDLE_LEN],
    /// Byte offset of the region from the base of the allocation.
    pub offset: u64,
    /// Length of the region in bytes (> 0).
    pub len: u64,
}

/// An engine's KV pool, as CUDA IPC handles: region `i` of the pool is `handles[i]`
/// (the index used by `Extent::region`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaIpcDescriptor {
    /// The regions, in the pool's region order.
    pub handles: Vec<IpcRegion>,
    /// Device ordinal of the pool's memory, as the daemon numbers devices.
    pub device: u32,
    /// The device's UUID (16 bytes, hex), when the engine knows it. Ordinals differ between
    /// processes with different `CUDA_VISIBLE_DEVICES`; when present, the daemon opens the
    /// device with this UUID and refuses the descriptor if it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_uuid: Option<String>,
    /// A `CUipcEventHandle` (interprocess event) the engine records after writing the pool;
    /// when present, every copy waits on it (`cuStreamWaitEvent`) before it starts.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "hex_handle_opt")]
    pub ready_event: Option<[u8; IPC_HANDLE_LEN]>,
}

/// A descriptor that cannot describe a pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorError {
    /// No regions at all.
    #[error("descriptor has no regions")]
    Empty,
    /// A region of length 0.
    #[error("region {region} has length 0")]
    EmptyRegion {
        /// Index of the region.
        region: usize,
    },
    /// `offset + len` overflows.
    #[error("region {region}: offset {offset} + len {len} overflows")]
    Overflow {
        /// Index of the region.
        region: usize,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: u64,
    },
    /// More regions than `Extent::region` (u32) can address.
    #[error("descriptor has {0} regions, more than u32 can index")]
    TooManyRegions(usize),
    /// The UUID is not 32 hex digits.
    #[error("device_uuid {0:?} is not 32 hex digits")]
    BadUuid(String),
}

impl CudaIpcDescriptor {
    /// Checks what can be checked without a driver: at least one region, no empty region, no
    /// overflowing range, a well-formed UUID. Bounds against the real allocation sizes are
    /// checked when the handles are opened.
    pub fn validate(&self) -> Result<(), DescriptorError> {
        if self.handles.is_empty() {
            return Err(DescriptorError::Empty);
        }
        if u32::try_from(self.handles.len()).is_err() {
            return Err(DescriptorError::TooManyRegions(self.handles.len()));
        }
        for (region, r) in self.handles.iter().enumerate() {
            if r.len == 0 {
                return Err(DescriptorError::EmptyRegion { region });
            }
            if r.offset.checked_add(r.len).is_none() {
                return Err(DescriptorError::Overflow { region, offset: r.offset, len: r.len });
            }
        }
        if let Some(uuid) = &self.device_uuid {
            self.uuid_bytes().ok_or_else(|| DescriptorError::BadUuid(uuid.clone()))?;
        }
        Ok(())
    }

    /// The device UUID as bytes, when present and well formed.
    pub fn uuid_bytes(&self) -> Option<[u8; 16]> {
        let mut out = [0u8; 16];
        decode_hex(self.device_uuid.as_deref()?, &mut out).ok()?;
        Some(out)
    }
}

/// Lowercase hex of `bytes`.
pub fn encode_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    s
}

/// Decodes hex (either case) into exactly `out.len()` bytes.
pub fn decode_hex(s: &str, out: &mut [u8]) -> Result<(), String> {
    let digits = s.as_bytes();
    if digits.len() != out.len() * 2 {
        return Err(format!("expected {} hex digits, got {}", out.len() * 2, digits.len()));
    }
    fn nibble(c: u8) -> Result<u8, String> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(format!("not a hex digit: {:?}", char::from(c))),
        }
    }
    for (o, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *o = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Ok(())
}

mod hex_handle {
    //! serde for `[u8; 64]` as a 128-digit hex string.
    use super::{IPC_HANDLE_LEN, decode_hex, encode_hex};
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub(super) fn serialize<S: Serializer>(h: &[u8; IPC_HANDLE_LEN], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&encode_hex(h))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; IPC_HANDLE_LEN], D::Error> {
        let s = String::deserialize(d)?;
        let mut out = [0u8; IPC_HANDLE_LEN];
        decode_hex(&s, &mut out).map_err(D::Error::custom)?;
        Ok(out)
    }
}

mod hex_handle_opt {
    //! serde for `Option<[u8; 64]>` as an optional 128-digit hex string.
    use super::{IPC_HANDLE_LEN, decode_hex, encode_hex};
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub(super) fn serialize<S: Serializer>(
        h: &Option<[u8; IPC_HANDLE_LEN]>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match h {
            Some(h) => s.serialize_some(&encode_hex(h)),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<[u8; IPC_HANDLE_LEN]>, D::Error> {
        let Some(s) = Option::<String>::deserialize(d)? else { return Ok(None) };
        let mut out = [0u8; IPC_HANDLE_LEN];
        decode_hex(&s, &mut out).map_err(D::Error::custom)?;
        Ok(Some(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CudaIpcDescriptor {
        let mut h0 = [0u8; IPC_HANDLE_LEN];
        h0.iter_mut().enumerate().for_each(|(i, b)| *b = (i * 7) as u8);
        CudaIpcDescriptor {
            handles: vec![
                IpcRegion { handle: h0, offset: 0, len: 1 << 20 },
                IpcRegion { handle: h0, offset: 1 << 20, len: 4096 },
                IpcRegion { handle: [0xff; IPC_HANDLE_LEN], offset: 256, len: 3 },
            ],
            device: 3,
            device_uuid: Some("00112233445566778899aabbccddeeff".into()),
            ready_event: Some([0xa5; IPC_HANDLE_LEN]),
        }
    }

    #[test]
    fn json_round_trip() {
        let d = sample();
        let json = serde_json::to_string(&d).unwrap();
        assert!(json.contains(&"ff".repeat(IPC_HANDLE_LEN)), "{json}");
        let back: CudaIpcDescriptor = serde_json::from_str(&json).unwrap();
        assert_eq!(back, d);
        assert!(back.validate().is_ok());
        assert_eq!(back.uuid_bytes().unwrap()[15], 0xff);
    }

    #[test]
    fn optional_fields_may_be_absent() {
        let mut d = sample();
        d.device_uuid = None;
        d.ready_event = None;
        let json = serde_json::to_string(&d).unwrap();
        assert!(!json.contains("device_uuid") && !json.contains("ready_event"), "{json}");
        let back: CudaIpcDescriptor = serde_json::from_str(&json).unwrap();
        assert_eq!(back, d);
    }

    #[test]
    fn bad_handles_are_refused() {
        let short = r#"{"handles":[{"handle":"abcd","offset":0,"len":1}],"device":0}"#;
        assert!(serde_json::from_str::<CudaIpcDescriptor>(short).is_err());
        let not_hex =
            format!(r#"{{"handles":[{{"handle":"{}","offset":0,"len":1}}],"device":0}}"#, "zz".repeat(64));
        assert!(serde_json::from_str::<CudaIpcDescriptor>(&not_hex).is_err());
    }

    #[test]
    fn validate_catches_shape_errors() {
        let mut d = sample();
        d.handles.clear();
        assert_eq!(d.validate(), Err(DescriptorError::Empty));

        let mut d = sample();
        d.handles[1].len = 0;
        assert_eq!(d.validate(), Err(DescriptorError::EmptyRegion { region: 1 }));

        let mut d = sample();
        d.handles[2].offset = u64::MAX;
        assert!(matches!(d.validate(), Err(DescriptorError::Overflow { region: 2, .. })));

        let mut d = sample();
        d.device_uuid = Some("xyz".into());
        assert!(matches!(d.validate(), Err(DescriptorError::BadUuid(_))));
    }

    #[test]
    fn hex_round_trip() {
        let bytes: Vec<u8> = (0..=255).collect();
        let s = encode_hex(&bytes);
        let mut back = vec![0u8; 256];
        decode_hex(&s, &mut back).unwrap();
        assert_eq!(back, bytes);
        decode_hex(&s.to_uppercase(), &mut back).unwrap();
        assert_eq!(back, bytes);
    }
}

//! Known-answer vectors shared with the Python package (`python/tests/test_keys.py` reads the
//! same `testdata/kat.json`): block keys and layout fingerprint digests must be byte-identical
//! in both languages.

use kvferry_layout::{AttnSpec, Dtype, PoolLayout, StrideOrder, block_hashes, hex};
use serde_json::Value;

fn kat() -> Value {
    serde_json::from_str(include_str!("../testdata/kat.json")).expect("kat.json parses")
}

fn u32_of(v: &Value) -> u32 {
    v.as_u64().and_then(|x| u32::try_from(x).ok()).expect("a u32")
}

#[test]
fn block_hashes_match_the_shared_vectors() {
    let kat = kat();
    let vectors = kat["block_hashes"].as_array().expect("block_hashes");
    assert!(vectors.len() >= 5);
    for v in vectors {
        let tenant = v["tenant"].as_str().expect("tenant");
        let tokens: Vec<u32> = v["token_ids"].as_array().expect("tokens").iter().map(u32_of).collect();
        let bs = u32_of(&v["block_size"]);
        let want: Vec<&str> =
            v["hashes"].as_array().expect("hashes").iter().map(|h| h.as_str().unwrap()).collect();
        let got: Vec<String> = block_hashes(tenant.as_bytes(), &tokens, bs).iter().map(|h| hex(h)).collect();
        assert_eq!(got, want, "tenant {tenant:?}, {} tokens, block {bs}", tokens.len());
    }
}

#[test]
fn fingerprint_digests_match_the_shared_vectors() {
    let kat = kat();
    for v in kat["fingerprints"].as_array().expect("fingerprints") {
        let dtype = match v["dtype"].as_str().unwrap() {
            "f32" => Dtype::F32,
            "bf16" => Dtype::Bf16,
            "f16" => Dtype::F16,
            other => panic!("dtype {other}"),
        };
        let spec = AttnSpec {
            layers: u32_of(&v["layers"]),
            kv_heads: u32_of(&v["kv_heads"]),
            head_dim: u32_of(&v["head_dim"]),
            block_size: u32_of(&v["block_size"]),
            dtype,
        };
        let layout = match v["kind"].as_str().unwrap() {
            "vllm_cpu" => PoolLayout::vllm_cpu(spec, 8),
            "vllm_flash_attn/hnd" => PoolLayout::vllm_flash_attn(spec, 8, StrideOrder::Hnd),
            "vllm_flash_attn/nhd" => PoolLayout::vllm_flash_attn(spec, 8, StrideOrder::Nhd),
            other => panic!("kind {other}"),
        }
        .expect("layout");
        let fp = layout.fingerprint(v["model_id"].as_str().unwrap());
        assert_eq!(fp.kind.to_string(), v["kind"].as_str().unwrap());
        assert_eq!(fp.digest(), v["digest"].as_str().unwrap(), "{v}");
    }
}

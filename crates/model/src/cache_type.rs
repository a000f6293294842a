//! The element types a KV cache may hold keys and values in, as llama.cpp's
//! `-ctk`/`-ctv` name them, and what each costs per cached row.

use baton_ggml::DType;

use crate::hparams::HParams;
use crate::ModelError;

/// An element type of cached keys or values. Quantized types store blocks of 32 values
/// with their scale; recurrent states never take them (they stay f32).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CacheType {
    /// 4 bytes a value (attention reads it as f16, as llama.cpp does).
    F32,
    /// 2 bytes a value: the default.
    #[default]
    F16,
    /// 2 bytes a value, f32's range.
    Bf16,
    /// 8.5 bits a value (34 bytes per 32).
    Q8_0,
    /// 4.5 bits a value (18 bytes per 32).
    Q4_0,
    /// 5 bits a value (20 bytes per 32).
    Q4_1,
    /// 4.5 bits a value, non-linear levels (18 bytes per 32).
    Iq4Nl,
    /// 5.5 bits a value (22 bytes per 32).
    Q5_0,
    /// 6 bits a value (24 bytes per 32).
    Q5_1,
}

/// A name that is not a [`CacheType`]'s.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("'{0}' is not a KV cache type; the types are {list}", list = CacheType::names())]
pub struct UnknownCacheType(pub String);

impl CacheType {
    /// Every type, in llama.cpp's order.
    pub const ALL: [CacheType; 9] = [
        CacheType::F32,
        CacheType::F16,
        CacheType::Bf16,
        CacheType::Q8_0,
        CacheType::Q4_0,
        CacheType::Q4_1,
        CacheType::Iq4Nl,
        CacheType::Q5_0,
        CacheType::Q5_1,
    ];

    /// The type's name, as ggml and llama.cpp's `-ctk` write it (`q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            CacheType::F32 => "f32",
            CacheType::F16 => "f16",
            CacheType::Bf16 => "bf16",
            CacheType::Q8_0 => "q8_0",
            CacheType::Q4_0 => "q4_0",
            CacheType::Q4_1 => "q4_1",
            CacheType::Iq4Nl => "iq4_nl",
            CacheType::Q5_0 => "q5_0",
            CacheType::Q5_1 => "q5_1",
        }
    }

    /// Every type's name, comma-separated.
    pub fn names() -> String {
        CacheType::ALL.map(CacheType::name).join(", ")
    }

    /// The type named `name`.
    pub fn parse(name: &str) -> Result<CacheType, UnknownCacheType> {
        CacheType::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| UnknownCacheType(name.to_string()))
    }

    /// The ggml element type.
    pub fn dtype(self) -> DType {
        match self {
            CacheType::F32 => DType::F32,
            CacheType::F16 => DType::F16,
            CacheType::Bf16 => DType::BF16,
            CacheType::Q8_0 => DType::Q8_0,
            CacheType::Q4_0 => DType::Q4_0,
            CacheType::Q4_1 => DType::Q4_1,
            CacheType::Iq4Nl => DType::IQ4_NL,
            CacheType::Q5_0 => DType::Q5_0,
            CacheType::Q5_1 => DType::Q5_1,
        }
    }

    /// Whether values are stored in quantized blocks.
    pub fn is_quantized(self) -> bool {
        self.dtype().is_quantized()
    }

    /// Values per block (1 for the float types).
    pub fn block_size(self) -> usize {
        self.dtype().block_size()
    }

    /// Bytes of a cached row of `n` values (ggml's `ggml_row_size`; a partial block
    /// counts whole, though a cache never holds one: see [`KvTypes::check`]).
    pub fn row_bytes(self, n: usize) -> usize {
        let block = self.block_size();
        n.div_ceil(block) * self.dtype().row_bytes(block)
    }
}

impl std::fmt::Display for CacheType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CacheType {
    type Err = UnknownCacheType;

    fn from_str(s: &str) -> Result<CacheType, UnknownCacheType> {
        CacheType::parse(s)
    }
}

/// The element types of a KV cache's keys and of its values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvTypes {
    /// Keys (`--cache-type-k`).
    pub k: CacheType,
    /// Values (`--cache-type-v`).
    pub v: CacheType,
}

impl KvTypes {
    /// Keys and values both of type `t`.
    pub fn both(t: CacheType) -> KvTypes {
        KvTypes { k: t, v: t }
    }

    /// Whether the model's cache can hold keys and values of these types: a quantized
    /// type's blocks must not straddle two heads (attention views the cache a head at
    /// a time, as llama.cpp requires), and MLA's compressed rows, whose values are a
    /// view of the keys, stay f16.
    pub fn check(&self, hp: &HParams) -> Result<(), ModelError> {
        if *self == KvTypes::default() || !(0..hp.n_layer).any(|l| hp.has_kv(l)) {
            return Ok(());
        }
        if hp.keys_only() {
            return Err(ModelError::BadConfig(format!(
                "a KV cache of {}/{}: this model's attention (MLA, or DeepSeek V4's) keeps its \
                 keys-only cache in f16 only",
                self.k, self.v
            )));
        }
        for (flag, t, head) in [
            ("--cache-type-k", self.k, hp.head_dim_k),
            ("--cache-type-v", self.v, hp.head_dim_v),
        ] {
            if head % t.block_size() != 0 {
                return Err(ModelError::BadConfig(format!(
                    "{flag} {t} stores blocks of {} values, which do not divide this model's head size {head}",
                    t.block_size()
                )));
            }
        }
        Ok(())
    }

    /// Size of the Walsh-Hadamard rotation applied to queries and keys before a
    /// quantized key cache (0: none). llama.cpp rotates so that outliers spread over a
    /// block before it is quantized; the scores do not change (the rotation is
    /// orthonormal) and being the same as llama.cpp keeps its tokens: 64, doubled while
    /// it divides the head size, when the head size is a multiple of 64.
    pub fn k_rotation(&self, hp: &HParams) -> usize {
        if !self.k.is_quantized() || hp.head_dim_k == 0 || !hp.head_dim_k.is_multiple_of(64) {
            return 0;
        }
        let mut n = 64;
        while hp.head_dim_k.is_multiple_of(2 * n) {
            n *= 2;
        }
        n
    }

    /// Size of the rotation of values before a quantized value cache, undone on the
    /// attention's output (0: none): 64 when the head size is a multiple of 64.
    pub fn v_rotation(&self, hp: &HParams) -> usize {
        let quantized = self.v.is_quantized() && !hp.keys_only();
        if quantized && hp.head_dim_v > 0 && hp.head_dim_v.is_multiple_of(64) {
            64
        } else {
            0
        }
    }
}

/// The orthonormal Walsh-Hadamard matrix of size `n` (a power of two), row by row, as
/// llama.cpp generates it: its square is the identity.
pub fn hadamard(n: usize) -> Vec<f32> {
    let mut m = vec![0f32; n * n];
    m[0] = (1.0 / f64::from((n as f32).sqrt())) as f32;
    let mut s = 1;
    while s < n {
        for i in 0..s {
            for j in 0..s {
                let val = m[i * n + j];
                m[(i + s) * n + j] = val;
                m[i * n + j + s] = val;
                m[(i + s) * n + j + s] = -val;
            }
        }
        s *= 2;
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_unknown_ones_list_the_types() {
        for t in CacheType::ALL {
            assert_eq!(CacheType::parse(t.name()), Ok(t));
            assert_eq!(t.dtype().name(), t.name(), "ggml names it the same");
        }
        let err = CacheType::parse("q3_k").unwrap_err().to_string();
        assert_eq!(
            err,
            "'q3_k' is not a KV cache type; the types are f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1"
        );
    }

    #[test]
    fn rows_cost_what_ggml_says() {
        // 64 values: f16 128 bytes, q8_0 2 blocks of 34, q4_0 2 of 18.
        assert_eq!(CacheType::F16.row_bytes(64), 128);
        assert_eq!(CacheType::F32.row_bytes(64), 256);
        assert_eq!(CacheType::Q8_0.row_bytes(64), 68);
        assert_eq!(CacheType::Q4_0.row_bytes(64), 36);
        assert_eq!(CacheType::Q5_1.row_bytes(64), 48);
        assert!(CacheType::Q8_0.is_quantized() && !CacheType::Bf16.is_quantized());
    }

    #[test]
    fn hadamard_squares_to_the_identity() {
        for n in [64, 128, 256] {
            let h = hadamard(n);
            for i in 0..n {
                for j in 0..n {
                    let dot: f32 = (0..n).map(|k| h[i * n + k] * h[k * n + j]).sum();
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((dot - want).abs() < 1e-5, "n {n} ({i}, {j}): {dot}");
                }
            }
        }
    }
}

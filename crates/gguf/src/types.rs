//! ggml tensor types: their numeric ids in GGUF files, names and block layouts.

use std::fmt;

/// The element type of a tensor, as ggml numbers it in GGUF files.
///
/// Ids that ggml has retired (4, 5, 31..=33, 36..=38) are deliberately absent: files using
/// them cannot be run by current ggml either.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// 4-bit, blocks of 32 with one scale.
    Q4_0,
    /// 4-bit, blocks of 32 with scale and minimum.
    Q4_1,
    /// 5-bit, blocks of 32 with one scale.
    Q5_0,
    /// 5-bit, blocks of 32 with scale and minimum.
    Q5_1,
    /// 8-bit, blocks of 32 with one scale.
    Q8_0,
    /// 8-bit, blocks of 32 with scale and sum.
    Q8_1,
    /// k-quant, 2-bit.
    Q2K,
    /// k-quant, 3-bit.
    Q3K,
    /// k-quant, 4-bit.
    Q4K,
    /// k-quant, 5-bit.
    Q5K,
    /// k-quant, 6-bit.
    Q6K,
    /// k-quant, 8-bit (intermediate type of dot products).
    Q8K,
    /// i-quant, 2.06 bits per weight.
    IQ2XXS,
    /// i-quant, 2.31 bits per weight.
    IQ2XS,
    /// i-quant, 3.06 bits per weight.
    IQ3XXS,
    /// i-quant, 1.56 bits per weight.
    IQ1S,
    /// i-quant, 4.5 bits per weight, non-linear, blocks of 32.
    IQ4NL,
    /// i-quant, 3.44 bits per weight.
    IQ3S,
    /// i-quant, 2.5 bits per weight.
    IQ2S,
    /// i-quant, 4.25 bits per weight.
    IQ4XS,
    /// 8-bit integer.
    I8,
    /// 16-bit integer.
    I16,
    /// 32-bit integer.
    I32,
    /// 64-bit integer.
    I64,
    /// 64-bit float.
    F64,
    /// i-quant, 1.75 bits per weight.
    IQ1M,
    /// bfloat16.
    BF16,
    /// Ternary, 1.69 bits per weight.
    TQ1_0,
    /// Ternary, 2.06 bits per weight.
    TQ2_0,
    /// Microscaling FP4, blocks of 32.
    MXFP4,
}

/// One row of the type table: id, name, elements per block, bytes per block.
type Layout = (u32, &'static str, u64, u64);

impl GgmlType {
    /// Every type this crate knows, in id order.
    pub const ALL: [GgmlType; 32] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::IQ2XXS,
        GgmlType::IQ2XS,
        GgmlType::IQ3XXS,
        GgmlType::IQ1S,
        GgmlType::IQ4NL,
        GgmlType::IQ3S,
        GgmlType::IQ2S,
        GgmlType::IQ4XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
    ];

    // One table keeps id, name and layout of a type from drifting apart; the values are
    // ggml's `type_traits` (ggml.c).
    fn layout(self) -> Layout {
        match self {
            GgmlType::F32 => (0, "f32", 1, 4),
            GgmlType::F16 => (1, "f16", 1, 2),
            GgmlType::Q4_0 => (2, "q4_0", 32, 18),
            GgmlType::Q4_1 => (3, "q4_1", 32, 20),
            GgmlType::Q5_0 => (6, "q5_0", 32, 22),
            GgmlType::Q5_1 => (7, "q5_1", 32, 24),
            GgmlType::Q8_0 => (8, "q8_0", 32, 34),
            GgmlType::Q8_1 => (9, "q8_1", 32, 36),
            GgmlType::Q2K => (10, "q2_K", 256, 84),
            GgmlType::Q3K => (11, "q3_K", 256, 110),
            GgmlType::Q4K => (12, "q4_K", 256, 144),
            GgmlType::Q5K => (13, "q5_K", 256, 176),
            GgmlType::Q6K => (14, "q6_K", 256, 210),
            GgmlType::Q8K => (15, "q8_K", 256, 292),
            GgmlType::IQ2XXS => (16, "iq2_xxs", 256, 66),
            GgmlType::IQ2XS => (17, "iq2_xs", 256, 74),
            GgmlType::IQ3XXS => (18, "iq3_xxs", 256, 98),
            GgmlType::IQ1S => (19, "iq1_s", 256, 50),
            GgmlType::IQ4NL => (20, "iq4_nl", 32, 18),
            GgmlType::IQ3S => (21, "iq3_s", 256, 110),
            GgmlType::IQ2S => (22, "iq2_s", 256, 82),
            GgmlType::IQ4XS => (23, "iq4_xs", 256, 136),
            GgmlType::I8 => (24, "i8", 1, 1),
            GgmlType::I16 => (25, "i16", 1, 2),
            GgmlType::I32 => (26, "i32", 1, 4),
            GgmlType::I64 => (27, "i64", 1, 8),
            GgmlType::F64 => (28, "f64", 1, 8),
            GgmlType::IQ1M => (29, "iq1_m", 256, 56),
            GgmlType::BF16 => (30, "bf16", 1, 2),
            GgmlType::TQ1_0 => (34, "tq1_0", 256, 54),
            GgmlType::TQ2_0 => (35, "tq2_0", 256, 66),
            GgmlType::MXFP4 => (39, "mxfp4", 32, 17),
        }
    }

    /// The type with ggml id `id`, or `None` for ids this crate does not know.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    /// The ggml id, as stored in GGUF tensor infos.
    pub fn id(self) -> u32 {
        self.layout().0
    }

    /// The name ggml prints, e.g. `q4_K`.
    pub fn name(self) -> &'static str {
        self.layout().1
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> u64 {
        self.layout().2
    }

    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        self.layout().3
    }

    /// Whether the type packs elements into blocks with shared scales.
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes of a row of `n` elements, or `None` when `n` is not a whole number of blocks
    /// or the size overflows.
    pub fn row_size(self, n: u64) -> Option<u64> {
        if !n.is_multiple_of(self.block_size()) {
            return None;
        }
        (n / self.block_size()).checked_mul(self.type_size())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

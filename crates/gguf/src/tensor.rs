//! Entries of the tensor index and the arithmetic of their sizes.

use crate::{GgmlType, GgufError};

/// Most dimensions a ggml tensor has (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// One entry of the tensor index, validated against the file it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Shape, `ne[0]` (the contiguous dimension) first, as in the file.
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Absolute offset of the first byte in the file (data section start included).
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements (product of `dims`); parsed tensors never overflow, the
    /// saturation only guards hand-built ones.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// The tensor's bytes within `file`, which should be the slice it was parsed from;
    /// any other slice is checked rather than trusted.
    pub fn data<'a>(&self, file: &'a [u8]) -> Result<&'a [u8], GgufError> {
        let out_of_bounds = || GgufError::TensorOutOfBounds {
            tensor: self.name.clone(),
            offset: self.offset,
            n_bytes: self.n_bytes,
            file_len: file.len() as u64,
        };
        let start = usize::try_from(self.offset).map_err(|_| out_of_bounds())?;
        let len = usize::try_from(self.n_bytes).map_err(|_| out_of_bounds())?;
        let end = start.checked_add(len).ok_or_else(out_of_bounds)?;
        file.get(start..end).ok_or_else(out_of_bounds)
    }
}

/// Bytes of a tensor of shape `dims` and type `ty`, or why that shape is invalid.
///
/// ggml stores quantized tensors row by row, so a row (`ne[0]` elements) must be a whole
/// number of blocks; element counts must fit ggml's `int64_t`.
pub(crate) fn tensor_n_bytes(dims: &[u64], ty: GgmlType) -> Result<u64, String> {
    if dims.is_empty() {
        // ggml would treat it as one element, but nothing writes such tensors and callers
        // index dims[0] freely.
        return Err("it has no dimensions".into());
    }
    if dims.len() > MAX_DIMS {
        return Err(format!(
            "it has {} dimensions, at most {MAX_DIMS} are allowed",
            dims.len()
        ));
    }
    if let Some(axis) = dims.iter().position(|&d| d == 0) {
        return Err(format!("dimension {axis} is 0 (shape {dims:?})"));
    }
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| format!("its element count overflows (shape {dims:?})"))?;
    if !dims[0].is_multiple_of(ty.block_size()) {
        return Err(format!(
            "its first dimension {} is not a multiple of the {ty} block size {}",
            dims[0],
            ty.block_size()
        ));
    }
    (n_elements / ty.block_size())
        .checked_mul(ty.type_size())
        .ok_or_else(|| format!("its size in bytes overflows (shape {dims:?}, type {ty})"))
}

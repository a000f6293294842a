//! Parsing the header, metadata and tensor index of a GGUF file.
//!
//! Everything read from the file is untrusted: counts and lengths are checked against the
//! bytes left before anything is allocated for them, and offset arithmetic is checked.

use std::collections::HashMap;

use crate::reader::{Context, Reader};
use crate::tensor::{tensor_n_bytes, MAX_DIMS};
use crate::value::{TYPE_ARRAY, TYPE_STR};
use crate::{GgmlType, Gguf, GgufError, TensorInfo, Value, GGUF_MAGIC};

/// Metadata key that sets the alignment of the data section and of tensor offsets.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Alignment when the file does not set [`ALIGNMENT_KEY`].
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Deepest nesting of arrays accepted; the spec allows any, real files use one level, and
/// the bound keeps the recursion from exhausting the stack.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Smallest encoding of a metadata entry: key length, value type, a one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest encoding of a tensor info: name length, dim count, one dim, type, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;

/// Parses `bytes` (the whole file, or at least its header and tensor index) and checks
/// every tensor against a file of `file_len` bytes.
pub(crate) fn parse(bytes: &[u8], file_len: u64) -> Result<Gguf, GgufError> {
    let mut r = Reader::new(bytes);
    let found = r.bytes4().what(|| "the magic".into())?;
    if &found != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found });
    }
    let version = r.u32().what(|| "the version".into())?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = r.u64().what(|| "the tensor count".into())?;
    let n_kv = r.u64().what(|| "the metadata entry count".into())?;
    check_count(&r, n_kv, MIN_KV_BYTES, || "metadata entry count".into())?;

    let mut gguf = Gguf {
        version,
        alignment: DEFAULT_ALIGNMENT,
        data_offset: 0,
        metadata: read_metadata(&mut r, n_kv)?,
        tensors: Vec::new(),
        key_index: HashMap::new(),
        tensor_index: HashMap::new(),
    };
    gguf.key_index = crate::index_keys(&gguf.metadata)?;
    let alignment = gguf.opt_u64(ALIGNMENT_KEY)?.unwrap_or(DEFAULT_ALIGNMENT);
    if !alignment.is_power_of_two() {
        return Err(GgufError::BadAlignment(alignment));
    }
    gguf.alignment = alignment;

    // Checked here rather than with the header so that a file cut inside its metadata is
    // reported as truncated there.
    check_count(&r, n_tensors, MIN_TENSOR_INFO_BYTES, || "tensor count".into())?;
    let mut tensors = read_tensor_infos(&mut r, n_tensors, alignment)?;
    gguf.data_offset = data_offset(&mut r, alignment)?;
    for tensor in &mut tensors {
        // `offset` is still relative to the data section here.
        let start = gguf.data_offset.checked_add(tensor.offset);
        let end = start.and_then(|start| start.checked_add(tensor.n_bytes));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => tensor.offset = start,
            _ => {
                return Err(GgufError::TensorOutOfBounds {
                    tensor: tensor.name.clone(),
                    offset: gguf.data_offset.saturating_add(tensor.offset),
                    n_bytes: tensor.n_bytes,
                    file_len,
                })
            }
        }
    }
    gguf.tensors = tensors;
    gguf.tensor_index = crate::index_tensors(&gguf.tensors)?;
    Ok(gguf)
}

/// Fails when `count` items of at least `min_bytes` each cannot fit in the rest of the
/// file, which also bounds any allocation sized by `count`.
fn check_count(r: &Reader<'_>, count: u64, min_bytes: u64, what: impl FnOnce() -> String) -> Result<(), GgufError> {
    match count.checked_mul(min_bytes) {
        Some(need) if need <= r.remaining() => Ok(()),
        _ => Err(GgufError::TooLarge {
            what: what(),
            value: count,
        }),
    }
}

fn read_metadata(r: &mut Reader<'_>, n_kv: u64) -> Result<Vec<(String, Value)>, GgufError> {
    // check_count bounded n_kv by the file size, so it fits in usize.
    let mut metadata = Vec::with_capacity(n_kv as usize);
    for entry in 0..n_kv {
        let key = r.string().what(|| format!("the key of metadata entry {entry}"))?;
        let type_id = r.u32().what(|| format!("the value type of key '{key}'"))?;
        let value = read_value(r, &key, type_id, 0)?;
        metadata.push((key, value));
    }
    Ok(metadata)
}

/// Bytes of the smallest value of type `type_id`, or `None` for unknown types.
fn min_value_bytes(type_id: u32) -> Option<u64> {
    match type_id {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        TYPE_STR | 10..=12 => Some(8),
        TYPE_ARRAY => Some(4 + 8),
        _ => None,
    }
}

fn read_value(r: &mut Reader<'_>, key: &str, type_id: u32, depth: usize) -> Result<Value, GgufError> {
    let what = || format!("the value of key '{key}'");
    let value = match type_id {
        0 => Value::U8(r.u8().what(what)?),
        1 => Value::I8(r.u8().what(what)? as i8),
        2 => Value::U16(r.u16().what(what)?),
        3 => Value::I16(r.u16().what(what)? as i16),
        4 => Value::U32(r.u32().what(what)?),
        5 => Value::I32(r.u32().what(what)? as i32),
        6 => Value::F32(f32::from_bits(r.u32().what(what)?)),
        // ggml reads any non-zero byte as true; so do we.
        7 => Value::Bool(r.u8().what(what)? != 0),
        TYPE_STR => Value::Str(r.string().what(what)?),
        TYPE_ARRAY => read_array(r, key, depth)?,
        10 => Value::U64(r.u64().what(what)?),
        11 => Value::I64(r.u64().what(what)? as i64),
        12 => Value::F64(f64::from_bits(r.u64().what(what)?)),
        _ => {
            return Err(GgufError::UnknownValueType {
                key: key.into(),
                type_id,
            })
        }
    };
    Ok(value)
}

fn read_array(r: &mut Reader<'_>, key: &str, depth: usize) -> Result<Value, GgufError> {
    if depth >= MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep {
            key: key.into(),
            max: MAX_ARRAY_DEPTH,
        });
    }
    let type_id = r.u32().what(|| format!("the element type of array '{key}'"))?;
    let min_bytes = min_value_bytes(type_id).ok_or_else(|| GgufError::UnknownValueType {
        key: key.into(),
        type_id,
    })?;
    let count = r.u64().what(|| format!("the element count of array '{key}'"))?;
    check_count(r, count, min_bytes, || format!("element count of array '{key}'"))?;
    let mut items = Vec::with_capacity(count as usize);
    for _ in 0..count {
        items.push(read_value(r, key, type_id, depth + 1)?);
    }
    Ok(Value::Array(items))
}

/// Reads the tensor index, validating each entry on its own; `offset`s stay relative to
/// the data section until its start is known.
fn read_tensor_infos(r: &mut Reader<'_>, n_tensors: u64, alignment: u64) -> Result<Vec<TensorInfo>, GgufError> {
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    for index in 0..n_tensors {
        let name = r.string().what(|| format!("the name of tensor {index}"))?;
        let bad = |reason: String| GgufError::BadTensor {
            tensor: name.clone(),
            reason,
        };
        let n_dims = r.u32().what(|| format!("the dimension count of tensor '{name}'"))?;
        // Checked before reading so that a huge count allocates nothing.
        if n_dims as usize > MAX_DIMS {
            return Err(bad(format!(
                "it has {n_dims} dimensions, at most {MAX_DIMS} are allowed"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for axis in 0..n_dims {
            dims.push(r.u64().what(|| format!("dimension {axis} of tensor '{name}'"))?);
        }
        let type_id = r.u32().what(|| format!("the type of tensor '{name}'"))?;
        let offset = r.u64().what(|| format!("the offset of tensor '{name}'"))?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnsupportedTensorType {
            tensor: name.clone(),
            type_id,
        })?;
        let n_bytes = tensor_n_bytes(&dims, ggml_type).map_err(bad)?;
        if !offset.is_multiple_of(alignment) {
            return Err(bad(format!(
                "its offset {offset} is not a multiple of the alignment {alignment}"
            )));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
            n_bytes,
        });
    }
    Ok(tensors)
}

/// Skips the padding after the tensor index; the data section starts at the next multiple
/// of `alignment`. The padding must be in the file even when there are no tensors, as
/// every GGUF writer puts it there.
fn data_offset(r: &mut Reader<'_>, alignment: u64) -> Result<u64, GgufError> {
    let end = r.position();
    let padding = (alignment - end % alignment) % alignment;
    r.take(padding).what(|| "the padding before the tensor data".into())?;
    Ok(r.position())
}

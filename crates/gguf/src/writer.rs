//! Writing small GGUF files in memory, for tests across the workspace.

use crate::tensor::tensor_n_bytes;
use crate::{GgmlType, Value, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC};

/// Builds a GGUF version 3 file in memory.
///
/// Metadata and tensors are written in the order given, duplicates included, so that
/// tests can also build files the parser must reject. The alignment is
/// `general.alignment` when set (and a power of two), 32 otherwise.
///
/// ```
/// use baton_gguf::{Gguf, GgufWriter};
/// let bytes = GgufWriter::new()
///     .kv_str("general.architecture", "llama")
///     .tensor_f32("output_norm.weight", &[4], &[1.0, 1.0, 1.0, 1.0])
///     .to_bytes();
/// let gguf = Gguf::parse(&bytes).unwrap();
/// assert_eq!(gguf.architecture().unwrap(), "llama");
/// ```
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

#[derive(Clone, Debug)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    data: Vec<u8>,
}

impl GgufWriter {
    /// An empty file: no metadata, no tensors.
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Adds a metadata entry.
    ///
    /// # Panics
    /// When an array in `value` mixes element types, which GGUF cannot encode.
    pub fn kv(mut self, key: impl Into<String>, value: impl Into<Value>) -> GgufWriter {
        let (key, value) = (key.into(), value.into());
        assert!(
            value.is_homogeneous(),
            "GGUF arrays hold one element type, but key '{key}' mixes several"
        );
        self.metadata.push((key, value));
        self
    }

    /// Drops every metadata entry named `key` (tests build files lacking a key).
    pub fn without_kv(mut self, key: &str) -> GgufWriter {
        self.metadata.retain(|(k, _)| k != key);
        self
    }

    /// Drops every tensor named `name` (tests build files lacking a tensor).
    pub fn without_tensor(mut self, name: &str) -> GgufWriter {
        self.tensors.retain(|t| t.name != name);
        self
    }

    /// Adds a `u32` metadata entry.
    pub fn kv_u32(self, key: impl Into<String>, value: u32) -> GgufWriter {
        self.kv(key, Value::U32(value))
    }

    /// Adds an `f32` metadata entry.
    pub fn kv_f32(self, key: impl Into<String>, value: f32) -> GgufWriter {
        self.kv(key, Value::F32(value))
    }

    /// Adds a string metadata entry.
    pub fn kv_str(self, key: impl Into<String>, value: impl Into<String>) -> GgufWriter {
        self.kv(key, Value::Str(value.into()))
    }

    /// Adds a boolean metadata entry.
    pub fn kv_bool(self, key: impl Into<String>, value: bool) -> GgufWriter {
        self.kv(key, Value::Bool(value))
    }

    /// Adds an `f32` tensor of shape `dims` (`ne[0]` first).
    ///
    /// # Panics
    /// When `data` does not hold exactly the number of elements `dims` implies.
    pub fn tensor_f32(self, name: impl Into<String>, dims: &[u64], data: &[f32]) -> GgufWriter {
        let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor_raw(name, dims, GgmlType::F32, bytes)
    }

    /// Adds a tensor of any type from its raw bytes (blocks already quantized).
    ///
    /// # Panics
    /// When the shape is invalid for `ggml_type` or `data` is not exactly its size.
    pub fn tensor_raw(
        mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: GgmlType,
        data: Vec<u8>,
    ) -> GgufWriter {
        let name = name.into();
        let n_bytes = tensor_n_bytes(dims, ggml_type)
            .unwrap_or_else(|reason| panic!("tensor '{name}' cannot be written: {reason}"));
        assert_eq!(
            data.len() as u64,
            n_bytes,
            "tensor '{name}' of shape {dims:?} and type {ggml_type} needs {n_bytes} bytes"
        );
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            ggml_type,
            data,
        });
        self
    }

    fn alignment(&self) -> u64 {
        self.metadata
            .iter()
            .rev()
            .find(|(key, _)| key == ALIGNMENT_KEY)
            .and_then(|(_, value)| value.as_integer())
            .and_then(|n| u64::try_from(n).ok())
            .filter(|n| n.is_power_of_two())
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// The file's bytes: header, metadata, tensor index, then each tensor's data at the
    /// next multiple of the alignment.
    pub fn to_bytes(&self) -> Vec<u8> {
        let alignment = self.alignment();
        let mut out = Vec::new();
        out.extend_from_slice(GGUF_MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut out, key);
            out.extend_from_slice(&value.type_id().to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0u64;
        for tensor in &self.tensors {
            put_str(&mut out, &tensor.name);
            out.extend_from_slice(&(tensor.dims.len() as u32).to_le_bytes());
            for dim in &tensor.dims {
                out.extend_from_slice(&dim.to_le_bytes());
            }
            out.extend_from_slice(&tensor.ggml_type.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset = align_up(offset + tensor.data.len() as u64, alignment);
        }
        pad(&mut out, alignment);
        for tensor in &self.tensors {
            out.extend_from_slice(&tensor.data);
            pad(&mut out, alignment);
        }
        out
    }
}

fn align_up(n: u64, alignment: u64) -> u64 {
    n.div_ceil(alignment) * alignment
}

fn pad(out: &mut Vec<u8>, alignment: u64) {
    let len = align_up(out.len() as u64, alignment) as usize;
    out.resize(len, 0);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::Str(s) => put_str(out, s),
        Value::Array(items) => {
            // An empty array's element type is lost on parsing; u8 is as good as any.
            let type_id = items.first().map_or(0, Value::type_id);
            out.extend_from_slice(&type_id.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}

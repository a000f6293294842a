//! A safe, bounds-checked reader of GGUF files (versions 2 and 3), and a small writer
//! that tests use to make tiny models.
//!
//! [`Gguf::parse`] reads the header, metadata and tensor index from the bytes of a
//! (typically memory-mapped) file and checks that every tensor lies inside it; tensor
//! data is never copied. A hostile file gets an error naming what is wrong: parsing never
//! panics, never overflows, and allocates at most a small multiple of the file's size
//! (every count is checked against the bytes left before anything is allocated for it;
//! the worst case, an array of one-byte values, takes `size_of::<Value>()` = 32 bytes
//! per file byte).

#![deny(unsafe_code)]
#![warn(missing_docs)]

mod error;
mod parse;
mod reader;
mod tensor;
mod types;
mod value;
mod writer;

#[cfg(test)]
mod tests;

use std::collections::HashMap;

pub use error::GgufError;
pub use parse::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH};
pub use tensor::{TensorInfo, MAX_DIMS};
pub use types::GgmlType;
pub use value::Value;
pub use writer::GgufWriter;

/// The first four bytes of every GGUF file.
pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";

/// The parsed header, metadata and tensor index of a GGUF file.
///
/// The fields are public for reading. Lookups by name go through indexes built by
/// [`Gguf::parse`]; code that edits `metadata` or `tensors` calls [`Gguf::reindex`].
#[derive(Clone, Debug)]
pub struct Gguf {
    /// GGUF version (2 or 3).
    pub version: u32,
    /// Alignment of the data section and of tensor offsets (`general.alignment`, default 32).
    pub alignment: u64,
    /// Absolute offset where tensor data starts.
    pub data_offset: u64,
    /// Metadata in file order; keys are unique.
    pub metadata: Vec<(String, Value)>,
    /// The tensor index in file order, offsets absolute; names are unique.
    pub tensors: Vec<TensorInfo>,
    key_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

impl Gguf {
    /// Parses the header, metadata and tensor index of a GGUF file held in `bytes`, and
    /// checks that every tensor's data lies within `bytes`.
    pub fn parse(bytes: &[u8]) -> Result<Gguf, GgufError> {
        parse::parse(bytes, bytes.len() as u64)
    }

    /// Parses the part of a GGUF file before its tensor data (`header`: header,
    /// metadata, tensor index and padding, as [`header_len`](Gguf::header_len) counts
    /// it), and checks that every tensor's data lies within a file of `file_len` bytes:
    /// how a node that receives a file's tensors one by one knows where each belongs.
    /// Bytes after the index's padding are an error.
    pub fn parse_index(header: &[u8], file_len: u64) -> Result<Gguf, GgufError> {
        let gguf = parse::parse(header, file_len)?;
        if gguf.data_offset != header.len() as u64 {
            return Err(GgufError::TrailingHeader {
                data_offset: gguf.data_offset,
                len: header.len() as u64,
            });
        }
        Ok(gguf)
    }

    /// Rebuilds the name indexes after `metadata` or `tensors` were edited; fails on
    /// duplicate names.
    pub fn reindex(&mut self) -> Result<(), GgufError> {
        self.key_index = index_keys(&self.metadata)?;
        self.tensor_index = index_tensors(&self.tensors)?;
        Ok(())
    }

    /// Bytes before the tensor data (header, metadata, tensor index and padding): all
    /// that identifies a model besides its weights.
    pub fn header_len(&self) -> u64 {
        self.data_offset
    }

    /// The value of metadata key `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        let indexed = self.key_index.get(key).and_then(|&i| self.metadata.get(i));
        match indexed {
            Some((k, value)) if k == key => Some(value),
            // A stale index (fields edited without reindex) degrades to a scan.
            Some(_) => self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            None => None,
        }
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        let indexed = self.tensor_index.get(name).and_then(|&i| self.tensors.get(i));
        match indexed {
            Some(tensor) if tensor.name == name => Some(tensor),
            Some(_) => self.tensors.iter().find(|t| t.name == name),
            None => None,
        }
    }

    /// The tensor named `name`, or [`GgufError::MissingTensor`].
    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor(name.into()))
    }

    /// The bytes of tensor `name` within `file`, the slice this was parsed from.
    pub fn tensor_data<'a>(&self, file: &'a [u8], name: &str) -> Result<&'a [u8], GgufError> {
        self.require_tensor(name)?.data(file)
    }

    /// `general.architecture`, e.g. `qwen2`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    fn value(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    /// An integer of any GGUF integer type that fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        integer(key, self.value(key)?, "u32")
    }

    /// An integer of any GGUF integer type that fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        integer(key, self.value(key)?, "u64")
    }

    /// An `f32` or `f64` (narrowed to `f32`).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        float(key, self.value(key)?)
    }

    /// A string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        string(key, self.value(key)?)
    }

    /// A boolean.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        boolean(key, self.value(key)?)
    }

    /// Like [`Gguf::get_u32`], but `None` when the key is missing.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.get(key).map(|v| integer(key, v, "u32")).transpose()
    }

    /// Like [`Gguf::get_u64`], but `None` when the key is missing.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.get(key).map(|v| integer(key, v, "u64")).transpose()
    }

    /// Like [`Gguf::get_f32`], but `None` when the key is missing.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.get(key).map(|v| float(key, v)).transpose()
    }

    /// Like [`Gguf::get_str`], but `None` when the key is missing.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.get(key).map(|v| string(key, v)).transpose()
    }

    /// Like [`Gguf::get_bool`], but `None` when the key is missing.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.get(key).map(|v| boolean(key, v)).transpose()
    }

    fn array(&self, key: &str, expected: &'static str) -> Result<&[Value], GgufError> {
        let value = self.value(key)?;
        value.as_array().ok_or_else(|| wrong_type(key, expected, value))
    }

    /// An array of integers (of any GGUF integer type), each fitting in `u32`.
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>, GgufError> {
        let items = self.array(key, "array of u32")?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| integer(&format!("{key}[{i}]"), v, "u32"))
            .collect()
    }

    /// An array of `f32` (or `f64`, narrowed).
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        let items = self.array(key, "array of f32")?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| float(&format!("{key}[{i}]"), v))
            .collect()
    }

    /// An array of booleans.
    pub fn get_bool_array(&self, key: &str) -> Result<Vec<bool>, GgufError> {
        let items = self.array(key, "array of bool")?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| boolean(&format!("{key}[{i}]"), v))
            .collect()
    }

    /// An array of strings (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let items = self.array(key, "array of string")?;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| string(&format!("{key}[{i}]"), v))
            .collect()
    }

    /// A per-layer `u32`, stored either as one integer for every layer or as an array
    /// of exactly `n_layer` integers (as llama.cpp's `get_key_or_arr` reads head counts).
    pub fn get_u32_per_layer(&self, key: &str, n_layer: usize) -> Result<Vec<u32>, GgufError> {
        if self.value(key)?.as_array().is_none() {
            return Ok(vec![self.get_u32(key)?; n_layer]);
        }
        let values = self.get_u32_array(key)?;
        if values.len() != n_layer {
            return Err(GgufError::ArrayLength {
                key: key.into(),
                len: values.len(),
                expected: n_layer,
            });
        }
        Ok(values)
    }
}

fn wrong_type(key: &str, expected: &'static str, found: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.into(),
        expected,
        found: found.type_name(),
    }
}

/// Converts any integer value to `T`, checked; `expected` names `T` in errors.
fn integer<T: TryFrom<i128>>(key: &str, value: &Value, expected: &'static str) -> Result<T, GgufError> {
    let wide = value.as_integer().ok_or_else(|| wrong_type(key, expected, value))?;
    T::try_from(wide).map_err(|_| GgufError::OutOfRange {
        key: key.into(),
        value: wide,
        expected,
    })
}

fn float(key: &str, value: &Value) -> Result<f32, GgufError> {
    value.as_f32().ok_or_else(|| wrong_type(key, "f32", value))
}

fn string<'v>(key: &str, value: &'v Value) -> Result<&'v str, GgufError> {
    value.as_str().ok_or_else(|| wrong_type(key, "string", value))
}

fn boolean(key: &str, value: &Value) -> Result<bool, GgufError> {
    value.as_bool().ok_or_else(|| wrong_type(key, "bool", value))
}

fn index_keys(metadata: &[(String, Value)]) -> Result<HashMap<String, usize>, GgufError> {
    let mut index = HashMap::with_capacity(metadata.len());
    for (i, (key, _)) in metadata.iter().enumerate() {
        if index.insert(key.clone(), i).is_some() {
            return Err(GgufError::DuplicateKey(key.clone()));
        }
    }
    Ok(index)
}

fn index_tensors(tensors: &[TensorInfo]) -> Result<HashMap<String, usize>, GgufError> {
    let mut index = HashMap::with_capacity(tensors.len());
    for (i, tensor) in tensors.iter().enumerate() {
        if index.insert(tensor.name.clone(), i).is_some() {
            return Err(GgufError::DuplicateTensor(tensor.name.clone()));
        }
    }
    Ok(index)
}

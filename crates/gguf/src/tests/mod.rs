//! Tests of the parser and writer: round trips, hostile files (each asserting its error
//! text), and the real models when they are present.

mod hostile;
mod real_model;
mod round_trip;

use crate::{GgmlType, Gguf, GgufWriter, Value};

/// A small file using every value type and two tensor types.
fn sample() -> GgufWriter {
    GgufWriter::new()
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 2)
        .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .kv_bool("general.flag", true)
        .kv("u8", Value::U8(7))
        .kv("i8", Value::I8(-7))
        .kv("u16", Value::U16(700))
        .kv("i16", Value::I16(-700))
        .kv("i32", Value::I32(-70_000))
        .kv("u64", Value::U64(1 << 40))
        .kv("i64", Value::I64(-(1 << 40)))
        .kv("f64", Value::F64(0.25))
        .kv("tokens", vec!["a", "bc", ""])
        .kv("heads", vec![4i32, 8])
        .kv("nested", vec![vec![1u8, 2], vec![]])
        .kv("empty", Value::Array(vec![]))
        .tensor_f32("output_norm.weight", &[4, 2], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
        .tensor_raw("blk.0.attn_q.weight", &[32, 2], GgmlType::Q4_0, vec![0xAB; 36])
}

/// The error text `Gguf::parse` gives for `bytes`.
fn parse_err(bytes: &[u8]) -> String {
    match Gguf::parse(bytes) {
        Ok(_) => panic!("a hostile file parsed"),
        Err(err) => err.to_string(),
    }
}

/// A GGUF file assembled field by field, for files the writer would refuse to make.
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        Raw(b"GGUF".to_vec()).u32(version).u64(n_tensors).u64(n_kv)
    }

    fn u32(mut self, v: u32) -> Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn u64(mut self, v: u64) -> Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }

    fn str(self, s: &str) -> Raw {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }

    fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key).u32(4).u32(v)
    }

    fn tensor_info(self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> Raw {
        let mut raw = self.str(name).u32(dims.len() as u32);
        for &dim in dims {
            raw = raw.u64(dim);
        }
        raw.u32(type_id).u64(offset)
    }

    /// Pads to 32 and appends `data_len` zero bytes of tensor data.
    fn data(mut self, data_len: usize) -> Raw {
        let len = self.0.len().div_ceil(32) * 32 + data_len;
        self.0.resize(len, 0);
        self
    }
}

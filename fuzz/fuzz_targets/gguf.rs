//! The GGUF parser on arbitrary bytes: header, metadata, tensor index, tensor bounds.
//!
//! Checked: nothing panics; no allocation is out of proportion to the file (the crate
//! promises at most 32 bytes per file byte); for a file that parses, every typed getter
//! on every key returns a value or an error, every tensor's bytes lie inside the file at
//! an aligned offset, and the file written back by `GgufWriter` parses to the same
//! metadata and tensor index (compared by writing both again, so NaN values compare).
#![no_main]

use baton_fuzz::{check_allocations, LargestAlloc};
use baton_gguf::{Gguf, GgufWriter};
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: LargestAlloc = LargestAlloc;

fuzz_target!(|data: &[u8]| {
    let Ok(gguf) = check_allocations(data.len(), || Gguf::parse(data)) else {
        return;
    };
    for (key, value) in &gguf.metadata {
        assert!(gguf.get(key).is_some(), "key '{key}' is listed but not found");
        let _ = (gguf.get_u32(key), gguf.get_u64(key), gguf.get_f32(key));
        let _ = (gguf.get_str(key), gguf.get_bool(key));
        let _ = (gguf.get_u32_array(key), gguf.get_f32_array(key));
        let _ = (gguf.get_bool_array(key), gguf.get_str_array(key));
        let _ = gguf.get_u32_per_layer(key, 3);
        assert!(value.is_homogeneous(), "key '{key}' holds a mixed array");
    }
    for tensor in &gguf.tensors {
        let bytes = gguf
            .tensor_data(data, &tensor.name)
            .expect("a parsed tensor lies inside the file");
        assert_eq!(bytes.len() as u64, tensor.n_bytes);
        assert!(tensor.offset >= gguf.data_offset);
        assert_eq!((tensor.offset - gguf.data_offset) % gguf.alignment, 0);
        assert!(tensor.ggml_type.row_size(tensor.dims[0]).is_some());
    }

    let written = rewrite(&gguf, data);
    let reparsed = Gguf::parse(&written).expect("a file written from a parsed one parses");
    assert_eq!(reparsed.tensors.len(), gguf.tensors.len());
    assert_eq!(rewrite(&reparsed, &written), written, "writing is not idempotent");
});

/// `gguf` (parsed from `file`) written again with `GgufWriter`.
fn rewrite(gguf: &Gguf, file: &[u8]) -> Vec<u8> {
    let mut writer = GgufWriter::new();
    for (key, value) in &gguf.metadata {
        writer = writer.kv(key.clone(), value.clone());
    }
    for tensor in &gguf.tensors {
        let bytes = tensor.data(file).expect("checked above").to_vec();
        writer = writer.tensor_raw(tensor.name.clone(), &tensor.dims, tensor.ggml_type, bytes);
    }
    writer.to_bytes()
}

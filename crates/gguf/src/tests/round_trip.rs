use super::sample;
use crate::{GgmlType, Gguf, GgufError, GgufWriter, Value};

#[test]
fn round_trip_keeps_metadata_in_order() {
    let writer = sample();
    let bytes = writer.to_bytes();
    let gguf = Gguf::parse(&bytes).unwrap();
    assert_eq!(gguf.version, 3);
    assert_eq!(gguf.alignment, 32);
    let keys: Vec<&str> = gguf.metadata.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys[..3],
        [
            "general.architecture",
            "llama.block_count",
            "llama.attention.layer_norm_rms_epsilon"
        ]
    );
    assert_eq!(gguf.architecture().unwrap(), "llama");
    assert_eq!(gguf.get("u8"), Some(&Value::U8(7)));
    assert_eq!(gguf.get("i8"), Some(&Value::I8(-7)));
    assert_eq!(gguf.get("u16"), Some(&Value::U16(700)));
    assert_eq!(gguf.get("i16"), Some(&Value::I16(-700)));
    assert_eq!(gguf.get("i32"), Some(&Value::I32(-70_000)));
    assert_eq!(gguf.get("u64"), Some(&Value::U64(1 << 40)));
    assert_eq!(gguf.get("i64"), Some(&Value::I64(-(1 << 40))));
    assert_eq!(gguf.get("f64"), Some(&Value::F64(0.25)));
    assert!(gguf.get_bool("general.flag").unwrap());
    assert_eq!(gguf.get_str_array("tokens").unwrap(), ["a", "bc", ""]);
    assert_eq!(
        gguf.get("nested"),
        Some(&Value::Array(vec![
            Value::Array(vec![Value::U8(1), Value::U8(2)]),
            Value::Array(vec![])
        ]))
    );
    assert_eq!(gguf.get("empty"), Some(&Value::Array(vec![])));
    assert_eq!(gguf.get("absent"), None);
}

#[test]
fn round_trip_keeps_tensors_and_their_bytes() {
    let bytes = sample().to_bytes();
    let gguf = Gguf::parse(&bytes).unwrap();
    assert_eq!(gguf.tensors.len(), 2);
    assert_eq!(gguf.data_offset % 32, 0);
    assert_eq!(gguf.header_len(), gguf.data_offset);

    let norm = gguf.tensor("output_norm.weight").unwrap();
    assert_eq!(norm.dims, [4, 2]);
    assert_eq!(norm.ggml_type, GgmlType::F32);
    assert_eq!(norm.n_elements(), 8);
    assert_eq!(norm.n_bytes, 32);
    assert_eq!(norm.offset, gguf.data_offset);
    let values: Vec<f32> = gguf
        .tensor_data(&bytes, "output_norm.weight")
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(values, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);

    let q = gguf.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!((q.ggml_type, q.n_bytes, q.offset % 32), (GgmlType::Q4_0, 36, 0));
    assert_eq!(q.data(&bytes).unwrap(), [0xAB; 36]);
    assert!(gguf.tensor("output.weight").is_none());
    assert_eq!(
        gguf.require_tensor("output.weight").unwrap_err().to_string(),
        "tensor 'output.weight' is missing from the GGUF file"
    );
}

#[test]
fn tensor_data_checks_the_slice_it_is_given() {
    let bytes = sample().to_bytes();
    let gguf = Gguf::parse(&bytes).unwrap();
    let err = gguf.tensor_data(&bytes[..100], "output_norm.weight").unwrap_err();
    assert!(matches!(err, GgufError::TensorOutOfBounds { .. }), "{err}");
}

#[test]
fn writer_honours_a_custom_alignment() {
    let bytes = GgufWriter::new()
        .kv_u32("general.alignment", 64)
        .tensor_f32("a", &[3], &[1.0, 2.0, 3.0])
        .tensor_f32("b", &[1], &[4.0])
        .to_bytes();
    let gguf = Gguf::parse(&bytes).unwrap();
    assert_eq!(gguf.alignment, 64);
    assert_eq!(gguf.data_offset % 64, 0);
    assert_eq!(gguf.tensor("b").unwrap().offset, gguf.data_offset + 64);
}

#[test]
fn file_without_tensors_parses() {
    let bytes = GgufWriter::new().to_bytes();
    assert_eq!(bytes.len(), 32);
    let gguf = Gguf::parse(&bytes).unwrap();
    assert!(gguf.tensors.is_empty() && gguf.metadata.is_empty());
}

#[test]
fn every_ggml_type_round_trips_its_id_and_size() {
    for ty in GgmlType::ALL {
        assert_eq!(GgmlType::from_id(ty.id()), Some(ty));
        let dims = [ty.block_size() * 2, 3];
        let n_bytes = (ty.type_size() * 6) as usize;
        let bytes = GgufWriter::new()
            .tensor_raw("t", &dims, ty, vec![0; n_bytes])
            .to_bytes();
        let gguf = Gguf::parse(&bytes).unwrap();
        assert_eq!(gguf.tensor("t").unwrap().n_bytes, n_bytes as u64, "{ty}");
    }
    assert_eq!(GgmlType::Q4K.name(), "q4_K");
    assert_eq!(GgmlType::IQ2XXS.to_string(), "iq2_xxs");
    assert_eq!(GgmlType::Q4K.row_size(512), Some(288));
    assert_eq!(GgmlType::Q4K.row_size(100), None);
    for retired in [4, 5, 31, 32, 33, 36, 37, 38, 40] {
        assert_eq!(GgmlType::from_id(retired), None);
    }
}

#[test]
fn integer_getters_accept_any_integer_type_that_fits() {
    let gguf = Gguf::parse(&sample().to_bytes()).unwrap();
    assert_eq!(gguf.get_u32("u8").unwrap(), 7);
    assert_eq!(gguf.get_u32("llama.block_count").unwrap(), 2);
    assert_eq!(gguf.get_u64("u64").unwrap(), 1 << 40);
    assert_eq!(gguf.opt_u32("u16").unwrap(), Some(700));
    assert_eq!(gguf.opt_u32("absent").unwrap(), None);
    assert_eq!(gguf.get_u32_array("heads").unwrap(), [4, 8]);
    assert_eq!(
        gguf.get_u32("u64").unwrap_err().to_string(),
        "GGUF metadata key 'u64' holds 1099511627776, which does not fit in u32"
    );
    assert_eq!(
        gguf.get_u64("i8").unwrap_err().to_string(),
        "GGUF metadata key 'i8' holds -7, which does not fit in u64"
    );
}

#[test]
fn float_getters_accept_f32_and_f64() {
    let gguf = Gguf::parse(&sample().to_bytes()).unwrap();
    assert_eq!(gguf.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap(), 1e-5);
    assert_eq!(gguf.get_f32("f64").unwrap(), 0.25);
    assert_eq!(gguf.opt_f32("absent").unwrap(), None);
}

#[test]
fn per_layer_values_come_as_scalar_or_array() {
    let gguf = Gguf::parse(&sample().to_bytes()).unwrap();
    assert_eq!(gguf.get_u32_per_layer("llama.block_count", 3).unwrap(), [2, 2, 2]);
    assert_eq!(gguf.get_u32_per_layer("heads", 2).unwrap(), [4, 8]);
    assert_eq!(
        gguf.get_u32_per_layer("heads", 3).unwrap_err().to_string(),
        "GGUF metadata key 'heads' has 2 elements, expected 3"
    );
}

#[test]
fn wrong_type_getter_names_key_and_types() {
    let gguf = Gguf::parse(&sample().to_bytes()).unwrap();
    let text = |err: GgufError| err.to_string();
    assert_eq!(
        text(gguf.get_u32("general.architecture").unwrap_err()),
        "GGUF metadata key 'general.architecture' has type string, expected u32"
    );
    assert_eq!(
        text(gguf.get_str("llama.block_count").unwrap_err()),
        "GGUF metadata key 'llama.block_count' has type u32, expected string"
    );
    assert_eq!(
        text(gguf.opt_f32("general.flag").unwrap_err()),
        "GGUF metadata key 'general.flag' has type bool, expected f32"
    );
    assert_eq!(
        text(gguf.opt_bool("u8").unwrap_err()),
        "GGUF metadata key 'u8' has type u8, expected bool"
    );
    assert_eq!(
        text(gguf.get_u32_array("tokens").unwrap_err()),
        "GGUF metadata key 'tokens[0]' has type string, expected u32"
    );
    assert_eq!(
        text(gguf.get_bool_array("u8").unwrap_err()),
        "GGUF metadata key 'u8' has type u8, expected array of bool"
    );
    assert_eq!(
        text(gguf.get_str_array("heads").unwrap_err()),
        "GGUF metadata key 'heads[0]' has type i32, expected string"
    );
}

#[test]
fn missing_key_is_named() {
    let gguf = Gguf::parse(&sample().to_bytes()).unwrap();
    assert_eq!(
        gguf.get_u32("llama.context_length").unwrap_err().to_string(),
        "GGUF metadata key 'llama.context_length' is missing"
    );
    let bytes = GgufWriter::new().to_bytes();
    assert_eq!(
        Gguf::parse(&bytes).unwrap().architecture().unwrap_err().to_string(),
        "GGUF metadata key 'general.architecture' is missing"
    );
}

#[test]
fn edited_fields_are_found_after_reindex() {
    let mut gguf = Gguf::parse(&sample().to_bytes()).unwrap();
    gguf.tensors.swap(0, 1);
    // A stale index still answers correctly, by scanning.
    assert_eq!(gguf.tensor("output_norm.weight").unwrap().dims, [4, 2]);
    gguf.metadata.push(("new".into(), Value::U32(1)));
    gguf.reindex().unwrap();
    assert_eq!(gguf.get_u32("new").unwrap(), 1);
    gguf.metadata.push(("new".into(), Value::U32(2)));
    assert_eq!(
        gguf.reindex().unwrap_err().to_string(),
        "GGUF metadata key 'new' appears more than once"
    );
}

#[test]
fn value_stays_small_enough_to_bound_parsing_memory() {
    // The crate docs promise at most 32 bytes of `Value` per byte of a u8 array.
    assert!(std::mem::size_of::<Value>() <= 32);
}

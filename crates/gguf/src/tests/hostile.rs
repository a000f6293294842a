//! Hostile and damaged files: each must fail with an error that says what is wrong, and
//! none may panic.

use super::{parse_err, sample, Raw};
use crate::{GgmlType, Gguf, GgufError, GgufWriter};

/// 24-byte header, `general.architecture = "llama"` (bytes 24..69), tensor info of `x`
/// (69..102), padding to 128, then 32 bytes of f32 data.
fn small() -> Vec<u8> {
    let bytes = GgufWriter::new()
        .kv_str("general.architecture", "llama")
        .tensor_f32("x", &[8], &[0.5; 8])
        .to_bytes();
    assert_eq!(bytes.len(), 160);
    bytes
}

#[test]
fn truncated_file_names_the_field_and_offset() {
    let bytes = small();
    let cases = [
        (0, "GGUF file is truncated while reading the magic at offset 0: need 4 bytes, 0 left"),
        (2, "GGUF file is truncated while reading the magic at offset 0: need 4 bytes, 2 left"),
        (6, "GGUF file is truncated while reading the version at offset 4: need 4 bytes, 2 left"),
        (12, "GGUF file is truncated while reading the tensor count at offset 8: need 8 bytes, 4 left"),
        (20, "GGUF file is truncated while reading the metadata entry count at offset 16: need 8 bytes, 4 left"),
        (40, "GGUF file is truncated while reading the key of metadata entry 0 at offset 32: need 20 bytes, 8 left"),
        (54, "GGUF file is truncated while reading the value type of key 'general.architecture' at offset 52: need 4 bytes, 2 left"),
        (66, "GGUF file is truncated while reading the value of key 'general.architecture' at offset 64: need 5 bytes, 2 left"),
        (101, "GGUF file is truncated while reading the offset of tensor 'x' at offset 94: need 8 bytes, 7 left"),
        (110, "GGUF file is truncated while reading the padding before the tensor data at offset 102: need 26 bytes, 8 left"),
    ];
    for (len, expected) in cases {
        assert_eq!(parse_err(&bytes[..len]), expected, "cut at {len}");
    }
}

#[test]
fn truncated_inside_tensor_index_reports_the_count() {
    assert_eq!(
        parse_err(&small()[..85]),
        "GGUF tensor count (1) is more than the rest of the file can hold: the file is truncated or corrupt"
    );
}

#[test]
fn truncated_tensor_data_names_the_tensor() {
    let bytes = small();
    assert_eq!(
        parse_err(&bytes[..128]),
        "tensor 'x' (bytes 128..160) lies beyond the end of the file (128 bytes): the file is truncated"
    );
    assert_eq!(
        parse_err(&bytes[..159]),
        "tensor 'x' (bytes 128..160) lies beyond the end of the file (159 bytes): the file is truncated"
    );
}

#[test]
fn every_prefix_fails_without_panicking() {
    let bytes = sample().to_bytes();
    let gguf = Gguf::parse(&bytes).unwrap();
    let data_end = gguf.tensors.iter().map(|t| t.offset + t.n_bytes).max().unwrap() as usize;
    for len in 0..=bytes.len() {
        let result = Gguf::parse(&bytes[..len]);
        assert_eq!(result.is_ok(), len >= data_end, "prefix of {len} bytes: {result:?}");
    }
}

#[test]
fn corrupting_any_byte_never_panics() {
    let bytes = sample().to_bytes();
    for at in 0..bytes.len() {
        for value in [0x00, 0x01, 0x09, 0x7f, 0x80, 0xff, bytes[at] ^ 0x01] {
            let mut corrupt = bytes.clone();
            corrupt[at] = value;
            let _ = Gguf::parse(&corrupt);
        }
    }
}

#[test]
fn bad_magic() {
    let mut bytes = small();
    bytes[..4].copy_from_slice(b"PK\x03\x04");
    assert_eq!(
        parse_err(&bytes),
        r#"not a GGUF file: magic is "PK\x03\x04", expected "GGUF""#
    );
}

#[test]
fn unsupported_versions() {
    let with_version = |version: u32| {
        let mut bytes = small();
        bytes[4..8].copy_from_slice(&version.to_le_bytes());
        parse_err(&bytes)
    };
    assert_eq!(
        with_version(1),
        "GGUF version 1 is not supported (only versions 2 and 3)"
    );
    assert_eq!(
        with_version(99),
        "GGUF version 99 is not supported (only versions 2 and 3)"
    );
    assert_eq!(
        with_version(3u32.swap_bytes()),
        "GGUF version 50331648 is not supported (only versions 2 and 3): \
         this looks like a big-endian GGUF file, which baton does not read"
    );
}

#[test]
fn version_2_is_read_like_version_3() {
    let mut bytes = small();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(Gguf::parse(&bytes).unwrap().version, 2);
}

#[test]
fn huge_string_length() {
    let raw = Raw::header(3, 0, 1).u64(u64::MAX).bytes(b"general.name");
    assert_eq!(
        parse_err(&raw.0),
        "GGUF file is truncated while reading the key of metadata entry 0 at offset 32: \
         need 18446744073709551615 bytes, 12 left"
    );
}

#[test]
fn huge_array_count() {
    for count in [u64::MAX, 1 << 40] {
        let raw = Raw::header(3, 0, 1).str("arr").u32(9).u32(4).u64(count).u32(1);
        assert_eq!(
            parse_err(&raw.0),
            format!(
                "GGUF element count of array 'arr' ({count}) is more than the rest of the file \
                 can hold: the file is truncated or corrupt"
            )
        );
    }
}

#[test]
fn huge_counts_in_header() {
    let raw = Raw::header(3, u64::MAX, 0).data(0);
    assert_eq!(
        parse_err(&raw.0),
        "GGUF tensor count (18446744073709551615) is more than the rest of the file can hold: \
         the file is truncated or corrupt"
    );
    let raw = Raw::header(3, 0, 1 << 60).data(0);
    assert_eq!(
        parse_err(&raw.0),
        "GGUF metadata entry count (1152921504606846976) is more than the rest of the file can hold: \
         the file is truncated or corrupt"
    );
}

#[test]
fn unknown_value_type() {
    let raw = Raw::header(3, 0, 1).str("k").u32(13).u32(0);
    assert_eq!(parse_err(&raw.0), "GGUF metadata key 'k' has unknown value type id 13");
    let raw = Raw::header(3, 0, 1).str("k").u32(9).u32(200).u64(1).u32(0);
    assert_eq!(parse_err(&raw.0), "GGUF metadata key 'k' has unknown value type id 200");
}

#[test]
fn arrays_nested_too_deep() {
    let nested = |levels: usize| {
        let mut raw = Raw::header(3, 0, 1).str("deep").u32(9);
        for _ in 1..levels {
            raw = raw.u32(9).u64(1);
        }
        raw.u32(4).u64(1).u32(42).data(0)
    };
    assert!(Gguf::parse(&nested(crate::MAX_ARRAY_DEPTH).0).is_ok());
    assert_eq!(
        parse_err(&nested(crate::MAX_ARRAY_DEPTH + 1).0),
        "GGUF metadata key 'deep' nests arrays more than 8 deep"
    );
}

#[test]
fn invalid_utf8_key() {
    let raw = Raw::header(3, 0, 1).u64(2).bytes(&[0xff, 0xfe]).u32(4).u32(0);
    assert_eq!(
        parse_err(&raw.0),
        "GGUF string at offset 32 (the key of metadata entry 0) is not valid UTF-8"
    );
}

#[test]
fn duplicate_key() {
    let bytes = GgufWriter::new().kv_u32("a", 1).kv_u32("a", 2).to_bytes();
    assert_eq!(parse_err(&bytes), "GGUF metadata key 'a' appears more than once");
}

#[test]
fn bad_alignment() {
    for alignment in [0, 3, 48] {
        let raw = Raw::header(3, 0, 1).kv_u32("general.alignment", alignment).data(0);
        assert_eq!(
            parse_err(&raw.0),
            format!("GGUF general.alignment is {alignment}, which is not a power of two")
        );
    }
    let bytes = GgufWriter::new().kv_str("general.alignment", "32").to_bytes();
    assert_eq!(
        parse_err(&bytes),
        "GGUF metadata key 'general.alignment' has type string, expected u64"
    );
}

/// A file with one tensor info and 64 bytes of data.
fn one_tensor(dims: &[u64], type_id: u32, offset: u64) -> Vec<u8> {
    Raw::header(3, 1, 0).tensor_info("x", dims, type_id, offset).data(64).0
}

#[test]
fn unsupported_tensor_type() {
    let raw = Raw::header(3, 1, 0)
        .tensor_info("blk.0.attn_q.weight", &[32], 99, 0)
        .data(64);
    assert_eq!(
        parse_err(&raw.0),
        "tensor 'blk.0.attn_q.weight' has unsupported ggml type id 99"
    );
    // Q4_2, retired from ggml.
    assert_eq!(
        parse_err(&one_tensor(&[32], 4, 0)),
        "tensor 'x' has unsupported ggml type id 4"
    );
}

#[test]
fn dims_overflowing_u64() {
    assert_eq!(
        parse_err(&one_tensor(&[u64::MAX, 2], 0, 0)),
        "tensor 'x' is malformed: its element count overflows (shape [18446744073709551615, 2])"
    );
    // Fits u64 but not ggml's int64_t.
    assert_eq!(
        parse_err(&one_tensor(&[1 << 63], 0, 0)),
        "tensor 'x' is malformed: its element count overflows (shape [9223372036854775808])"
    );
    assert_eq!(
        parse_err(&one_tensor(&[1 << 62], GgmlType::I64.id(), 0)),
        "tensor 'x' is malformed: its size in bytes overflows (shape [4611686018427387904], type i64)"
    );
}

#[test]
fn bad_dims() {
    assert_eq!(
        parse_err(&one_tensor(&[4, 0], 0, 0)),
        "tensor 'x' is malformed: dimension 1 is 0 (shape [4, 0])"
    );
    assert_eq!(
        parse_err(&one_tensor(&[], 0, 0)),
        "tensor 'x' is malformed: it has no dimensions"
    );
    assert_eq!(
        parse_err(&one_tensor(&[1; 5], 0, 0)),
        "tensor 'x' is malformed: it has 5 dimensions, at most 4 are allowed"
    );
    let raw = Raw::header(3, 1, 0).str("x").u32(u32::MAX).data(64);
    assert_eq!(
        parse_err(&raw.0),
        "tensor 'x' is malformed: it has 4294967295 dimensions, at most 4 are allowed"
    );
    assert_eq!(
        parse_err(&one_tensor(&[30, 2], GgmlType::Q4_0.id(), 0)),
        "tensor 'x' is malformed: its first dimension 30 is not a multiple of the q4_0 block size 32"
    );
}

#[test]
fn misaligned_offset() {
    assert_eq!(
        parse_err(&one_tensor(&[4], 0, 16)),
        "tensor 'x' is malformed: its offset 16 is not a multiple of the alignment 32"
    );
}

#[test]
fn tensor_beyond_end_of_file() {
    // Header and index take 57 bytes, so data starts at 64 and the file is 128 bytes.
    assert_eq!(
        parse_err(&one_tensor(&[4], 0, 1 << 40)),
        "tensor 'x' (bytes 1099511627840..1099511627856) lies beyond the end of the file \
         (128 bytes): the file is truncated"
    );
    assert_eq!(
        parse_err(&one_tensor(&[32], 0, 64)),
        "tensor 'x' (bytes 128..256) lies beyond the end of the file (128 bytes): the file is truncated"
    );
    // data_offset + offset overflows u64.
    let err = Gguf::parse(&one_tensor(&[4], 0, u64::MAX - 31)).unwrap_err();
    assert!(
        matches!(err, GgufError::TensorOutOfBounds { offset: u64::MAX, .. }),
        "{err}"
    );
}

#[test]
fn duplicate_tensor_name() {
    let bytes = GgufWriter::new()
        .tensor_f32("x", &[1], &[1.0])
        .tensor_f32("x", &[1], &[2.0])
        .to_bytes();
    assert_eq!(
        parse_err(&bytes),
        "tensor 'x' appears more than once in the GGUF tensor index"
    );
}

#[test]
fn an_index_is_read_from_the_header_alone_and_checked_against_the_file_size() {
    let bytes = small();
    let index = Gguf::parse_index(&bytes[..128], 160).unwrap();
    assert_eq!(index.tensor("x").map(|t| (t.offset, t.n_bytes)), Some((128, 32)));
    // A file announced too short for its tensors.
    let err = Gguf::parse_index(&bytes[..128], 150).unwrap_err().to_string();
    assert_eq!(
        err,
        "tensor 'x' (bytes 128..160) lies beyond the end of the file (150 bytes): the file is truncated"
    );
    // Bytes past the padding are not header.
    let err = Gguf::parse_index(&bytes[..140], 160).unwrap_err().to_string();
    assert_eq!(
        err,
        "GGUF header of 140 bytes runs past the start of the tensor data at offset 128"
    );
    // A header cut short fails like a truncated file.
    let err = Gguf::parse_index(&bytes[..110], 160).unwrap_err().to_string();
    assert!(err.contains("truncated while reading the padding"), "{err}");
}

//! The one error type of this crate: everything that can be wrong with a GGUF file or
//! with a lookup in its metadata, each variant naming the key, tensor or offset at fault.

/// Why a GGUF file could not be parsed, or why a metadata lookup failed.
#[derive(thiserror::Error, Debug)]
pub enum GgufError {
    /// The file ends before a field it announces.
    #[error(
        "GGUF file is truncated while reading {what} at offset {offset}: \
         need {need} bytes, {have} left"
    )]
    Truncated {
        /// What was being read, e.g. "the value of key 'general.name'".
        what: String,
        /// Absolute file offset of the read.
        offset: u64,
        /// Bytes the read needed.
        need: u64,
        /// Bytes left in the file from `offset`.
        have: u64,
    },

    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic is \"{}\", expected \"GGUF\"", found.escape_ascii())]
    BadMagic {
        /// The four bytes found instead.
        found: [u8; 4],
    },

    /// A GGUF version other than 2 or 3.
    #[error("GGUF version {0} is not supported (only versions 2 and 3){hint}", hint = endian_hint(*.0))]
    UnsupportedVersion(u32),

    /// A metadata value (or array element) type id outside 0..=12.
    #[error("GGUF metadata key '{key}' has unknown value type id {type_id}")]
    UnknownValueType {
        /// The key whose value could not be read.
        key: String,
        /// The type id found.
        type_id: u32,
    },

    /// A string that is not valid UTF-8.
    #[error("GGUF string at offset {offset} ({what}) is not valid UTF-8")]
    BadString {
        /// What the string is, e.g. "the name of tensor 3".
        what: String,
        /// Absolute file offset of the string's bytes.
        offset: u64,
    },

    /// A count that the rest of the file cannot possibly hold.
    #[error(
        "GGUF {what} ({value}) is more than the rest of the file can hold: \
         the file is truncated or corrupt"
    )]
    TooLarge {
        /// What the count is, e.g. "tensor count".
        what: String,
        /// The count found.
        value: u64,
    },

    /// Arrays nested deeper than the parser allows.
    #[error("GGUF metadata key '{key}' nests arrays more than {max} deep")]
    NestingTooDeep {
        /// The key whose value nests too deep.
        key: String,
        /// The deepest nesting accepted.
        max: usize,
    },

    /// The same metadata key appears twice.
    #[error("GGUF metadata key '{0}' appears more than once")]
    DuplicateKey(String),

    /// `general.alignment` is zero or not a power of two.
    #[error("GGUF general.alignment is {0}, which is not a power of two")]
    BadAlignment(u64),

    /// A tensor whose ggml type id this crate does not know.
    #[error("tensor '{tensor}' has unsupported ggml type id {type_id}")]
    UnsupportedTensorType {
        /// The tensor's name.
        tensor: String,
        /// The type id found.
        type_id: u32,
    },

    /// A tensor whose shape or offset is invalid.
    #[error("tensor '{tensor}' is malformed: {reason}")]
    BadTensor {
        /// The tensor's name.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A tensor whose bytes end past the end of the file.
    #[error(
        "tensor '{tensor}' (bytes {offset}..{}) lies beyond the end of the file ({file_len} bytes): \
         the file is truncated",
        offset.saturating_add(*n_bytes)
    )]
    TensorOutOfBounds {
        /// The tensor's name.
        tensor: String,
        /// Absolute file offset of its first byte.
        offset: u64,
        /// Its size in bytes.
        n_bytes: u64,
        /// The file's size in bytes.
        file_len: u64,
    },

    /// Two tensors with the same name.
    #[error("tensor '{0}' appears more than once in the GGUF tensor index")]
    DuplicateTensor(String),

    /// A tensor looked up by name is not in the file.
    #[error("tensor '{0}' is missing from the GGUF file")]
    MissingTensor(String),

    /// A metadata key looked up is not in the file.
    #[error("GGUF metadata key '{0}' is missing")]
    MissingKey(String),

    /// A metadata value of another type than the one asked for.
    #[error("GGUF metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// The type asked for.
        expected: &'static str,
        /// The type found.
        found: &'static str,
    },

    /// An integer metadata value outside the range of the type asked for.
    #[error("GGUF metadata key '{key}' holds {value}, which does not fit in {expected}")]
    OutOfRange {
        /// The key (with `[index]` for an array element).
        key: String,
        /// The value found.
        value: i128,
        /// The type asked for.
        expected: &'static str,
    },

    /// A per-layer array whose length is not the number of layers.
    #[error("GGUF metadata key '{key}' has {len} elements, expected {expected}")]
    ArrayLength {
        /// The key.
        key: String,
        /// Elements found.
        len: usize,
        /// Elements expected.
        expected: usize,
    },

    /// Bytes given as a file's header run past where its tensor data starts.
    #[error("GGUF header of {len} bytes runs past the start of the tensor data at offset {data_offset}")]
    TrailingHeader {
        /// Where the tensor data starts.
        data_offset: u64,
        /// Bytes given as the header.
        len: u64,
    },
}

/// Points out the likely cause when a version reads as 2 or 3 once its bytes are swapped.
fn endian_hint(version: u32) -> &'static str {
    if matches!(version.swap_bytes(), 2 | 3) {
        ": this looks like a big-endian GGUF file, which baton does not read"
    } else {
        ""
    }
}

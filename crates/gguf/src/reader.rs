//! A bounds-checked little-endian cursor over the file's bytes.
//!
//! Reads fail with a context-free [`ReadError`]; call sites attach what they were reading
//! with [`Context::what`], lazily, so that the hot path (hundreds of thousands of
//! tokenizer strings) formats nothing.

use crate::GgufError;

/// A read that failed, before the caller says what it was reading.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// Fewer bytes left than the read needs.
    Short { offset: u64, need: u64, have: u64 },
    /// A string that is not UTF-8.
    Utf8 { offset: u64 },
}

/// Turns a [`ReadError`] into a [`GgufError`] naming what was being read.
pub(crate) trait Context<T> {
    /// `what` is only called on error.
    fn what(self, what: impl FnOnce() -> String) -> Result<T, GgufError>;
}

impl<T> Context<T> for Result<T, ReadError> {
    fn what(self, what: impl FnOnce() -> String) -> Result<T, GgufError> {
        self.map_err(|err| match err {
            ReadError::Short { offset, need, have } => GgufError::Truncated {
                what: what(),
                offset,
                need,
                have,
            },
            ReadError::Utf8 { offset } => GgufError::BadString { what: what(), offset },
        })
    }
}

/// A cursor that never reads past the end of `bytes`.
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { bytes, pos: 0 }
    }

    /// Absolute offset of the next read.
    pub(crate) fn position(&self) -> u64 {
        self.pos as u64
    }

    /// Bytes left after the cursor.
    pub(crate) fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    /// The next `n` bytes; `n` comes from the file, so it is checked before any use.
    pub(crate) fn take(&mut self, n: u64) -> Result<&'a [u8], ReadError> {
        let have = self.remaining();
        if n > have {
            return Err(ReadError::Short {
                offset: self.position(),
                need: n,
                have,
            });
        }
        // n <= remaining, which fits in usize.
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ReadError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N as u64)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, ReadError> {
        Ok(self.array::<1>()?[0])
    }

    pub(crate) fn u16(&mut self) -> Result<u16, ReadError> {
        self.array().map(u16::from_le_bytes)
    }

    pub(crate) fn u32(&mut self) -> Result<u32, ReadError> {
        self.array().map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self) -> Result<u64, ReadError> {
        self.array().map(u64::from_le_bytes)
    }

    /// Four raw bytes (the magic).
    pub(crate) fn bytes4(&mut self) -> Result<[u8; 4], ReadError> {
        self.array()
    }

    /// A GGUF string: u64 byte length, then UTF-8 bytes (no terminator).
    pub(crate) fn string(&mut self) -> Result<String, ReadError> {
        let len = self.u64()?;
        let offset = self.position();
        // take() bounds `len` by the file before anything is allocated.
        let bytes = self.take(len)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(ReadError::Utf8 { offset }),
        }
    }
}

//! What the fuzz targets share: an allocator that remembers the largest allocation, so a
//! target can assert that no length field read from the input sized one.
//!
//! Every parser fuzzed here promises to compare counts and lengths with the bytes that
//! remain before allocating for them. libFuzzer only notices a broken promise when an
//! allocation exceeds its `-malloc_limit_mb` (2 GiB by default); [`check_allocations`]
//! notices one as soon as it is out of proportion to the input.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, recording the size of the largest allocation (or reallocation).
/// A target installs it with `#[global_allocator]`.
pub struct LargestAlloc;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the
// only addition is an atomic maximum, which neither allocates nor touches the memory.
unsafe impl GlobalAlloc for LargestAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as received (see the impl).
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Bytes a parser may allocate at once per input byte. The worst case allowed by design
/// is the GGUF parser's array of one-byte values: one 32-byte `Value` per file byte.
pub const BYTES_PER_INPUT_BYTE: usize = 32;

/// Allocations any run may make regardless of the input (lazily built statics, error
/// texts, the first few buffers).
pub const FIXED_BYTES: usize = 64 << 10;

/// Runs `parse` on an input of `input_len` bytes and panics if it made any single
/// allocation larger than `BYTES_PER_INPUT_BYTE * input_len + FIXED_BYTES`: a sign that a
/// count or length read from the input was trusted. Needs [`LargestAlloc`] installed.
pub fn check_allocations<T>(input_len: usize, parse: impl FnOnce() -> T) -> T {
    LARGEST.store(0, Ordering::Relaxed);
    let out = parse();
    let largest = LARGEST.load(Ordering::Relaxed);
    let bound = BYTES_PER_INPUT_BYTE * input_len + FIXED_BYTES;
    assert!(
        largest <= bound,
        "an allocation of {largest} bytes for an input of {input_len} bytes (bound {bound}): \
         a length field was trusted"
    );
    out
}

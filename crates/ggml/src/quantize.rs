//! Quantizing a GGUF file with libllama's own quantizer (what `llama-quantize` runs), so
//! that generated test models carry exactly the tensor types real models do.

use std::ffi::CString;
use std::path::Path;

use llama_cpp_sys_2 as sys;

use crate::GgmlError;

/// The file types baton's tools quantize to (llama.cpp's `llama_ftype` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileType {
    /// Every tensor stays f32 (the input is copied).
    F32,
    /// Mostly 8-bit (`Q8_0`).
    Q8_0,
    /// Mostly 4-bit k-quants, some tensors at 6 bits (`Q4_K_M`).
    Q4KM,
    /// Expert matrices in MXFP4, the rest `Q8_0` (`MXFP4_MOE`, what gpt-oss ships as).
    Mxfp4Moe,
}

impl FileType {
    /// The names `baton synth --quant` accepts, in the order of [`FileType::ALL`].
    pub const ALL: [FileType; 4] = [FileType::F32, FileType::Q8_0, FileType::Q4KM, FileType::Mxfp4Moe];

    /// llama.cpp's name of the type (`Q4_K_M`).
    pub fn name(self) -> &'static str {
        match self {
            FileType::F32 => "F32",
            FileType::Q8_0 => "Q8_0",
            FileType::Q4KM => "Q4_K_M",
            FileType::Mxfp4Moe => "MXFP4_MOE",
        }
    }

    /// The type named `name` (case-insensitive), if any.
    pub fn from_name(name: &str) -> Option<FileType> {
        FileType::ALL.into_iter().find(|t| t.name().eq_ignore_ascii_case(name))
    }

    fn ftype(self) -> sys::llama_ftype {
        match self {
            FileType::F32 => sys::LLAMA_FTYPE_ALL_F32,
            FileType::Q8_0 => sys::LLAMA_FTYPE_MOSTLY_Q8_0,
            FileType::Q4KM => sys::LLAMA_FTYPE_MOSTLY_Q4_K_M,
            FileType::Mxfp4Moe => sys::LLAMA_FTYPE_MOSTLY_MXFP4_MOE,
        }
    }
}

/// Quantizes the GGUF at `input` (f32 or f16 weights) to `output` as libllama's
/// `llama_model_quantize` does with its default parameters and `file_type`.
pub fn quantize(input: &Path, output: &Path, file_type: FileType, n_threads: usize) -> Result<(), GgmlError> {
    crate::init();
    let c_path = |path: &Path| {
        CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| GgmlError::Llama(format!("path {} contains a NUL byte", path.display())))
    };
    let (c_in, c_out) = (c_path(input)?, c_path(output)?);
    // SAFETY: returns a plain struct of defaults (its pointers are null).
    let mut params = unsafe { sys::llama_model_quantize_default_params() };
    params.nthread = n_threads.max(1) as i32;
    params.ftype = file_type.ftype();
    // SAFETY: valid C strings and params; libllama reads `input`, writes `output` and
    // returns non-zero on failure (it catches its own exceptions).
    let status = unsafe { sys::llama_model_quantize(c_in.as_ptr(), c_out.as_ptr(), &params) };
    if status != 0 {
        return Err(GgmlError::Llama(format!(
            "quantizing {} to {} as {} failed with status {status}",
            input.display(),
            output.display(),
            file_type.name()
        )));
    }
    Ok(())
}

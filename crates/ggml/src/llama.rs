//! libllama: exact llama.cpp tokenization (`vocab_only` load) and, loaded fully, the
//! single-process reference that baton's split model must reproduce.

use std::ffi::CString;
use std::path::Path;
use std::ptr::NonNull;

use llama_cpp_sys_2 as sys;

use crate::{DType, Device, GgmlError};

/// A model loaded through libllama, either vocabulary only or with all weights.
pub struct LlamaModel {
    ptr: NonNull<sys::llama_model>,
}

// SAFETY: libllama models are immutable after load and documented as shareable
// between contexts on different threads.
unsafe impl Send for LlamaModel {}
// SAFETY: see above; every method only reads the model.
unsafe impl Sync for LlamaModel {}

impl LlamaModel {
    /// Loads only the vocabulary (tokenizer), no weights: fast and small.
    pub fn load_vocab(path: &Path) -> Result<LlamaModel, GgmlError> {
        Self::load(path, true, false, None)
    }

    /// Loads the whole model on the CPU (the reference implementation); `repack` is
    /// llama.cpp's default, off is its `--no-repack`. No other device takes part, not
    /// even for large batches (llama.cpp would offload those to a GPU it sees).
    pub fn load_full(path: &Path, repack: bool) -> Result<LlamaModel, GgmlError> {
        Self::load(path, false, repack, None)
    }

    /// Loads the whole model with every layer and the output on `device`, as
    /// llama.cpp's `--device NAME -ngl 999` does: the reference for stages on it.
    pub fn load_full_on(path: &Path, repack: bool, device: Device) -> Result<LlamaModel, GgmlError> {
        Self::load(path, false, repack, Some(device))
    }

    fn load(path: &Path, vocab_only: bool, repack: bool, device: Option<Device>) -> Result<LlamaModel, GgmlError> {
        crate::init();
        let c_path = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| GgmlError::Llama(format!("model path {} contains a NUL byte", path.display())))?;
        // SAFETY: returns a plain struct of defaults.
        let mut params = unsafe { sys::llama_model_default_params() };
        params.vocab_only = vocab_only;
        params.use_extra_bufts = repack;
        // A null-terminated device list: empty keeps everything on the CPU.
        let mut devices = [std::ptr::null_mut(); 2];
        match device.filter(|d| !d.is_cpu()) {
            Some(device) => {
                devices[0] = device.raw();
                params.n_gpu_layers = 999;
            }
            None => params.n_gpu_layers = 0,
        }
        // The list outlives the load call, which copies it.
        params.devices = devices.as_mut_ptr();
        crate::take_logged_errors();
        // SAFETY: valid C string and params; null on failure.
        let ptr = unsafe { sys::llama_model_load_from_file(c_path.as_ptr(), params) };
        NonNull::new(ptr).map(|ptr| LlamaModel { ptr }).ok_or_else(|| {
            let said = crate::take_logged_errors().replace('\n', "; ");
            GgmlError::Llama(format!("libllama could not load {}: {said}", path.display()))
        })
    }

    fn vocab(&self) -> *const sys::llama_vocab {
        // SAFETY: valid model; the vocab lives as long as the model.
        unsafe { sys::llama_model_get_vocab(self.ptr.as_ptr()) }
    }

    /// Tokenizes `text` exactly as llama.cpp does. `add_special` adds BOS/EOS as the
    /// GGUF says; `parse_special` turns special-token text (e.g. `<|im_start|>`) into ids.
    pub fn tokenize(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>, GgmlError> {
        let len = i32::try_from(text.len()).map_err(|_| GgmlError::Llama("text too long to tokenize".into()))?;
        let mut tokens = vec![0i32; text.len() + 8];
        loop {
            // SAFETY: `text` is valid for `len` bytes; `tokens` has the capacity we pass.
            let n = unsafe {
                sys::llama_tokenize(
                    self.vocab(),
                    text.as_ptr().cast(),
                    len,
                    tokens.as_mut_ptr(),
                    tokens.len() as i32,
                    add_special,
                    parse_special,
                )
            };
            if n == i32::MIN {
                return Err(GgmlError::Llama("tokenization overflowed".into()));
            }
            if n < 0 {
                tokens.resize((-n) as usize, 0);
                continue;
            }
            tokens.truncate(n as usize);
            return Ok(tokens.into_iter().map(|t| t as u32).collect());
        }
    }

    /// The bytes of one token (special tokens rendered when `special`). Pieces of a
    /// multi-byte character may be incomplete UTF-8, so this returns bytes.
    pub fn token_bytes(&self, token: u32, special: bool) -> Vec<u8> {
        let mut buf = vec![0u8; 64];
        loop {
            // SAFETY: `buf` is writable for the length we pass.
            let n = unsafe {
                sys::llama_token_to_piece(
                    self.vocab(),
                    token as i32,
                    buf.as_mut_ptr().cast(),
                    buf.len() as i32,
                    0,
                    special,
                )
            };
            if n < 0 {
                buf.resize((-n) as usize, 0);
                continue;
            }
            buf.truncate(n as usize);
            return buf;
        }
    }

    /// Text of a token sequence (invalid UTF-8 replaced).
    pub fn detokenize(&self, tokens: &[u32], special: bool) -> String {
        let bytes: Vec<u8> = tokens.iter().flat_map(|&t| self.token_bytes(t, special)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Size of the vocabulary.
    pub fn n_vocab(&self) -> usize {
        // SAFETY: valid vocab.
        unsafe { sys::llama_vocab_n_tokens(self.vocab()) as usize }
    }

    /// Whether `token` ends generation (EOS, EOT and friends).
    pub fn is_end_of_generation(&self, token: u32) -> bool {
        // SAFETY: valid vocab; any id is accepted.
        unsafe { sys::llama_vocab_is_eog(self.vocab(), token as i32) }
    }

    /// The beginning-of-sequence token, if the vocabulary has one.
    pub fn bos_token(&self) -> Option<u32> {
        // SAFETY: valid vocab.
        let token = unsafe { sys::llama_vocab_bos(self.vocab()) };
        u32::try_from(token).ok()
    }

    /// The end-of-sequence token, if the vocabulary has one.
    pub fn eos_token(&self) -> Option<u32> {
        // SAFETY: valid vocab.
        let token = unsafe { sys::llama_vocab_eos(self.vocab()) };
        u32::try_from(token).ok()
    }

    /// Whether tokenizing with `add_special` puts the BOS token first.
    pub fn adds_bos(&self) -> bool {
        // SAFETY: valid vocab.
        unsafe { sys::llama_vocab_get_add_bos(self.vocab()) }
    }

    /// The model's embedded chat template, if any.
    pub fn chat_template(&self) -> Option<String> {
        // SAFETY: valid model; null name selects the default template; the returned
        // string is owned by the model.
        let ptr = unsafe { sys::llama_model_chat_template(self.ptr.as_ptr(), std::ptr::null()) };
        if ptr.is_null() {
            return None;
        }
        // SAFETY: non-null NUL-terminated string owned by the model.
        Some(unsafe { std::ffi::CStr::from_ptr(ptr) }.to_string_lossy().into_owned())
    }
}

impl Drop for LlamaModel {
    fn drop(&mut self) {
        // SAFETY: we own the model; contexts borrow it and are dropped first.
        unsafe { sys::llama_model_free(self.ptr.as_ptr()) }
    }
}

/// How a libllama context pools a sequence's rows into an embedding (llama.cpp's
/// `LLAMA_POOLING_TYPE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlamaPooling {
    /// The mean of every row.
    Mean,
    /// The first row.
    Cls,
    /// The last row.
    Last,
    /// No pooling: every row after the output norm ([`LlamaContext::embed_rows`]).
    None,
}

/// A libllama inference context over a fully loaded model: the reference oracle.
pub struct LlamaContext<'m> {
    ptr: NonNull<sys::llama_context>,
    model: &'m LlamaModel,
    n_past: usize,
}

impl<'m> LlamaContext<'m> {
    /// A context with `n_ctx` cells, `n_batch` tokens per decode call and `n_threads` threads.
    /// Flash attention is on and the KV cache is f16, as baton's stages compute.
    pub fn new(model: &'m LlamaModel, n_ctx: u32, n_batch: u32, n_threads: usize) -> Result<Self, GgmlError> {
        Self::with_cache_types(model, n_ctx, n_batch, n_threads, [DType::F16, DType::F16])
    }

    /// [`LlamaContext::new`] with keys and values cached as `[type_k, type_v]`
    /// (llama.cpp's `-ctk`/`-ctv`).
    pub fn with_cache_types(
        model: &'m LlamaModel,
        n_ctx: u32,
        n_batch: u32,
        n_threads: usize,
        [type_k, type_v]: [DType; 2],
    ) -> Result<Self, GgmlError> {
        let mut params = Self::params(n_ctx, n_batch, n_threads);
        params.type_k = type_k.0;
        params.type_v = type_v.0;
        Self::with_params(model, params)
    }

    /// [`LlamaContext::new`] with llama.cpp's window-sized cache for sliding-window
    /// layers (`swa_full` off, as llama-server and llama-cli run by default; the
    /// library's default keeps a cell per token): `n_swa + n_batch` cells, padded to
    /// 256, placed as a ring.
    pub fn with_window_cache(
        model: &'m LlamaModel,
        n_ctx: u32,
        n_batch: u32,
        n_threads: usize,
    ) -> Result<Self, GgmlError> {
        let mut params = Self::params(n_ctx, n_batch, n_threads);
        params.swa_full = false;
        Self::with_params(model, params)
    }

    /// libllama's context defaults with baton's: `n_ctx` cells, `n_batch` tokens per
    /// decode call (and micro-batch), `n_threads` threads, one sequence, flash attention.
    fn params(n_ctx: u32, n_batch: u32, n_threads: usize) -> sys::llama_context_params {
        // SAFETY: returns a plain struct of defaults.
        let mut params = unsafe { sys::llama_context_default_params() };
        params.n_ctx = n_ctx;
        params.n_batch = n_batch;
        params.n_ubatch = n_batch;
        params.n_seq_max = 1;
        params.n_threads = n_threads as i32;
        params.n_threads_batch = n_threads as i32;
        params.flash_attn_type = sys::LLAMA_FLASH_ATTN_TYPE_ENABLED;
        params.no_perf = true;
        params
    }

    fn with_params(model: &'m LlamaModel, params: sys::llama_context_params) -> Result<Self, GgmlError> {
        // SAFETY: valid model and params; null on failure.
        let ptr = unsafe { sys::llama_init_from_model(model.ptr.as_ptr(), params) };
        let ptr = NonNull::new(ptr).ok_or_else(|| GgmlError::Llama("llama_init_from_model failed".into()))?;
        Ok(LlamaContext { ptr, model, n_past: 0 })
    }

    /// Appends `tokens` to the sequence (one decode call).
    fn decode_only(&mut self, tokens: &[u32]) -> Result<(), GgmlError> {
        let mut ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        // SAFETY: the batch borrows `ids`, which outlives the decode call.
        let status = unsafe {
            let batch = sys::llama_batch_get_one(ids.as_mut_ptr(), ids.len() as i32);
            sys::llama_decode(self.ptr.as_ptr(), batch)
        };
        if status != 0 {
            return Err(GgmlError::Llama(format!("llama_decode failed with status {status}")));
        }
        self.n_past += tokens.len();
        Ok(())
    }

    /// Appends `tokens` to the sequence; returns the logits of the last one.
    pub fn decode(&mut self, tokens: &[u32]) -> Result<Vec<f32>, GgmlError> {
        self.decode_only(tokens)?;
        let n_vocab = self.model.n_vocab();
        // SAFETY: after a successful decode the last token's logits hold n_vocab floats.
        let logits = unsafe { sys::llama_get_logits_ith(self.ptr.as_ptr(), -1) };
        if logits.is_null() {
            return Err(GgmlError::Llama("llama_get_logits_ith returned no logits".into()));
        }
        // SAFETY: non-null, n_vocab floats, valid until the next decode.
        Ok(unsafe { std::slice::from_raw_parts(logits, n_vocab) }.to_vec())
    }

    /// A context that computes pooled embeddings instead of logits, as llama-server
    /// `--embeddings --pooling P` does: every row is an output, and the rows after the
    /// output norm are pooled per sequence (`llama_get_embeddings_seq`). `n_batch` is
    /// also the largest input [`LlamaContext::embed`] takes (llama.cpp pools within
    /// one micro-batch only).
    pub fn for_embeddings(
        model: &'m LlamaModel,
        n_ctx: u32,
        n_batch: u32,
        n_threads: usize,
        pooling: LlamaPooling,
    ) -> Result<Self, GgmlError> {
        let mut params = Self::params(n_ctx, n_batch, n_threads);
        params.embeddings = true;
        params.pooling_type = match pooling {
            LlamaPooling::Mean => sys::LLAMA_POOLING_TYPE_MEAN,
            LlamaPooling::Cls => sys::LLAMA_POOLING_TYPE_CLS,
            LlamaPooling::Last => sys::LLAMA_POOLING_TYPE_LAST,
            LlamaPooling::None => sys::LLAMA_POOLING_TYPE_NONE,
        };
        Self::with_params(model, params)
    }

    /// The pooled embedding of `tokens` as a fresh sequence (the cache is cleared
    /// first), not normalized; on a context made by [`LlamaContext::for_embeddings`].
    pub fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, GgmlError> {
        self.clear();
        self.decode_only(tokens)?;
        // SAFETY: valid model.
        let n_embd = unsafe { sys::llama_model_n_embd_out(self.model.ptr.as_ptr()) }.max(0) as usize;
        // SAFETY: valid context; sequence 0 was just decoded.
        let pooled = unsafe { sys::llama_get_embeddings_seq(self.ptr.as_ptr(), 0) };
        if pooled.is_null() {
            return Err(GgmlError::Llama(
                "llama_get_embeddings_seq returned nothing (a context without pooling?)".into(),
            ));
        }
        // SAFETY: non-null, n_embd floats, valid until the next decode.
        Ok(unsafe { std::slice::from_raw_parts(pooled, n_embd) }.to_vec())
    }

    /// Every row of a fresh sequence after the output norm, `n_embd` each, fed in
    /// `chunks` (one decode call each, positions continuing), on a context made by
    /// [`LlamaContext::for_embeddings`] with [`LlamaPooling::None`].
    pub fn embed_rows(&mut self, chunks: &[&[u32]]) -> Result<Vec<f32>, GgmlError> {
        self.clear();
        // SAFETY: valid model.
        let n_embd = unsafe { sys::llama_model_n_embd_out(self.model.ptr.as_ptr()) }.max(0) as usize;
        let mut rows = Vec::new();
        for chunk in chunks {
            self.decode_only(chunk)?;
            // SAFETY: valid context; every row of the batch is an output.
            let values = unsafe { sys::llama_get_embeddings(self.ptr.as_ptr()) };
            if values.is_null() {
                return Err(GgmlError::Llama("llama_get_embeddings returned nothing".into()));
            }
            // SAFETY: non-null, one row of n_embd floats per token of the batch.
            rows.extend_from_slice(unsafe { std::slice::from_raw_parts(values, n_embd * chunk.len()) });
        }
        Ok(rows)
    }

    /// Forgets everything in the KV cache.
    pub fn clear(&mut self) {
        // SAFETY: valid context; clearing data too.
        unsafe { sys::llama_memory_clear(sys::llama_get_memory(self.ptr.as_ptr()), true) };
        self.n_past = 0;
    }

    /// Tokens currently in the sequence.
    pub fn n_past(&self) -> usize {
        self.n_past
    }
}

impl Drop for LlamaContext<'_> {
    fn drop(&mut self) {
        // SAFETY: we own the context.
        unsafe { sys::llama_free(self.ptr.as_ptr()) }
    }
}

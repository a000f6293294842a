//! Synthetic models: a GGUF of any architecture baton runs, with a chosen small shape
//! and random weights, the tokenizer of a real model, quantized by libllama's own
//! quantizer. libllama loads them like any downloaded model, so tests can compare
//! baton with it on architectures whose real models are far too large for CI (and
//! `baton synth` writes them for benchmarks).
//!
//! The weights come from the architecture's own key and tensor lists
//! (`baton_model::example`); a list that disagrees with llama.cpp makes libllama refuse
//! the file, so the lists are checked by every test that loads one.
#![deny(unsafe_code)]

mod tokenizer;

use std::path::{Path, PathBuf};

use baton_ggml::{FileType, MappedFile};
use baton_gguf::{Gguf, GgufError};
use baton_model::example::{example_gguf, example_metadata, example_tensors, ExampleOptions};
use baton_model::{Architecture, HParams, ModelError, Shape};

pub use baton_gguf::Value;
pub use tokenizer::copy_tokenizer;

/// Bumped whenever the same spec would produce other bytes (cached files are rebuilt).
const GENERATOR_VERSION: u32 = 2;

/// Everything that decides a synthetic model.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthSpec {
    /// Architecture (`general.architecture`).
    pub arch: &'static Architecture,
    /// Layer counts and sizes.
    pub shape: Shape,
    /// How libllama quantizes it.
    pub file_type: FileType,
    /// The GGUF whose tokenizer is copied.
    pub tokenizer: PathBuf,
    /// Keep only this many ordinary tokens (special tokens are always kept); `None`:
    /// the whole vocabulary.
    pub vocab: Option<usize>,
    /// Seed of the weights.
    pub seed: u64,
    /// Whether the output projection reuses the token embedding.
    pub tied_output: bool,
    /// Whether to write the tensors the architecture takes when present but real files
    /// usually lack (to test those paths).
    pub optional_tensors: bool,
    /// Metadata that replaces the example's or adds to it (full key names, e.g.
    /// `kimi-k3.attn_res.block_size`), for variants the shape does not decide.
    pub keys: Vec<(String, Value)>,
}

/// What can go wrong making a synthetic model.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The tokenizer source is not a GGUF with a tokenizer.
    #[error("cannot copy the tokenizer: {0}")]
    Tokenizer(GgufError),
    /// The architecture rejected the shape.
    #[error("the shape does not make a valid model: {0}")]
    Model(#[from] ModelError),
    /// libllama could not quantize it.
    #[error(transparent)]
    Quantize(#[from] baton_ggml::GgmlError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SynthError + '_ {
    move |source| SynthError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl SynthSpec {
    /// A spec with the qwen2 test model's tokenizer cut to 8192 ordinary tokens, seed 1,
    /// tied output, quantized as `file_type`.
    pub fn new(arch: &'static Architecture, shape: Shape, file_type: FileType, tokenizer: PathBuf) -> SynthSpec {
        SynthSpec {
            arch,
            shape,
            file_type,
            tokenizer,
            vocab: Some(8192),
            seed: 1,
            tied_output: true,
            optional_tensors: false,
            keys: Vec::new(),
        }
    }

    /// A stable name for the model this spec makes: architecture, file type and a hash
    /// of everything else (metadata, tensor list, tokenizer source, seed, generator).
    pub fn file_name(&self) -> Result<String, SynthError> {
        let mut text = format!(
            "v{GENERATOR_VERSION} {:?} {:?} {} {:?} {}",
            self.shape,
            self.vocab,
            self.seed,
            self.tied_output,
            self.file_type.name()
        );
        let meta = std::fs::metadata(&self.tokenizer).map_err(io(&self.tokenizer))?;
        text += &format!(" tokenizer {:?} {}", self.tokenizer.file_name(), meta.len());
        let metadata = example_metadata(self.arch, &self.shape);
        text += &format!(" {metadata:?}");
        if !self.keys.is_empty() {
            text += &format!(" keys {:?}", self.keys);
        }
        let header = baton_gguf::GgufWriter::new();
        let header = metadata
            .into_iter()
            .chain(self.keys.iter().cloned())
            .fold(header, |w, (k, v)| w.without_kv(&k).kv(k, v));
        let gguf = Gguf::parse(&header.to_bytes()).map_err(ModelError::from)?;
        let hp = HParams::from_metadata(&gguf, 1)?;
        for spec in example_tensors(&hp, self.tied_output, self.optional_tensors) {
            text += &format!(" {} {:?}", spec.name, spec.shape);
        }
        let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        });
        Ok(format!(
            "{}-{}-v{GENERATOR_VERSION}-{hash:016x}.gguf",
            self.arch.name,
            self.file_type.name().to_lowercase()
        ))
    }
}

/// Writes the model `spec` describes to `out` (through a temporary file next to it, so
/// a reader never sees half a file). Returns the vocabulary size.
pub fn synthesize(spec: &SynthSpec, out: &Path, n_threads: usize) -> Result<usize, SynthError> {
    let source = MappedFile::open(&spec.tokenizer).map_err(io(&spec.tokenizer))?;
    let header = Gguf::parse(source.bytes()).map_err(SynthError::Tokenizer)?;
    let (mut extra, n_vocab) = copy_tokenizer(&header, spec.vocab)?;
    // Not the architecture's name: llama.cpp tunes some tokenizers by the model's name
    // (e.g. "phi3"), and this tokenizer is another model's.
    extra.push(("general.name".into(), Value::Str("baton synthetic model".into())));
    extra.extend(spec.keys.iter().cloned());
    let options = ExampleOptions {
        n_vocab,
        seed: spec.seed,
        tied_output: spec.tied_output,
        optional_tensors: spec.optional_tensors,
    };
    let writer = example_gguf(spec.arch, &spec.shape, &options, extra)?;
    let f32_path = temp_path(out, "f32");
    std::fs::write(&f32_path, writer.to_bytes()).map_err(io(&f32_path))?;
    drop(writer);
    let done = if spec.file_type == FileType::F32 {
        Ok(())
    } else {
        let quant_path = temp_path(out, "quant");
        let result = baton_ggml::quantize(&f32_path, &quant_path, spec.file_type, n_threads);
        let _ = std::fs::remove_file(&f32_path);
        result
            .map_err(SynthError::from)
            .and_then(|()| std::fs::rename(&quant_path, &f32_path).map_err(io(&quant_path)))
    };
    if let Err(e) = done {
        let _ = std::fs::remove_file(&f32_path);
        return Err(e);
    }
    std::fs::rename(&f32_path, out).map_err(io(out))?;
    tracing::info!(path = %out.display(), arch = spec.arch.name, n_vocab, "synthetic model written");
    Ok(n_vocab)
}

/// The model `spec` describes, in `dir` under its [`SynthSpec::file_name`]: made once,
/// then reused (tests share them between runs and processes). Models an older
/// generator made there are removed.
pub fn cached(spec: &SynthSpec, dir: &Path) -> Result<PathBuf, SynthError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let current = format!("-v{GENERATOR_VERSION}-");
    for entry in std::fs::read_dir(dir).map_err(io(dir))?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".gguf") && !name.contains(&current) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    let path = dir.join(spec.file_name()?);
    if !path.exists() {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        synthesize(spec, &path, threads)?;
    }
    Ok(path)
}

/// A temporary name next to `out`, unique to this process and thread.
fn temp_path(out: &Path, tag: &str) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    out.with_file_name(format!(
        ".{name}.{tag}.{}.{:?}.tmp",
        std::process::id(),
        std::thread::current().id()
    ))
}

//! Example models: a GGUF of any architecture with a chosen small [`Shape`] and random
//! f32 weights, from the architecture's own keys and tensor list (no tokenizer; see
//! `baton-synth` for files libllama can load and quantize).

use baton_gguf::{Gguf, GgufWriter, Value};

use crate::arch::{Architecture, Shape};
use crate::hparams::HParams;
use crate::tensors::{Presence, TensorSpec, Use};
use crate::ModelError;

/// What to write besides the shape.
#[derive(Clone, Debug)]
pub struct ExampleOptions {
    /// Rows of the token embedding.
    pub n_vocab: usize,
    /// Seed of the weights.
    pub seed: u64,
    /// Whether the output projection reuses the token embedding (no `output.weight`).
    pub tied_output: bool,
    /// Whether to write the tensors an architecture takes when present but real files
    /// usually lack (llama's biases, glm4moe's q/k norms, ...), to test those paths.
    pub optional_tensors: bool,
}

/// The metadata of an example model: `general.architecture`, the keys every model has
/// (from `shape`), then the architecture's own (which may override the common ones).
pub fn example_metadata(arch: &Architecture, shape: &Shape) -> Vec<(String, Value)> {
    let mut keys: Vec<(&'static str, Value)> = vec![
        ("block_count", Value::U32(shape.n_layer as u32)),
        ("context_length", Value::U32(shape.n_ctx as u32)),
        ("embedding_length", Value::U32(shape.n_embd as u32)),
        ("attention.head_count", Value::U32(shape.n_head as u32)),
        ("attention.head_count_kv", Value::U32(shape.n_head_kv as u32)),
        ("attention.key_length", Value::U32(shape.head_dim as u32)),
        ("attention.value_length", Value::U32(shape.head_dim as u32)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("rope.freq_base", Value::F32(10_000.0)),
        ("rope.dimension_count", Value::U32(shape.head_dim as u32)),
    ];
    if shape.n_ff > 0 {
        keys.push(("feed_forward_length", Value::U32(shape.n_ff as u32)));
    }
    for (key, value) in (arch.example)(shape) {
        keys.retain(|(k, _)| *k != key);
        keys.push((key, value));
    }
    let mut metadata = vec![("general.architecture".to_string(), Value::Str(arch.name.into()))];
    metadata.extend(keys.into_iter().map(|(k, v)| (format!("{}.{k}", arch.name), v)));
    metadata
}

/// The tensors an example model of `hp` holds: what the architecture requires or
/// usually has (everything it takes, with `optional`), fused forms left out, the output
/// projection as `tied` says.
pub fn example_tensors(hp: &HParams, tied_output: bool, optional: bool) -> Vec<TensorSpec> {
    let tied_output = tied_output && !hp.arch.own_output;
    let in_file = |name: &str| name == crate::EndTensor::Output.name() && !tied_output;
    crate::model_tensors(hp, &in_file)
        .into_iter()
        .filter(|spec| (optional || spec.presence != Presence::Optional) && spec.name == spec.source)
        .collect()
}

/// A complete example model: metadata (plus `extra`, e.g. a tokenizer) and random
/// weights, ready to write.
pub fn example_gguf(
    arch: &Architecture,
    shape: &Shape,
    options: &ExampleOptions,
    extra: Vec<(String, Value)>,
) -> Result<GgufWriter, ModelError> {
    let mut writer = GgufWriter::new();
    for (key, value) in example_metadata(arch, shape).into_iter().chain(extra) {
        writer = writer.without_kv(&key).kv(key, value);
    }
    let header = Gguf::parse(&writer.to_bytes())?;
    let hp = HParams::from_metadata(&header, options.n_vocab)?;
    for spec in example_tensors(&hp, options.tied_output, options.optional_tensors) {
        let dims: Vec<u64> = spec.shape.iter().map(|&d| d as u64).collect();
        writer = match spec.usage {
            Use::ExpertIds => {
                let ids = expert_ids(&spec, hp.moe.n_expert);
                let bytes = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
                writer.tensor_raw(&spec.name, &dims, baton_gguf::GgmlType::I32, bytes)
            }
            _ => writer.tensor_f32(&spec.name, &dims, &random_weights(&spec, options.seed)),
        };
    }
    Ok(writer)
}

/// A hash-routing table `[n_used, n_vocab]`: each token's experts distinct, spread over
/// all `n_expert` by the token id.
fn expert_ids(spec: &TensorSpec, n_expert: usize) -> Vec<i32> {
    let (n_used, n_vocab) = (spec.shape[0] as usize, spec.shape[1] as usize);
    (0..n_vocab)
        .flat_map(|token| (0..n_used).map(move |e| ((token * 5 + e) % n_expert.max(1)) as i32))
        .collect()
}

/// Weights that keep activations near unit scale: matrices uniform with variance
/// `1/fan_in`, norm weights near 1, other vectors (biases, sinks) small, embeddings
/// uniform in ±1. Deterministic in `seed` and the tensor's name.
fn random_weights(spec: &TensorSpec, seed: u64) -> Vec<f32> {
    let n: i64 = spec.shape.iter().product();
    let name_hash = spec.name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    let mut state = (seed ^ name_hash).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut uniform = move || {
        // xorshift64*, mapped to [-1, 1).
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let bits = state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        bits as f32 / (1u64 << 23) as f32 - 1.0
    };
    let (scale, offset) = match spec.usage {
        // Norm weights and scales (Gemma 4's layer output, router input, experts) near 1.
        Use::Elementwise
            if spec.name.contains("norm")
                || spec.name.ends_with("layer_output_scale.weight")
                || spec.name.ends_with(".scale") =>
        {
            (0.1, 1.0)
        }
        // A DeltaNet layer's decay rate must be negative (a real model's `-exp(A_log)`),
        // or its state grows without bound; its convolution taps near unit scale.
        Use::Elementwise if spec.name.ends_with(".ssm_a") => (0.5, -1.0),
        Use::Elementwise if spec.name.contains("ssm_conv1d") => (0.5, 0.0),
        // RoPE frequency factors between 0.5 and 1.5 (a real model's are positive).
        Use::Elementwise if spec.name == crate::EndTensor::RopeFreqs.name() => (0.5, 1.0),
        // Hyper-connections' scales near 1, so the streams' scores matter.
        Use::Elementwise if spec.name.contains("hc_") && spec.name.contains("_scale") => (0.5, 1.0),
        Use::Elementwise => (0.1, 0.0),
        Use::Embedding => (1.0, 0.0),
        Use::MulMat | Use::Experts | Use::ExpertIds => ((3.0 / spec.shape[0] as f32).sqrt(), 0.0),
    };
    (0..n).map(|_| offset + scale * uniform()).collect()
}

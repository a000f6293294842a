//! What tensors a model has: each architecture lists its layer tensors (name, shape, how
//! they are used, whether the file must have them) through a [`LayerPlan`]; the loader
//! checks the file against that list, and `baton synth` writes files from it.

use crate::hparams::HParams;
use crate::names::{EndTensor, FfnTensors, LayerTensor};

/// How a weight is used, which decides its type checks and whether ggml may repack it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// Multiplied by activations (`mul_mat`): any float or quantized type.
    MulMat,
    /// Expert matrices (`mul_mat_id`): any float or quantized type.
    Experts,
    /// Element-wise (norms, biases, scales): f32.
    Elementwise,
    /// Rows looked up by token id (`get_rows`): any type, never repacked.
    Embedding,
}

/// Whether a tensor must be in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presence {
    /// The model cannot be computed without it.
    Required,
    /// Used when the file has it; example models leave it out.
    Optional,
    /// Used when the file has it; example models include it (most real files do).
    Usual,
}

/// Which tensor of the model a [`TensorSpec`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorKind {
    /// A tensor of layer `layer`.
    Layer { layer: usize, tensor: LayerTensor },
    /// A tensor of the model's ends.
    End(EndTensor),
}

/// One tensor a stage reads.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    /// Which tensor it is.
    pub kind: TensorKind,
    /// Its name in the stage (`blk.3.attn_q.weight`).
    pub name: String,
    /// The file tensor it reads (a tied output reads `token_embd.weight`).
    pub source: String,
    /// Shape, `ne[0]` first.
    pub shape: Vec<i64>,
    /// How it is used.
    pub usage: Use,
    /// Whether the file must have it.
    pub presence: Presence,
}

/// The tensors of one layer, as an architecture lists them.
pub struct LayerPlan<'a> {
    /// The model's hyper-parameters.
    pub hp: &'a HParams,
    /// The global layer index.
    pub layer: usize,
    has: &'a dyn Fn(&str) -> bool,
    specs: Vec<TensorSpec>,
}

impl<'a> LayerPlan<'a> {
    /// An empty list for `layer`; `has(name)` says whether the file holds
    /// `blk.{layer}.{name}` (for tensors that come in alternative forms).
    pub fn new(hp: &'a HParams, layer: usize, has: &'a dyn Fn(&str) -> bool) -> LayerPlan<'a> {
        LayerPlan {
            hp,
            layer,
            has,
            specs: Vec::new(),
        }
    }

    /// The listed tensors.
    pub fn into_specs(self) -> Vec<TensorSpec> {
        self.specs
    }

    /// Whether the file holds this layer's `tensor`.
    pub fn file_has(&self, tensor: LayerTensor) -> bool {
        (self.has)(tensor.name())
    }

    fn add(&mut self, tensor: LayerTensor, shape: &[usize], usage: Use) -> &mut TensorSpec {
        let full = tensor.in_layer(self.layer);
        self.specs.push(TensorSpec {
            kind: TensorKind::Layer {
                layer: self.layer,
                tensor,
            },
            name: full.clone(),
            source: full,
            shape: shape.iter().map(|&d| d as i64).collect(),
            usage,
            presence: Presence::Required,
        });
        self.specs.last_mut().expect("just pushed")
    }

    /// A required matrix multiplied by activations.
    pub fn mat(&mut self, tensor: LayerTensor, shape: &[usize]) -> &mut TensorSpec {
        self.add(tensor, shape, Use::MulMat)
    }

    /// A required stack of expert matrices `[k, n, n_expert]`.
    pub fn experts(&mut self, tensor: LayerTensor, shape: &[usize]) -> &mut TensorSpec {
        self.add(tensor, shape, Use::Experts)
    }

    /// A required f32 tensor used element-wise (norm weights, biases).
    pub fn vec(&mut self, tensor: LayerTensor, shape: &[usize]) -> &mut TensorSpec {
        self.add(tensor, shape, Use::Elementwise)
    }
}

impl TensorSpec {
    /// Marks the tensor optional: used when present.
    pub fn optional(&mut self) -> &mut Self {
        self.presence = Presence::Optional;
        self
    }

    /// Marks the tensor optional but usual: used when present, written in examples.
    pub fn usual(&mut self) -> &mut Self {
        self.presence = Presence::Usual;
        self
    }

    /// Sets how the file must hold it.
    pub fn presence(&mut self, presence: Presence) -> &mut Self {
        self.presence = presence;
        self
    }
}

/// The attention projections every llama-like layer has, as llama.cpp's
/// `create_tensor_qkv` lists them: fused `attn_qkv` when the file has it, else separate
/// q, k and v; biases optional (`biases` says how usual they are); and the output.
pub fn attention(t: &mut LayerPlan<'_>, biases: Presence) {
    use LayerTensor as T;
    let hp = t.hp;
    let (embd, q, k, v) = (
        hp.n_embd,
        hp.head_dim_k * hp.n_head,
        hp.n_embd_k_gqa(),
        hp.n_embd_v_gqa(),
    );
    let separate_biases = [(T::AttnQBias, q), (T::AttnKBias, k), (T::AttnVBias, v)];
    if t.file_has(T::AttnQkv) {
        t.mat(T::AttnQkv, &[embd, q + k + v]);
        if t.file_has(T::AttnQkvBias) {
            t.vec(T::AttnQkvBias, &[q + k + v]);
        } else {
            for (bias, n) in separate_biases {
                t.vec(bias, &[n]).optional();
            }
        }
    } else {
        t.mat(T::AttnQ, &[embd, q]);
        t.mat(T::AttnK, &[embd, k]);
        t.mat(T::AttnV, &[embd, v]);
        for (bias, n) in separate_biases {
            t.vec(bias, &[n]).presence(biases);
        }
    }
    t.mat(T::AttnOutput, &[hp.head_dim_v * hp.n_head, embd]);
}

/// Per-head RMS norms of queries and keys (`attn_q_norm`, `attn_k_norm`).
pub fn qk_norms(t: &mut LayerPlan<'_>, presence: Presence) {
    let head = t.hp.head_dim_k;
    t.vec(LayerTensor::AttnQNorm, &[head]).presence(presence);
    t.vec(LayerTensor::AttnKNorm, &[head]).presence(presence);
}

/// A gated feed-forward block `ffn` (the dense FFN's or the shared experts' tensors) of
/// inner size `n_ff`, with optional biases where `biases` and the block has them.
pub fn ffn(t: &mut LayerPlan<'_>, ffn: &FfnTensors, n_ff: usize, biases: bool) {
    let embd = t.hp.n_embd;
    t.mat(ffn.gate, &[embd, n_ff]);
    t.mat(ffn.up, &[embd, n_ff]);
    t.mat(ffn.down, &[n_ff, embd]);
    if let (true, Some([gate, up, down])) = (biases, ffn.biases) {
        t.vec(gate, &[n_ff]).optional();
        t.vec(up, &[n_ff]).optional();
        t.vec(down, &[embd]).optional();
    }
}

/// The routed experts of a mixture-of-experts layer: the router `ffn_gate_inp` and the
/// expert stacks `ffn_{gate,up,down}_exps` of inner size `n_ff_exp` (gate and up fused
/// in `ffn_gate_up_exps` when the file has that and the architecture allows it, as
/// llama.cpp's `create_tensor_gate_up_exps` does).
pub fn experts(t: &mut LayerPlan<'_>, n_ff_exp: usize, fused_gate_up: bool) {
    use LayerTensor as T;
    let (embd, n_expert) = (t.hp.n_embd, t.hp.moe.n_expert);
    t.mat(T::FfnGateInp, &[embd, n_expert]);
    if fused_gate_up && t.file_has(T::FfnGateUpExps) {
        t.experts(T::FfnGateUpExps, &[embd, 2 * n_ff_exp, n_expert]);
    } else {
        t.experts(T::FfnGateExps, &[embd, n_ff_exp, n_expert]);
        t.experts(T::FfnUpExps, &[embd, n_ff_exp, n_expert]);
    }
    t.experts(T::FfnDownExps, &[n_ff_exp, embd, n_expert]);
}

/// The tensors of a model's two ends: the token embedding (first stage), the output
/// norm and projection (last stage; tied to the embedding when the file has no
/// `output.weight`), and the RoPE frequency factors of architectures that have them.
pub fn ends(hp: &HParams, first: bool, last: bool, in_file: &dyn Fn(&str) -> bool) -> Vec<TensorSpec> {
    let (embd, vocab) = (hp.n_embd as i64, hp.n_vocab as i64);
    let spec = |tensor: EndTensor, source: EndTensor, shape: Vec<i64>, usage| TensorSpec {
        kind: TensorKind::End(tensor),
        name: tensor.name().into(),
        source: source.name().into(),
        shape,
        usage,
        presence: Presence::Required,
    };
    let mut specs = Vec::new();
    if first {
        specs.push(spec(
            EndTensor::TokenEmbd,
            EndTensor::TokenEmbd,
            vec![embd, vocab],
            Use::Embedding,
        ));
    }
    if last {
        specs.push(spec(
            EndTensor::OutputNorm,
            EndTensor::OutputNorm,
            vec![embd],
            Use::Elementwise,
        ));
        let source = if hp.arch.own_output || in_file(EndTensor::Output.name()) {
            EndTensor::Output
        } else {
            EndTensor::TokenEmbd
        };
        specs.push(spec(EndTensor::Output, source, vec![embd, vocab], Use::MulMat));
    }
    if hp.arch.rope_freqs && in_file(EndTensor::RopeFreqs.name()) {
        let n = hp.rope.n_dims as i64 / 2;
        specs.push(spec(
            EndTensor::RopeFreqs,
            EndTensor::RopeFreqs,
            vec![n],
            Use::Elementwise,
        ));
    }
    specs
}

/// The tensors of layer `layer`, as its architecture lists them; `has(name)` says
/// whether the file holds `blk.{layer}.{name}`.
pub fn layer(hp: &HParams, layer: usize, has: &dyn Fn(&str) -> bool) -> Vec<TensorSpec> {
    let mut plan = LayerPlan::new(hp, layer, has);
    (hp.arch.tensors)(&mut plan);
    plan.into_specs()
}

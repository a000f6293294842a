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
    /// Expert ids (i32) looked up by token id (DeepSeek V4's hash routing).
    ExpertIds,
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

/// How tensor parallelism cuts a tensor among the members of a group: always by rows
/// (output features), never along the input dimension (see [`crate::tp`], which turns
/// each of these into a member's slice).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every member holds all of it.
    Whole,
    /// Every member with query heads holds all of it, a member without none (the
    /// attention's own norms, MLA's compressions every head reads).
    WithHeads,
    /// The member's rows of `Dim` (of each matrix of an expert stack; elements of a
    /// vector).
    Rows(Dim),
    /// A fused projection whose rows are the parts in order: the member's rows of each.
    Fused(Vec<Dim>),
    /// One matrix per query head (`[.., .., n_head]`): its heads' matrices.
    HeadMatrices,
    /// The member's elements of `Dim` in every row (a bias per expert, `[n, n_expert]`).
    EachRow(Dim),
}

/// A dimension the members of a tensor-parallel group share out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dim {
    /// Query heads, this many rows each.
    QHeads(usize),
    /// Key/value heads, this many rows each.
    KvHeads(usize),
    /// The dense FFN's inner dimension.
    Ff,
    /// Each routed expert's inner dimension.
    FfExp,
    /// The shared experts' inner dimension.
    FfShexp,
    /// The hidden size (outputs of the projections back into the residual stream).
    Embd,
    /// The vocabulary (the output projection).
    Vocab,
}

impl Dim {
    /// Whether this is a share of the attention heads (none for a member without).
    pub fn is_heads(self) -> bool {
        matches!(self, Dim::QHeads(_) | Dim::KvHeads(_))
    }
}

impl Split {
    /// Whether a member without query heads holds none of it.
    pub fn needs_heads(&self) -> bool {
        match self {
            Split::Whole => false,
            Split::WithHeads | Split::HeadMatrices => true,
            Split::Rows(dim) | Split::EachRow(dim) => dim.is_heads(),
            Split::Fused(parts) => parts.iter().any(|d| d.is_heads()),
        }
    }
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
    /// How tensor parallelism cuts it.
    pub split: Split,
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

    fn add(&mut self, tensor: LayerTensor, shape: &[usize], usage: Use, split: Split) -> &mut TensorSpec {
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
            split,
        });
        self.specs.last_mut().expect("just pushed")
    }

    /// A required matrix multiplied by activations.
    pub fn mat(&mut self, tensor: LayerTensor, shape: &[usize], split: Split) -> &mut TensorSpec {
        self.add(tensor, shape, Use::MulMat, split)
    }

    /// A required stack of expert matrices `[k, n, n_expert]`.
    pub fn experts(&mut self, tensor: LayerTensor, shape: &[usize], split: Split) -> &mut TensorSpec {
        self.add(tensor, shape, Use::Experts, split)
    }

    /// A required RMS norm weight of `n` values over the hidden state, which every
    /// tensor-parallel member holds whole.
    pub fn norm(&mut self, tensor: LayerTensor, n: usize) -> &mut TensorSpec {
        self.add(tensor, &[n], Use::Elementwise, Split::Whole)
    }

    /// A required f32 tensor used element-wise (norm weights, biases).
    pub fn vec(&mut self, tensor: LayerTensor, shape: &[usize], split: Split) -> &mut TensorSpec {
        self.add(tensor, shape, Use::Elementwise, split)
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
    let (d_k, d_v) = (hp.head_dim_k, hp.head_dim_v);
    let (q_rows, k_rows, v_rows) = (Dim::QHeads(d_k), Dim::KvHeads(d_k), Dim::KvHeads(d_v));
    let separate_biases = [
        (T::AttnQBias, q, q_rows),
        (T::AttnKBias, k, k_rows),
        (T::AttnVBias, v, v_rows),
    ];
    if t.file_has(T::AttnQkv) {
        let fused = Split::Fused(vec![q_rows, k_rows, v_rows]);
        t.mat(T::AttnQkv, &[embd, q + k + v], fused.clone());
        if t.file_has(T::AttnQkvBias) {
            t.vec(T::AttnQkvBias, &[q + k + v], fused);
        } else {
            for (bias, n, rows) in separate_biases {
                t.vec(bias, &[n], Split::Rows(rows)).optional();
            }
        }
    } else {
        t.mat(T::AttnQ, &[embd, q], Split::Rows(q_rows));
        t.mat(T::AttnK, &[embd, k], Split::Rows(k_rows));
        t.mat(T::AttnV, &[embd, v], Split::Rows(v_rows));
        for (bias, n, rows) in separate_biases {
            t.vec(bias, &[n], Split::Rows(rows)).presence(biases);
        }
    }
    t.mat(
        T::AttnOutput,
        &[hp.head_dim_v * hp.n_head, embd],
        Split::Rows(Dim::Embd),
    );
}

/// The attention of [`Builder::attention_whole_qk_norms`](crate::arch::Builder::attention_whole_qk_norms):
/// separate q, k, v projections (optional biases) and q/k RMS norms over all heads at
/// once (`attn_q_norm` of `d_k × n_head` values, `attn_k_norm` of `d_k × n_head_kv`).
/// A tensor-parallel member computes its query heads' rows (all heads' are gathered
/// before the norm), every key head (the key norm needs them all, and the key
/// projection is the smaller: `n_head_kv` heads), its value heads' rows, and its rows
/// of the output.
pub fn attention_whole_qk_norms(t: &mut LayerPlan<'_>) {
    use LayerTensor as T;
    let hp = t.hp;
    let (embd, d_k, d_v) = (hp.n_embd, hp.head_dim_k, hp.head_dim_v);
    let (q, k, v) = (d_k * hp.n_head, hp.n_embd_k_gqa(), hp.n_embd_v_gqa());
    let (q_rows, v_rows) = (Split::Rows(Dim::QHeads(d_k)), Split::Rows(Dim::KvHeads(d_v)));
    t.mat(T::AttnQ, &[embd, q], q_rows.clone());
    t.mat(T::AttnK, &[embd, k], Split::WithHeads);
    t.mat(T::AttnV, &[embd, v], v_rows.clone());
    t.vec(T::AttnQBias, &[q], q_rows).optional();
    t.vec(T::AttnKBias, &[k], Split::WithHeads).optional();
    t.vec(T::AttnVBias, &[v], v_rows).optional();
    t.vec(T::AttnQNorm, &[q], Split::WithHeads);
    t.vec(T::AttnKNorm, &[k], Split::WithHeads);
    t.mat(T::AttnOutput, &[d_v * hp.n_head, embd], Split::Rows(Dim::Embd));
}

/// Per-head RMS norms of queries and keys (`attn_q_norm`, `attn_k_norm`).
pub fn qk_norms(t: &mut LayerPlan<'_>, presence: Presence) {
    let head = t.hp.head_dim_k;
    qk_norms_of(t, head, presence);
}

/// Per-head RMS norms of queries and keys of heads of `head` values.
pub fn qk_norms_of(t: &mut LayerPlan<'_>, head: usize, presence: Presence) {
    t.vec(LayerTensor::AttnQNorm, &[head], Split::WithHeads)
        .presence(presence);
    t.vec(LayerTensor::AttnKNorm, &[head], Split::WithHeads)
        .presence(presence);
}

/// A gated feed-forward block `ffn` (the dense FFN's or the shared experts' tensors) of
/// inner size `n_ff`, with optional biases where `biases` and the block has them.
pub fn ffn(t: &mut LayerPlan<'_>, ffn: &FfnTensors, n_ff: usize, biases: bool) {
    let embd = t.hp.n_embd;
    let inner = Split::Rows(if ffn.shared_experts { Dim::FfShexp } else { Dim::Ff });
    let outer = Split::Rows(Dim::Embd);
    t.mat(ffn.gate, &[embd, n_ff], inner.clone());
    t.mat(ffn.up, &[embd, n_ff], inner.clone());
    t.mat(ffn.down, &[n_ff, embd], outer.clone());
    if let (true, Some([gate, up, down])) = (biases, ffn.biases) {
        t.vec(gate, &[n_ff], inner.clone()).optional();
        t.vec(up, &[n_ff], inner).optional();
        t.vec(down, &[embd], outer).optional();
    }
}

/// The routed experts of a mixture-of-experts layer: the router `ffn_gate_inp` and the
/// expert stacks `ffn_{gate,up,down}_exps` of inner size `n_ff_exp` (gate and up fused
/// in `ffn_gate_up_exps` when the file has that and the architecture allows it, as
/// llama.cpp's `create_tensor_gate_up_exps` does).
pub fn experts(t: &mut LayerPlan<'_>, n_ff_exp: usize, fused_gate_up: bool) {
    use LayerTensor as T;
    let (embd, n_expert) = (t.hp.n_embd, t.hp.moe.n_expert);
    // The router is whole on every member, so all choose the same experts; each holds
    // its rows of every expert's matrices.
    t.mat(T::FfnGateInp, &[embd, n_expert], Split::Whole);
    let inner = Split::Rows(Dim::FfExp);
    if fused_gate_up && t.file_has(T::FfnGateUpExps) {
        let fused = Split::Fused(vec![Dim::FfExp, Dim::FfExp]);
        t.experts(T::FfnGateUpExps, &[embd, 2 * n_ff_exp, n_expert], fused);
    } else {
        t.experts(T::FfnGateExps, &[embd, n_ff_exp, n_expert], inner.clone());
        t.experts(T::FfnUpExps, &[embd, n_ff_exp, n_expert], inner);
    }
    t.experts(T::FfnDownExps, &[n_ff_exp, embd, n_expert], Split::Rows(Dim::Embd));
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
        // Each member computes the logits of its share of the vocabulary.
        split: match tensor {
            EndTensor::Output => Split::Rows(Dim::Vocab),
            _ => Split::Whole,
        },
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
    if last && hp.kimi_k3.is_some_and(|k3| k3.res_block > 0) {
        specs.push(spec(
            EndTensor::OutputResScore,
            EndTensor::OutputResScore,
            vec![embd],
            Use::Elementwise,
        ));
    }
    if last {
        for (tensor, shape, usage) in crate::arch::hyper::end_tensors(hp) {
            specs.push(spec(tensor, tensor, shape, usage));
        }
    }
    let rope_freqs = match hp.arch.rope_freqs {
        Some(Presence::Required) => true,
        Some(_) => in_file(EndTensor::RopeFreqs.name()),
        None => false,
    };
    if rope_freqs {
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

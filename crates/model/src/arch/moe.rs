//! The mixture-of-experts block every MoE architecture shares, as llama.cpp's
//! `build_moe_ffn` computes it: a router scores the experts of each token (softmax or
//! sigmoid, optionally biased for selection, optionally limited to the best expert
//! groups), the top `k` experts run through `mul_mat_id`, and their outputs are summed
//! with the router's weights (optionally normalised and scaled).

use baton_ggml::Tensor;

use super::builder::{Act, Shard};
use super::Builder;
use crate::hparams::Keys;
use crate::names::{LayerTensor as T, FFN, FFN_SHEXP};
use crate::weights::LayerTensors;
use crate::ModelError;

/// Most experts per layer llama.cpp accepts (`LLAMA_MAX_EXPERTS`).
const MAX_EXPERTS: usize = 1024;

/// How the router turns its logits into expert weights (llama.cpp's
/// `llama_expert_gating_func_type`, whose numbers the GGUF key uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts; the chosen experts' probabilities are the weights.
    Softmax,
    /// Sigmoid of each logit.
    Sigmoid,
    /// Top-k on the raw logits, then softmax over the chosen ones (gpt-oss).
    SoftmaxWeight,
    /// `sqrt(softplus(logit))` of each logit (DeepSeek V4).
    SqrtSoftplus,
}

impl Gating {
    /// The gating named by `expert_gating_func` (`0`: not set).
    pub(super) fn from_id(id: usize) -> Result<Option<Gating>, ModelError> {
        match id {
            0 => Ok(None),
            1 => Ok(Some(Gating::Softmax)),
            2 => Ok(Some(Gating::Sigmoid)),
            3 => Ok(Some(Gating::SoftmaxWeight)),
            4 => Ok(Some(Gating::SqrtSoftplus)),
            other => Err(ModelError::BadHParams(format!(
                "expert_gating_func {other} is not supported (1 softmax, 2 sigmoid, 3 softmax of the \
                 chosen, 4 square root of softplus)"
            ))),
        }
    }
}

/// Routing hyper-parameters (all zero for a dense model).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeParams {
    /// Routed experts per MoE layer.
    pub n_expert: usize,
    /// Experts each token uses.
    pub n_expert_used: usize,
    /// Inner size of each expert.
    pub n_ff_exp: usize,
    /// Shared experts (one FFN of `n_ff_exp * n_expert_shared` every token runs).
    pub n_expert_shared: usize,
    /// Width of the shared expert where an architecture reads it on its own
    /// (qwen35moe's `expert_shared_feed_forward_length`); 0 elsewhere.
    pub n_ff_shexp: usize,
    /// Leading layers with a dense FFN instead of experts.
    pub n_layer_dense_lead: usize,
    /// Experts in every `layer_step`-th layer only, the others dense (Llama 4's
    /// `interleave_moe_layer_step`; 1: every layer after the dense lead; 0: none).
    pub layer_step: usize,
    /// Expert groups (DeepSeek V3): only the best `n_group_used` groups are chosen from.
    pub n_group: usize,
    /// Groups a token may choose experts from.
    pub n_group_used: usize,
    /// Router weights are divided by their sum.
    pub weights_norm: bool,
    /// Router weights are multiplied by this (0 and 1: not).
    pub weights_scale: f32,
    /// How the router scores experts.
    pub gating: Gating,
    /// SwiGLU clamps per layer, where an architecture reads them into its shared
    /// FFN (GLM-5 next, DeepSeek V4); `None`: plain SwiGLU.
    pub swiglu_clamps: Option<SwigluClamps>,
}

/// llama.cpp's `swiglu_clamp_exp` and `swiglu_clamp_shexp`: per layer, the limit of the
/// routed experts' SwiGLU and of the other FFNs' (shared experts, dense layers); 1e-6
/// or less: plain SwiGLU.
#[derive(Clone, Debug, PartialEq)]
pub struct SwigluClamps {
    /// The routed experts' limit of each layer.
    pub exp: Vec<f32>,
    /// The shared experts' and dense FFNs' limit of each layer.
    pub shexp: Vec<f32>,
}

impl SwigluClamps {
    /// `swiglu_clamp_exp` and `swiglu_clamp_shexp` of `n` layers, as llama.cpp reads
    /// them: the shared experts' default to the routed experts', a missing one is plain
    /// SwiGLU; `None` when the file has neither.
    pub fn read(keys: &Keys<'_>, n: usize) -> Result<Option<SwigluClamps>, ModelError> {
        let exp = keys.opt_per_layer_f32("swiglu_clamp_exp", n)?;
        let shexp = keys.opt_per_layer_f32("swiglu_clamp_shexp", n)?.or(exp.clone());
        if exp.is_none() && shexp.is_none() {
            return Ok(None);
        }
        let plain = || vec![0.0; n];
        Ok(Some(SwigluClamps {
            exp: exp.unwrap_or_else(plain),
            shexp: shexp.unwrap_or_else(plain),
        }))
    }
}

impl MoeParams {
    /// The keys every architecture may have (`expert_count`, `expert_used_count`,
    /// `expert_group_count`, `expert_group_used_count`), checked as llama.cpp checks
    /// them; the rest is each architecture's to read.
    pub fn read(keys: &Keys<'_>, n_layer_all: usize) -> Result<MoeParams, ModelError> {
        let n_expert = keys.opt_u32("expert_count")?.unwrap_or(0);
        let n_expert_used = keys.opt_uniform_u32("expert_used_count", n_layer_all)?.unwrap_or(0);
        let n_group = keys.opt_u32("expert_group_count")?.unwrap_or(0);
        let n_group_used = keys.opt_u32("expert_group_used_count")?.unwrap_or(0);
        let bad = |why: String| Err(ModelError::BadHParams(why));
        if n_expert == 0 && (n_expert_used > 0 || n_group > 0) {
            return bad(format!(
                "expert_used_count {n_expert_used} but the model has no experts (expert_count 0)"
            ));
        }
        if n_expert > MAX_EXPERTS || n_expert_used > n_expert {
            return bad(format!(
                "{n_expert_used} of {n_expert} experts used per token (at most {MAX_EXPERTS} experts)"
            ));
        }
        if n_expert > 0 {
            if n_expert_used == 0 {
                return bad(format!("{n_expert} experts but none used per token"));
            }
            if n_group >= n_expert {
                return bad(format!("{n_group} expert groups for {n_expert} experts"));
            }
            if n_group > 1 && (!n_expert.is_multiple_of(n_group) || n_group_used == 0 || n_group_used >= n_group) {
                return bad(format!(
                    "{n_expert} experts in {n_group} groups, {n_group_used} groups used: \
                     groups must divide the experts and 0 < used < groups"
                ));
            }
        }
        Ok(MoeParams {
            n_expert,
            n_expert_used,
            n_ff_exp: 0,
            n_expert_shared: 0,
            n_ff_shexp: 0,
            n_layer_dense_lead: 0,
            layer_step: 1,
            n_group,
            n_group_used,
            weights_norm: false,
            weights_scale: 0.0,
            gating: Gating::Softmax,
            swiglu_clamps: None,
        })
    }

    /// Reads `expert_feed_forward_length` (required when `required`, else defaulting to
    /// `n_ff / n_expert_used` as llama.cpp does).
    pub fn read_ff_exp(
        &mut self,
        keys: &Keys<'_>,
        n_layer_all: usize,
        n_ff: usize,
        required: bool,
    ) -> Result<(), ModelError> {
        self.n_ff_exp = match keys.opt_uniform_u32("expert_feed_forward_length", n_layer_all)? {
            Some(n) if n > 0 => n,
            None if required => return Err(keys.missing("expert_feed_forward_length")),
            _ => n_ff / self.n_expert_used.max(1),
        };
        Ok(())
    }

    /// Reads the DeepSeek-style routing keys: shared experts, dense leading layers,
    /// weight normalisation and scale, and the gating function (`default` when unset).
    pub fn read_routing(&mut self, keys: &Keys<'_>, shared_required: bool, default: Gating) -> Result<(), ModelError> {
        self.n_expert_shared = match keys.opt_u32("expert_shared_count")? {
            Some(n) => n,
            None if shared_required => return Err(keys.missing("expert_shared_count")),
            None => 0,
        };
        self.n_layer_dense_lead = keys.opt_u32("leading_dense_block_count")?.unwrap_or(0);
        self.weights_scale = keys.opt_f32("expert_weights_scale")?.unwrap_or(0.0);
        self.weights_norm = keys.opt_bool("expert_weights_norm")?.unwrap_or(false);
        let id = keys.opt_u32("expert_gating_func")?.unwrap_or(0);
        self.gating = Gating::from_id(id)?.unwrap_or(default);
        Ok(())
    }

    /// Checks that the experts are usable: at least one, and an inner size.
    pub fn require_experts(&self, arch: &str) -> Result<(), ModelError> {
        if self.n_expert == 0 || self.n_expert_used == 0 || self.n_ff_exp == 0 {
            return Err(ModelError::BadHParams(format!(
                "{arch} needs experts: expert_count {}, expert_used_count {}, expert size {}",
                self.n_expert, self.n_expert_used, self.n_ff_exp
            )));
        }
        Ok(())
    }
}

/// gpt-oss's clamped SwiGLU: its sigmoid's slope and the bound of its inputs (as
/// llama.cpp fixes them).
pub(super) const OAI_ALPHA: f32 = 1.702;
pub(super) const OAI_LIMIT: f32 = 7.0;

/// The activation of each expert.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertAct {
    /// `silu(gate) * up`.
    Silu,
    /// gpt-oss's clamped SwiGLU (`ggml_swiglu_oai`, alpha 1.702, limit 7).
    SwigluOai,
    /// `relu(up)²`: no gate (Nemotron-H).
    ReluSqr,
    /// `gelu(gate) * up` (Gemma 4).
    Gelu,
    /// Kimi K3's situ (see [`super::builder::situ`]).
    Situ { beta: f32, linear_beta: f32 },
    /// `silu(min(gate, limit)) · clamp(up, ±limit)` when `limit` is over 1e-6, else
    /// plain SwiGLU (DeepSeek V4's `swiglu_clamp_exp`).
    SiluClamp { limit: f32 },
}

/// What a device backend may convert the experts' down-projection input (the activated
/// rows) to before multiplying; the CPU backend converts as its kernels need either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownInput {
    /// Whatever the backend picks (e.g. f16).
    Backend,
    /// Kept in f32 (llama.cpp for Mistral 4, whose activations there can exceed f16).
    F32,
}

/// Where a token's router weights apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Weighing {
    /// To each chosen expert's output (llama.cpp's usual way).
    Outputs,
    /// To each chosen expert's input, the experts chosen by the raw logits (Llama 4).
    Inputs,
}

/// How one architecture routes (the parts not in the GGUF).
#[derive(Clone, Copy, Debug)]
pub struct Routing {
    /// How router logits become weights.
    pub gating: Gating,
    /// Whether the chosen weights are divided by their sum.
    pub norm_weights: bool,
    /// Multiplier of the chosen weights (0 or 1: none).
    pub scale: f32,
    /// The experts' activation.
    pub act: ExpertAct,
    /// What the down projection's input may become on a device backend.
    pub down_input: DownInput,
}

impl<'g> Builder<'g> {
    /// The FFN of a DeepSeek-style layer, `x` `[n_embd, n_tokens]` in and out: on a
    /// layer with experts, the routed experts (chosen as `routing` says) plus the shared
    /// experts, with activation `act`; on a dense leading layer the dense FFN.
    pub fn routed_and_shared(
        &mut self,
        w: &LayerTensors<'g>,
        layer: usize,
        x: Tensor<'g>,
        routing: Routing,
        act: Act,
    ) -> Tensor<'g> {
        if !self.hp.is_moe(layer) {
            return self.ffn(w, &FFN, act, x);
        }
        let routed = self.moe(w, layer, x, routing);
        let shared = self.ffn(w, &FFN_SHEXP, act, x);
        self.ctx.add(routed, shared)
    }

    /// The routed experts of layer `layer` for `x [n_embd, n_tokens]`; returns the
    /// weighted sum of each token's experts, `[n_embd, n_tokens]`.
    pub fn moe(&mut self, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>, routing: Routing) -> Tensor<'g> {
        let logits = self.router_logits(w, x);
        self.routed_experts(w, layer, x, logits, routing, Weighing::Outputs, None)
    }

    /// [`moe`](Self::moe) with each token's experts chosen already, `chosen` i32
    /// `[n_used, n_tokens]` (DeepSeek V4's hash-routed layers): the router only weighs
    /// them.
    pub fn moe_chosen(
        &mut self,
        w: &LayerTensors<'g>,
        layer: usize,
        x: Tensor<'g>,
        chosen: Tensor<'g>,
        routing: Routing,
    ) -> Tensor<'g> {
        let logits = self.router_logits(w, x);
        self.routed_experts(w, layer, x, logits, routing, Weighing::Outputs, Some(chosen))
    }

    /// [`moe`](Self::moe) with router logits `[n_expert, n_tokens]` the architecture
    /// computed itself (Gemma 4 routes by another input than the experts').
    pub fn moe_with_logits(
        &mut self,
        w: &LayerTensors<'g>,
        layer: usize,
        x: Tensor<'g>,
        logits: Tensor<'g>,
        routing: Routing,
    ) -> Tensor<'g> {
        self.routed_experts(w, layer, x, logits, routing, Weighing::Outputs, None)
    }

    /// The router's logits of `x [n_embd, n_tokens]`: `[n_expert, n_tokens]`.
    /// llama.cpp's quantizer leaves the router in f32 (see `Builder::mm`).
    pub fn router_logits(&self, w: &LayerTensors<'g>, x: Tensor<'g>) -> Tensor<'g> {
        self.mm(w.get(T::FfnGateInp), x)
    }

    /// Llama 4's routed experts (llama.cpp's `weight_before_ffn`): the top `k` experts
    /// are chosen by the router's raw logits, and each runs on the token already
    /// multiplied by its weight (the sigmoid of its logit); their outputs are summed
    /// as they are. `x`: `[n_embd, n_tokens]` in and out.
    pub fn moe_weighted_inputs(&mut self, w: &LayerTensors<'g>, layer: usize, x: Tensor<'g>) -> Tensor<'g> {
        let routing = Routing {
            gating: Gating::Sigmoid,
            norm_weights: false,
            scale: 0.0,
            act: ExpertAct::Silu,
            down_input: DownInput::Backend,
        };
        let logits = self.router_logits(w, x);
        self.routed_experts(w, layer, x, logits, routing, Weighing::Inputs, None)
    }

    #[allow(clippy::too_many_arguments)]
    fn routed_experts(
        &mut self,
        w: &LayerTensors<'g>,
        layer: usize,
        x: Tensor<'g>,
        mut logits: Tensor<'g>,
        routing: Routing,
        weighing: Weighing,
        chosen: Option<Tensor<'g>>,
    ) -> Tensor<'g> {
        let ctx = self.ctx;
        let moe = &self.hp.moe;
        let (n_embd, n_tokens) = (x.ne()[0], x.ne()[1]);
        let (n_expert, n_used) = (moe.n_expert as i64, moe.n_expert_used as i64);
        let named = |t: Tensor<'g>, name: &str| t.named(&format!("{name}-{layer}"));

        if let Some(b) = w.opt(T::FfnGateInpBias) {
            logits = ctx.add(logits, b);
        }
        let probs = match routing.gating {
            Gating::Softmax => ctx.soft_max(logits),
            Gating::Sigmoid => ctx.sigmoid(logits),
            Gating::SoftmaxWeight => logits,
            Gating::SqrtSoftplus => ctx.sqrt(ctx.softplus(logits.prec_f32())),
        };
        let probs = named(probs, "ffn_moe_probs"); // [n_expert, n_tokens]

        // The selection bias (DeepSeek V3) only chooses; the weights stay unbiased.
        let mut selection = match (weighing, w.opt(T::ExpProbsBias)) {
            // Llama 4 chooses by the logits; the sigmoid only weighs the chosen.
            (Weighing::Inputs, _) => logits,
            (Weighing::Outputs, Some(b)) => ctx.add(probs, b),
            (Weighing::Outputs, None) => probs,
        };
        if moe.n_group > 1 && n_tokens > 0 {
            selection = self.best_groups(selection, n_expert, n_tokens);
        }
        let selected = match chosen {
            Some(chosen) => chosen,
            None => ctx.argsort_top_k(selection, moe.n_expert_used),
        };
        let selected = named(selected, "ffn_moe_topk"); // [n_used, n_tokens]

        let probs3 = ctx.reshape_3d(probs, 1, n_expert, n_tokens);
        let mut weights = ctx.get_rows(probs3, selected); // [1, n_used, n_tokens]
        if routing.gating == Gating::SoftmaxWeight {
            let flat = ctx.reshape_2d(weights, n_used, n_tokens);
            weights = ctx.reshape_3d(ctx.soft_max(flat), 1, n_used, n_tokens);
        }
        if routing.norm_weights {
            let flat = ctx.reshape_2d(weights, n_used, n_tokens);
            // Clamped to the smallest normal f16, as llama.cpp does against division by 0.
            let sum = ctx.clamp(ctx.sum_rows(flat), 6.103_515_6e-5, f32::INFINITY); // [1, n_tokens]
            weights = ctx.reshape_3d(ctx.div(flat, sum), 1, n_used, n_tokens);
        }
        if routing.scale != 0.0 && routing.scale != 1.0 {
            weights = ctx.scale(weights, routing.scale);
        }
        let weights = named(weights, "ffn_moe_weights");
        self.graph.expand(weights);

        let mut x3 = ctx.reshape_3d(x, n_embd, 1, n_tokens);
        if weighing == Weighing::Inputs {
            let repeated = ctx.repeat_4d(x3, [n_embd, n_used, n_tokens, 1]);
            x3 = named(ctx.mul(repeated, weights), "ffn_moe_weighted"); // [n_embd, n_used, n_tokens]
        }
        let biased = |out: Tensor<'g>, bias: T| match w.opt(bias) {
            Some(b) => ctx.add_id(out, b, selected),
            None => out,
        };
        let experts = |weight: T, bias: T, input: Tensor<'g>| biased(self.mm_id(w.get(weight), input, selected), bias);
        let gated = |act: &dyn Fn(Tensor<'g>, Tensor<'g>) -> Tensor<'g>| match w.opt(T::FfnGateUpExps) {
            Some(gate_up_w) => {
                let gate_up = self.mm_id(gate_up_w, x3, selected); // [2 n_ff, n_used, n_tokens]
                let n_ff = gate_up.ne()[0] / 2;
                let [_, ne1, ne2, _] = gate_up.ne();
                let [nb0, nb1, nb2, _] = gate_up.nb();
                let gate = ctx.view_3d(gate_up, [n_ff, ne1, ne2], nb1, nb2, 0);
                let up = ctx.view_3d(gate_up, [n_ff, ne1, ne2], nb1, nb2, n_ff as usize * nb0);
                act(gate, up)
            }
            None => {
                let up = experts(T::FfnUpExps, T::FfnUpExpsBias, x3); // [n_ff, n_used, n_tokens]
                act(experts(T::FfnGateExps, T::FfnGateExpsBias, x3), up)
            }
        };
        let hidden = match routing.act {
            ExpertAct::Silu => gated(&|gate, up| ctx.swiglu_split(gate, up)),
            ExpertAct::SwigluOai => gated(&|gate, up| ctx.swiglu_oai(gate, up, OAI_ALPHA, OAI_LIMIT)),
            ExpertAct::ReluSqr => ctx.sqr(ctx.relu(experts(T::FfnUpExps, T::FfnUpExpsBias, x3))),
            ExpertAct::Gelu => gated(&|gate, up| ctx.geglu_split(gate, up)),
            ExpertAct::Situ { beta, linear_beta } => {
                gated(&|gate, up| super::builder::situ(ctx, gate, up, beta, linear_beta))
            }
            ExpertAct::SiluClamp { limit } => gated(&|gate, up| super::builder::swiglu_clamped(ctx, gate, up, limit)),
        }; // [n_ff, n_used, n_tokens]; a tensor-parallel member's share of n_ff
        let hidden = if self.tp.is_some() {
            let [n_ff, _, _, _] = hidden.ne();
            let rows = ctx.reshape_2d(hidden, n_ff, n_used * n_tokens);
            let joined = self.gather(rows, Shard::FfExp);
            ctx.reshape_3d(joined, joined.ne()[0], n_used, n_tokens)
        } else {
            hidden
        };
        let down = self.mm_id(w.get(T::FfnDownExps), hidden, selected); // [n_embd, n_used, n_tokens] (a member: its rows)
        let down = match routing.down_input {
            DownInput::Backend => down,
            DownInput::F32 => down.prec_f32_input(),
        };
        // Each chosen expert's output scale, where the layer has them (Gemma 4).
        let down = match w.opt(T::FfnDownExpsScale) {
            Some(scales) => {
                let scales = ctx.reshape_3d(scales, 1, n_expert, 1);
                let scales = ctx.repeat_4d(scales, [1, n_expert, n_tokens, 1]);
                ctx.mul(down, ctx.get_rows(scales, selected)) // [n_embd, n_used, n_tokens]
            }
            None => down,
        };
        let out = biased(named(down, "ffn_moe_down"), T::FfnDownExpsBias);
        let out = match weighing {
            Weighing::Outputs => ctx.mul(out, weights),
            Weighing::Inputs => out,
        };
        self.graph.expand(out);

        // Sum the experts' rows in order, each a view `[n_embd, n_tokens]`; element-wise,
        // so a member's rows sum as they would in the whole.
        let n_rows = out.ne()[0];
        let views: Vec<Tensor<'g>> = (0..n_used as usize)
            .map(|i| {
                let view = ctx.view_2d(out, n_rows, n_tokens, out.nb()[2], i * out.nb()[1]);
                self.graph.expand(view);
                view
            })
            .collect();
        let mut sum = views[0];
        for &view in &views[1..] {
            sum = ctx.add(sum, view);
            self.graph.expand(sum);
        }
        if views.len() == 1 {
            sum = ctx.cont(sum);
        }
        let sum = self.gather(sum, Shard::Embd);
        named(sum, "ffn_moe_out")
    }

    /// Group-limited routing (DeepSeek V3): each group of experts scores the sum of its
    /// two best; experts outside the `n_group_used` best groups get `-inf`.
    fn best_groups(&self, selection: Tensor<'g>, n_expert: i64, n_tokens: i64) -> Tensor<'g> {
        let ctx = self.ctx;
        let n_group = self.hp.moe.n_group as i64;
        let per_group = n_expert / n_group;
        let groups = ctx.reshape_3d(selection, per_group, n_group, n_tokens); // [per_group, n_group, n_tokens]
        let top2 = ctx.argsort_top_k(groups, 2); // [2, n_group, n_tokens]
        let scores = ctx.get_rows(ctx.reshape_4d(groups, [1, per_group, n_group, n_tokens]), top2); // [1, 2, n_group, n_tokens]
        let scores = ctx.sum_rows(ctx.reshape_3d(scores, 2, n_group, n_tokens)); // [1, n_group, n_tokens]
        let scores = ctx.reshape_2d(scores, n_group, n_tokens);
        let best = ctx.argsort_top_k(scores, self.hp.moe.n_group_used); // [n_group_used, n_tokens]
        let kept = ctx.get_rows(groups, best); // [per_group, n_group_used, n_tokens]
        let masked = ctx.set_rows(ctx.fill(groups, f32::NEG_INFINITY), kept, best);
        ctx.reshape_2d(masked, n_expert, n_tokens)
    }
}

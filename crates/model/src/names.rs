//! The names of the tensors baton reads, each GGUF name written once: architectures
//! list and use tensors by these values (`LayerTensor::AttnQ`), so a misspelt tensor
//! does not compile, and one the file lacks is refused at load with its GGUF name.
//! Like llama.cpp's `llm_tensor` and its `LLM_TENSOR_NAMES` table.

use std::fmt;

/// Declares a tensor-name enum: each variant with its GGUF name, a table of all of
/// them, and `name()` (the only place each string is written).
macro_rules! tensor_names {
    (
        $(#[$meta:meta])*
        pub enum $name:ident ($prefix:literal) {
            $($variant:ident = $gguf:literal,)*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $(
                #[doc = concat!("`", $prefix, $gguf, "`")]
                $variant,
            )*
        }

        impl $name {
            /// Every one, in declaration order (`ALL[t as usize] == t`).
            pub const ALL: &'static [$name] = &[$($name::$variant,)*];

            /// Its GGUF name (within its layer, for a layer tensor).
            pub const fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $gguf,)*
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

tensor_names! {
    /// A tensor of one layer, named `blk.{layer}.{name}` in the file.
    pub enum LayerTensor ("blk.N.") {
        AttnNorm = "attn_norm.weight",
        AttnQ = "attn_q.weight",
        AttnK = "attn_k.weight",
        AttnV = "attn_v.weight",
        AttnQkv = "attn_qkv.weight",
        AttnQBias = "attn_q.bias",
        AttnKBias = "attn_k.bias",
        AttnVBias = "attn_v.bias",
        AttnQkvBias = "attn_qkv.bias",
        AttnQNorm = "attn_q_norm.weight",
        AttnKNorm = "attn_k_norm.weight",
        AttnSinks = "attn_sinks.weight",
        AttnOutput = "attn_output.weight",
        AttnOutputBias = "attn_output.bias",
        // Multi-head latent attention (deepseek2).
        AttnQA = "attn_q_a.weight",
        AttnQANorm = "attn_q_a_norm.weight",
        AttnQB = "attn_q_b.weight",
        AttnKvAMqa = "attn_kv_a_mqa.weight",
        AttnKvANorm = "attn_kv_a_norm.weight",
        AttnKB = "attn_k_b.weight",
        AttnVB = "attn_v_b.weight",
        // DeepSeek sparse attention's lightning indexer (deepseek32, glm-dsa): its query
        // and key projections, the keys' layer norm, the per-head weights.
        IndexerAttnQB = "indexer.attn_q_b.weight",
        IndexerAttnK = "indexer.attn_k.weight",
        IndexerKNorm = "indexer.k_norm.weight",
        IndexerKNormBias = "indexer.k_norm.bias",
        IndexerProj = "indexer.proj.weight",
        // MiniMax sparse attention's indexer (minimax-m3): query and key projections and
        // their per-head RMS norms (the key's is `IndexerKNorm`).
        IndexerQProj = "indexer.q_proj.weight",
        IndexerKProj = "indexer.k_proj.weight",
        IndexerQNorm = "indexer.q_norm.weight",
        PostAttentionNorm = "post_attention_norm.weight",
        FfnNorm = "ffn_norm.weight",
        PostFfwNorm = "post_ffw_norm.weight",
        // One factor scaling the layer's output (Gemma 4).
        LayerOutputScale = "layer_output_scale.weight",
        // Gemma 4's experts beside its dense MLP: the norms around each, the router
        // input's scale and each expert's output scale.
        PostFfwNorm1 = "post_ffw_norm_1.weight",
        FfnPreNorm2 = "pre_ffw_norm_2.weight",
        PostFfwNorm2 = "post_ffw_norm_2.weight",
        FfnGateInpScale = "ffn_gate_inp.scale",
        FfnDownExpsScale = "ffn_down_exps.scale",
        FfnGate = "ffn_gate.weight",
        FfnUp = "ffn_up.weight",
        FfnDown = "ffn_down.weight",
        FfnGateBias = "ffn_gate.bias",
        FfnUpBias = "ffn_up.bias",
        FfnDownBias = "ffn_down.bias",
        // Routed experts: the router, its selection bias, the expert stacks.
        FfnGateInp = "ffn_gate_inp.weight",
        FfnGateInpBias = "ffn_gate_inp.bias",
        ExpProbsBias = "exp_probs_b.bias",
        FfnGateExps = "ffn_gate_exps.weight",
        FfnUpExps = "ffn_up_exps.weight",
        FfnGateUpExps = "ffn_gate_up_exps.weight",
        FfnDownExps = "ffn_down_exps.weight",
        FfnGateExpsBias = "ffn_gate_exps.bias",
        FfnUpExpsBias = "ffn_up_exps.bias",
        FfnDownExpsBias = "ffn_down_exps.bias",
        // Shared experts: one dense FFN every token runs.
        FfnGateShexp = "ffn_gate_shexp.weight",
        FfnUpShexp = "ffn_up_shexp.weight",
        FfnDownShexp = "ffn_down_shexp.weight",
        // The sigmoid gate of the shared experts' output (qwen35moe).
        FfnGateInpShexp = "ffn_gate_inp_shexp.weight",
        // The output gate of gated attention and DeltaNet layers (qwen35).
        AttnGate = "attn_gate.weight",
        // Gated DeltaNet layers: convolution, decay, write strength, norm, output.
        SsmConv1d = "ssm_conv1d.weight",
        SsmDt = "ssm_dt.bias",
        SsmA = "ssm_a",
        SsmBeta = "ssm_beta.weight",
        SsmAlpha = "ssm_alpha.weight",
        SsmBa = "ssm_ba.weight",
        SsmNorm = "ssm_norm.weight",
        SsmOut = "ssm_out.weight",
        // Mamba2 layers (nemotron_h): the fused input projection, the convolution's
        // bias, the skip connection's per-head factor.
        SsmIn = "ssm_in.weight",
        SsmConv1dBias = "ssm_conv1d.bias",
        SsmD = "ssm_d",
        // Kimi Delta Attention layers (kimi-linear): a convolution each for queries, keys
        // and values, the low-rank projections of the per-dimension decay (f) and of the
        // output gate (g).
        SsmConv1dQ = "ssm_conv1d_q.weight",
        SsmConv1dK = "ssm_conv1d_k.weight",
        SsmConv1dV = "ssm_conv1d_v.weight",
        SsmFA = "ssm_f_a.weight",
        SsmFB = "ssm_f_b.weight",
        SsmGA = "ssm_g_a.weight",
        SsmGB = "ssm_g_b.weight",
        // Kimi K3: the KDA output gate at full rank, the cross-layer residual
        // attention's scores, the routed experts' latent projections and norm.
        SsmG = "ssm_g.weight",
        AttnResScore = "attn_res_score.weight",
        FfnResScore = "ffn_res_score.weight",
        FfnRoutedDown = "ffn_routed_down.weight",
        FfnRoutedUp = "ffn_routed_up.weight",
        FfnRoutedNorm = "ffn_routed_norm.weight",
        // Hyper-connections (deepseek4, glm5-next): each block's stream scores, their
        // bias and scales.
        HcAttnFn = "hc_attn_fn.weight",
        HcAttnBase = "hc_attn_base.weight",
        HcAttnScale = "hc_attn_scale.weight",
        HcFfnFn = "hc_ffn_fn.weight",
        HcFfnBase = "hc_ffn_base.weight",
        HcFfnScale = "hc_ffn_scale.weight",
        // DeepSeek V4: the one key-and-value projection, the grouped low-rank output
        // projection, the hash-routed layers' expert ids by token.
        AttnKv = "attn_kv.weight",
        AttnOutputA = "attn_output_a.weight",
        AttnOutputB = "attn_output_b.weight",
        FfnGateTid2eid = "ffn_gate_tid2eid.weight",
        // DeepSeek V4's vision variant: the selection bias of image tokens' routing.
        ExpProbsBiasVl = "exp_probs_b_vl.bias",
        // DeepSeek V4's key compressors (attention's and the lightning indexer's) and
        // multi-token-prediction block, which only its example files hold (baton
        // refuses compressed layers and skips the prediction layers). GLM-5 next's
        // k-pool indexer has the indexer's gate and bias: the projection of the gate
        // scores its blocks pool keys by, and the bias of each slot of a block.
        AttnCompressorKv = "attn_compressor_kv.weight",
        AttnCompressorGate = "attn_compressor_gate.weight",
        AttnCompressorApe = "attn_compressor_ape.weight",
        AttnCompressorNorm = "attn_compressor_norm.weight",
        IndexerCompressorKv = "indexer_compressor_kv.weight",
        IndexerCompressorGate = "indexer_compressor_gate.weight",
        IndexerCompressorApe = "indexer_compressor_ape.weight",
        IndexerCompressorNorm = "indexer_compressor_norm.weight",
        NextnEhProj = "nextn.eh_proj.weight",
        NextnEnorm = "nextn.enorm.weight",
        NextnHnorm = "nextn.hnorm.weight",
    }
}

tensor_names! {
    /// A tensor of the model's ends (and globals): the token embedding, the output norm
    /// and projection, RoPE frequency factors.
    pub enum EndTensor ("") {
        TokenEmbd = "token_embd.weight",
        OutputNorm = "output_norm.weight",
        Output = "output.weight",
        RopeFreqs = "rope_freqs.weight",
        // Kimi K3: the cross-layer residual attention's scores before the output norm.
        OutputResScore = "output_res_score.weight",
        // DeepSeek V4's hyper-connections: the output's stream scores, bias and scale.
        OutputHcFn = "output_hc_fn.weight",
        OutputHcBase = "output_hc_base.weight",
        OutputHcScale = "output_hc_scale.weight",
    }
}

impl LayerTensor {
    /// Its name in the file for layer `layer`: `blk.{layer}.{name}`.
    pub fn in_layer(self, layer: usize) -> String {
        format!("blk.{layer}.{}", self.name())
    }
}

/// The tensors of a gated feed-forward block: the dense FFN's or the shared experts'.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FfnTensors {
    pub gate: LayerTensor,
    pub up: LayerTensor,
    pub down: LayerTensor,
    /// Biases of gate, up and down, for blocks that may have them.
    pub biases: Option<[LayerTensor; 3]>,
    /// Whether these are the shared experts (which tensor parallelism cuts by their own
    /// width).
    pub shared_experts: bool,
}

/// The dense FFN: `ffn_{gate,up,down}`, biases optional.
pub const FFN: FfnTensors = FfnTensors {
    gate: LayerTensor::FfnGate,
    up: LayerTensor::FfnUp,
    down: LayerTensor::FfnDown,
    biases: Some([
        LayerTensor::FfnGateBias,
        LayerTensor::FfnUpBias,
        LayerTensor::FfnDownBias,
    ]),
    shared_experts: false,
};

/// The shared experts: `ffn_{gate,up,down}_shexp`, no biases.
pub const FFN_SHEXP: FfnTensors = FfnTensors {
    gate: LayerTensor::FfnGateShexp,
    up: LayerTensor::FfnUpShexp,
    down: LayerTensor::FfnDownShexp,
    biases: None,
    shared_experts: true,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_written_once_and_tables_are_in_order() {
        let mut names: Vec<&str> = LayerTensor::ALL.iter().map(|t| t.name()).collect();
        names.extend(EndTensor::ALL.iter().map(|t| t.name()));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a GGUF name is used twice");
        for (i, t) in LayerTensor::ALL.iter().enumerate() {
            assert_eq!(*t as usize, i);
        }
        assert_eq!(LayerTensor::AttnQ.in_layer(3), "blk.3.attn_q.weight");
    }
}

//! Tensor parallelism or a pipeline, for one stream: a pure function of the model's
//! compute time per token, the group size and the measured link.
//!
//! The model (docs/tensor-parallel.md):
//! - a pipeline of `n` nodes passes a token through every stage in turn: one node's
//!   compute for the whole model plus `n` hops of one hidden row around the ring:
//!   `t_pp = c + n × (ℓ + e / β)`;
//! - a tensor-parallel group of `n` splits every layer: each member computes `1/n` of
//!   it (at efficiency `η` ≤ 1, what the slices lose to smaller matmuls and the graph's
//!   extra nodes), and the members exchange their slices four times per layer (attention
//!   heads, attention output, FFN activations, FFN output: `W = 3 n_embd + n_ff` values
//!   gathered per layer), each sending its `W / n` to the `n − 1` others at once
//!   (latency-first: one link latency per exchange, the sends serialised on its link):
//!   `t_tp = c / (n η) + L (4 ℓ + (n − 1) (4 W / n) / β)`.
//!
//! `c`: compute seconds per token of the whole model on one node; `ℓ`: one-way link
//! latency; `β`: bytes per second; `e`: bytes of one hidden row (`4 × n_embd`); `L`:
//! layers. TP pays while `4 L ℓ` is small next to `c (1 − 1/(n η))`.

/// What the planner knows for the choice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TpInputs {
    /// Seconds one node takes per token for the whole model (decode, one stream).
    pub secs_per_token: f64,
    /// Layers of the model.
    pub n_layer: usize,
    /// Hidden size (values per row).
    pub n_embd: usize,
    /// Inner size of the FFN.
    pub n_ff: usize,
    /// Nodes available (the group size TP would use, the stage count PP would use).
    pub n_nodes: usize,
    /// One-way link latency between nodes, seconds.
    pub latency: f64,
    /// Link bandwidth, bytes per second.
    pub bandwidth: f64,
    /// Fraction of ideal speed-up a member keeps (measured: see the docs).
    pub efficiency: f64,
}

/// Which way to use the nodes, and the modelled seconds per token of both.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TpChoice {
    /// Whether tensor parallelism is modelled faster than the pipeline.
    pub tp: bool,
    /// Modelled seconds per token with a TP group of all nodes.
    pub tp_secs: f64,
    /// Modelled seconds per token with a pipeline over all nodes.
    pub pp_secs: f64,
}

/// The choice for one stream (see the module docs for the model). One node, or no
/// usable measurements, is always the pipeline (which is then a single stage).
pub fn choose(inputs: &TpInputs) -> TpChoice {
    let TpInputs {
        secs_per_token: c,
        n_layer,
        n_embd,
        n_ff,
        n_nodes,
        latency,
        bandwidth,
        efficiency,
    } = *inputs;
    let n = n_nodes.max(1) as f64;
    let row = 4.0 * n_embd as f64;
    let per_byte = if bandwidth > 0.0 {
        1.0 / bandwidth
    } else {
        f64::INFINITY
    };
    let pp_secs = c + n * (latency + row * per_byte);
    let gathered = 4.0 * (3 * n_embd + n_ff) as f64;
    let tp_secs =
        c / (n * efficiency.clamp(1e-3, 1.0)) + n_layer as f64 * (4.0 * latency + (n - 1.0) * gathered / n * per_byte);
    let usable = n_nodes > 1 && c.is_finite() && c > 0.0 && tp_secs.is_finite();
    TpChoice {
        tp: usable && tp_secs < pp_secs,
        tp_secs,
        pp_secs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen2_05b(latency: f64, bandwidth: f64) -> TpInputs {
        // 2 nodes of 1 thread each: 34 ms per token alone (29 tok/s, measured).
        TpInputs {
            secs_per_token: 0.034,
            n_layer: 24,
            n_embd: 896,
            n_ff: 4864,
            n_nodes: 2,
            latency,
            bandwidth,
            efficiency: 0.9,
        }
    }

    #[test]
    fn tp_pays_on_fast_links_only() {
        // (one-way latency s, bandwidth B/s, TP chosen)
        let table = [
            (20e-6, 2e9, true),     // loopback
            (100e-6, 117e6, true),  // gigabit LAN, barely: 31.6 ms against 34.3
            (150e-6, 117e6, false), // 96 exchanges × 0.15 ms eat the gain
            (2e-3, 5e6, false),     // wifi
            (15e-3, 15e6, false),   // the 30 ms RTT profile
        ];
        for (latency, bandwidth, tp) in table {
            let choice = choose(&qwen2_05b(latency, bandwidth));
            assert_eq!(choice.tp, tp, "latency {latency} bandwidth {bandwidth}: {choice:?}");
        }
    }

    #[test]
    fn one_node_or_no_measurement_is_a_pipeline() {
        let mut one = qwen2_05b(20e-6, 2e9);
        one.n_nodes = 1;
        assert!(!choose(&one).tp);
        let mut unmeasured = qwen2_05b(20e-6, 2e9);
        unmeasured.secs_per_token = f64::NAN;
        assert!(!choose(&unmeasured).tp);
        let mut no_link = qwen2_05b(20e-6, 0.0);
        no_link.bandwidth = 0.0;
        assert!(!choose(&no_link).tp);
    }
}

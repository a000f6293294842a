//! Tensor-parallel groups as pipeline stages: nodes taken in order, `size` at a time,
//! each group planned as one node of the pipeline (`--tp N` with workers), and the
//! choice of `N` and of the pipeline split together (`--tp auto`). Pure functions,
//! tested with tables.
//!
//! The model for `--tp auto`, one stream (docs/tensor-parallel.md): a token passes every
//! stage in turn, so its time is the sum over stages of
//! - the group's compute for its layers: its slowest member's measured speed over
//!   `size × η` (a member computes `1/size` of each layer and keeps `η` of the ideal
//!   speed-up), times the stage's work ([`crate::partition`]'s unit);
//! - one hop into the stage: `ℓ`, plus `4 n_embd / β` for the hidden state into every
//!   stage but the first (which gets token ids), and one hop `ℓ` back to the head;
//! - in a group of `t > 1`, four all-gathers per layer: `L_s (4 ℓ + (t − 1) 4 W / t / β)`,
//!   `W = 3 n_embd + n_ff` values gathered per layer (attention heads, attention
//!   output, FFN activations, FFN output; `n_ff` of the chosen experts for a mixture of
//!   experts, see `baton_model::tp`);
//!
//! - on the last stage, a group of `t > 1` sends member 0 the others' shares of the
//!   logits (member 0 samples): `(t − 1) 4 n_vocab / t / β`;
//!
//! with `ℓ`, `β` the group's worst link (largest one-way latency, smallest bandwidth).
//! TP pays while `4 L ℓ` is small next to what splitting saves, `c (1 − 1/(t η))`.

use std::ops::Range;

use crate::{partition, plan_with_split, ModelCost, NodeOffer, Plan, PlanError};

/// How many members each tensor-parallel group has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpDegree {
    /// Groups of this many nodes (1: every node is a pipeline stage of its own).
    Fixed(usize),
    /// The group size the model of the module docs finds fastest for one stream.
    Auto,
}

impl Default for TpDegree {
    fn default() -> TpDegree {
        TpDegree::Fixed(1)
    }
}

/// Fraction of the ideal speed-up a member keeps: measured 0.79 for two one-thread
/// members in one process on qwen2 0.5B (smaller matmuls, the gathers' graph nodes;
/// docs/tensor-parallel.md).
pub const EFFICIENCY: f64 = 0.8;

/// A node's link, as the head measured its own link to it (worker-to-worker links are
/// taken to be alike: the head cannot time them before the plan).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkOffer {
    /// One-way latency, seconds (half the measured round trip).
    pub latency: f64,
    /// Bytes per second.
    pub bandwidth: f64,
}

/// What a group's exchanges carry: the model's hidden and FFN sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Hidden size.
    pub n_embd: usize,
    /// Inner size of the FFN (of one expert's, for a mixture of experts).
    pub n_ff: usize,
    /// Vocabulary: the last stage's members send member 0 their share of the logits.
    pub n_vocab: usize,
}

/// The pipeline over groups of nodes.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupPlan {
    /// Members per group (the last group may have fewer: what remained).
    pub size: usize,
    /// Each group's nodes (indices into the offers), in order; the plan's `node` is an
    /// index into this list.
    pub groups: Vec<Range<usize>>,
    /// The pipeline over the groups.
    pub plan: Plan,
}

/// `n` nodes in groups of `size` consecutive ones, the last with what remains.
pub fn groups(n: usize, size: usize) -> Vec<Range<usize>> {
    let size = size.max(1);
    (0..n).step_by(size).map(|start| start..(start + size).min(n)).collect()
}

/// A group as one node of the pipeline planner: each member holds `1/size` of every
/// layer, so the group holds `size` times what its smallest member offers; it computes
/// at its slowest member's speed over `size × efficiency` (a group of one is the node).
pub fn group_offer(nodes: &[NodeOffer], members: Range<usize>, efficiency: f64) -> NodeOffer {
    let group = &nodes[members];
    let size = group.len();
    if size == 1 {
        return group[0].clone();
    }
    let shares: Vec<(u64, f64)> = group.iter().map(host_share).collect();
    let memory = shares.iter().map(|&(memory, _)| memory).min().unwrap_or(0);
    let slowest = shares.iter().map(|&(_, secs)| secs).fold(0.0, f64::max);
    NodeOffer::single(
        group.iter().map(|n| n.name.as_str()).collect::<Vec<_>>().join("+"),
        memory.saturating_mul(size as u64),
        slowest / (size as f64 * efficiency.clamp(1e-3, 1.0)),
    )
}

/// What a node brings to a group as a member: members compute on the CPU (their
/// exchanges are host ops), so its CPU devices' memory and speed; a node that lists no
/// CPU, all it offers at its slowest device's speed.
fn host_share(node: &NodeOffer) -> (u64, f64) {
    let cpus: Vec<_> = node.devices.iter().filter(|d| d.name == "CPU").collect();
    let devices = match cpus.is_empty() {
        true => node.devices.iter().collect(),
        false => cpus,
    };
    let memory = devices.iter().map(|d| d.memory).fold(0, u64::saturating_add);
    let slowest = devices.iter().map(|d| d.secs_per_layer).fold(0.0, f64::max);
    (memory, slowest)
}

/// Plans the pipeline over `nodes` in groups of `size` (`split`: layers per group,
/// as `--split` gives them, instead of the planner).
pub fn plan_groups(
    cost: &ModelCost,
    nodes: &[NodeOffer],
    size: usize,
    split: Option<&[usize]>,
) -> Result<GroupPlan, PlanError> {
    let groups = groups(nodes.len(), size);
    let offers: Vec<NodeOffer> = groups
        .iter()
        .map(|g| group_offer(nodes, g.clone(), EFFICIENCY))
        .collect();
    let mut plan = match split {
        Some(split) => plan_with_split(cost, &offers, split)?,
        None => partition(cost, &offers)?,
    };
    if size > 1 {
        let names: Vec<&str> = offers.iter().map(|o| o.name.as_str()).collect();
        plan.why = format!(
            "tensor-parallel groups of {size} ({}), each planned as one node; {}",
            names.join(", "),
            plan.why
        );
    }
    Ok(GroupPlan { size, groups, plan })
}

/// The group's worst link: the largest latency and the smallest bandwidth of its
/// members'.
fn worst(links: &[LinkOffer]) -> LinkOffer {
    LinkOffer {
        latency: links.iter().map(|l| l.latency).fold(0.0, f64::max),
        bandwidth: links.iter().map(|l| l.bandwidth).fold(f64::INFINITY, f64::min),
    }
}

/// Seconds a group of `size` spends exchanging per layer: four all-gathers of
/// `W = 3 n_embd + n_ff` values in all, each member sending its `W / size` to the
/// `size − 1` others at once (latency-first: one link latency per exchange, its sends
/// serialised on its link).
pub fn exchange_secs(size: usize, link: LinkOffer, dims: Dims) -> f64 {
    if size <= 1 {
        return 0.0;
    }
    let t = size as f64;
    let gathered = 4.0 * (3 * dims.n_embd + dims.n_ff) as f64;
    4.0 * link.latency + (t - 1.0) * gathered / t / link.bandwidth.max(1.0)
}

/// Modelled seconds per token of one stream through `plan` (see the module docs);
/// `links[i]` is node `i`'s.
pub fn stream_secs(plan: &GroupPlan, links: &[LinkOffer], dims: Dims) -> f64 {
    let group_link = |node: usize| worst(&links[plan.groups[node].clone()]);
    let stages = &plan.plan.stages;
    let through: f64 = stages
        .iter()
        .enumerate()
        .map(|(i, stage)| {
            let link = group_link(stage.node);
            let hidden = if i == 0 {
                0.0
            } else {
                4.0 * dims.n_embd as f64 / link.bandwidth.max(1.0)
            };
            let exchanges = stage.layers.len() as f64 * exchange_secs(plan.groups[stage.node].len(), link, dims);
            stage.secs_per_token + link.latency + hidden + exchanges
        })
        .sum();
    let back = stages.last().map_or(0.0, |last| {
        let link = group_link(last.node);
        let t = plan.groups[last.node].len() as f64;
        let logits = (t - 1.0) * 4.0 * dims.n_vocab as f64 / t / link.bandwidth.max(1.0);
        link.latency + logits
    });
    through + back
}

/// The layout `--tp auto` chose, and what it weighed.
#[derive(Clone, Debug, PartialEq)]
pub struct LayoutChoice {
    /// The fastest layout for one stream.
    pub chosen: GroupPlan,
    /// Its modelled seconds per token.
    pub secs: f64,
    /// Every group size tried: its modelled seconds per token, or why it cannot be used.
    pub candidates: Vec<(usize, Result<f64, String>)>,
    /// The choice, its numbers and the model, for people.
    pub why: String,
}

/// `--tp auto`: plans the pipeline over groups of every size from 1 to `max_size` (the
/// largest the model can be split into) and keeps the one modelled fastest for one
/// stream; a tie goes to the smaller groups (fewer exchanges for the same time).
pub fn choose_layout(
    cost: &ModelCost,
    nodes: &[NodeOffer],
    links: &[LinkOffer],
    dims: Dims,
    max_size: usize,
) -> Result<LayoutChoice, PlanError> {
    if nodes.is_empty() {
        return Err(PlanError::NoStages);
    }
    let mut best: Option<(GroupPlan, f64)> = None;
    let mut candidates = Vec::new();
    let mut first_error = None;
    for size in 1..=max_size.clamp(1, nodes.len()) {
        match plan_groups(cost, nodes, size, None) {
            Ok(plan) => {
                let secs = stream_secs(&plan, links, dims);
                candidates.push((size, Ok(secs)));
                if best.as_ref().is_none_or(|(_, b)| secs < *b * (1.0 - 1e-9)) {
                    best = Some((plan, secs));
                }
            }
            Err(e) => {
                candidates.push((size, Err(e.to_string())));
                first_error.get_or_insert(e);
            }
        }
    }
    let Some((chosen, secs)) = best else {
        return Err(first_error.unwrap_or(PlanError::NoStages));
    };
    let why = explain(&chosen, &candidates, links, dims, max_size);
    Ok(LayoutChoice {
        chosen,
        secs,
        candidates,
        why,
    })
}

fn explain(
    chosen: &GroupPlan,
    candidates: &[(usize, Result<f64, String>)],
    links: &[LinkOffer],
    dims: Dims,
    max_size: usize,
) -> String {
    let tried: Vec<String> = candidates
        .iter()
        .map(|(size, secs)| match secs {
            Ok(secs) => format!("tp {size} {:.2} ms", secs * 1e3),
            Err(why) => format!("tp {size} impossible ({why})"),
        })
        .collect();
    let link = worst(links);
    let limit = match max_size {
        0 | 1 => " (the model cannot be split)".to_string(),
        n if n < links.len() => format!(" (the model splits at most {n} ways)"),
        _ => String::new(),
    };
    format!(
        "--tp auto chose tp {} with {} stage(s): modelled {}{limit}; worst link one-way {:.0} µs, {:.0} MB/s \
         (measured from the head); per token = Σ stages (compute / (tp × {EFFICIENCY}) + hop + layers × (4 \
         latency + (tp − 1) × {} bytes / tp / bandwidth)) + (tp − 1) × {} bytes of logits / tp / bandwidth",
        chosen.size,
        chosen.plan.stages.len(),
        tried.join(", "),
        link.latency * 1e6,
        link.bandwidth / 1e6,
        4 * (3 * dims.n_embd + dims.n_ff),
        4 * dims.n_vocab,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    /// qwen2 0.5B-like: 24 layers of 14 MB (its Q4_K_M), a 130 MB output projection.
    fn qwen2() -> ModelCost {
        ModelCost {
            layer_bytes: vec![14 * MB; 24],
            layer_work_bytes: vec![14 * MB; 24],
            first_bytes: 130 * MB,
            last_bytes: 130 * MB,
            kv_bytes: vec![MB; 24],
            no_stage_start: Vec::new(),
            reused: "",
        }
    }

    const DIMS: Dims = Dims {
        n_embd: 896,
        n_ff: 4864,
        n_vocab: 151_936,
    };

    /// Equal nodes of 1 ms per layer (34 ms per token with the output) and a lot of
    /// memory.
    fn nodes(n: usize) -> Vec<NodeOffer> {
        (0..n)
            .map(|i| NodeOffer::single(format!("w{i}"), 10_000 * MB, 1e-3))
            .collect()
    }

    fn links(n: usize, latency: f64, bandwidth: f64) -> Vec<LinkOffer> {
        vec![LinkOffer { latency, bandwidth }; n]
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one group of every node is a case
    fn groups_take_nodes_in_order_the_last_what_remains() {
        let table: &[(usize, usize, &[Range<usize>])] = &[
            (4, 2, &[0..2, 2..4]),
            (4, 1, &[0..1, 1..2, 2..3, 3..4]),
            (3, 2, &[0..2, 2..3]),
            (5, 3, &[0..3, 3..5]),
            (2, 4, &[0..2]),
            (0, 2, &[]),
        ];
        for (n, size, expected) in table {
            assert_eq!(groups(*n, *size), expected.to_vec(), "{n} nodes in groups of {size}");
        }
    }

    #[test]
    fn a_group_holds_its_members_memory_at_its_slowest_members_speed() {
        let offers = vec![NodeOffer::single("a", 300, 1.0), NodeOffer::single("b", 100, 2.0)];
        let group = group_offer(&offers, 0..2, 0.5);
        assert_eq!(group.name, "a+b");
        assert_eq!(group.memory(), 200);
        let secs = group.devices[0].secs_per_layer;
        assert!((secs - 2.0).abs() < 1e-12, "{secs}");
        assert_eq!(group_offer(&offers, 1..2, 0.5), offers[1], "a group of one is the node");
    }

    #[test]
    fn groups_chain_as_pipeline_stages() {
        let plan = plan_groups(&qwen2(), &nodes(4), 2, None).unwrap();
        assert_eq!(plan.groups, vec![0..2, 2..4]);
        let stages: Vec<(usize, Range<usize>)> = plan.plan.stages.iter().map(|s| (s.node, s.layers.clone())).collect();
        // Two equal groups split the work of 24 layers and a 9-layer output evenly.
        assert_eq!(stages, vec![(0, 0..17), (1, 17..24)]);
        assert!(
            plan.plan.why.starts_with("tensor-parallel groups of 2 (w0+w1, w2+w3)"),
            "{}",
            plan.plan.why
        );
        let split = plan_groups(&qwen2(), &nodes(4), 2, Some(&[12, 12])).unwrap();
        assert_eq!(split.plan.stages[1].layers, 12..24);
    }

    #[test]
    fn tp_auto_table() {
        // (case, nodes, one-way latency s, bandwidth B/s, max split, chosen size, stages)
        let table: &[(&str, usize, f64, f64, usize, usize, usize)] = &[
            ("loopback, 2 nodes", 2, 20e-6, 2e9, 16, 2, 1),
            ("loopback, 4 nodes", 4, 20e-6, 2e9, 16, 4, 1),
            ("the model splits 2 ways at most", 4, 20e-6, 2e9, 2, 2, 2),
            ("gigabit LAN at 50 µs, 2 nodes", 2, 50e-6, 117e6, 16, 2, 1),
            // 24 layers × (4 × 120 µs + 129 µs of bytes) eat what splitting saves.
            ("gigabit LAN at 120 µs", 2, 120e-6, 117e6, 16, 1, 2),
            ("wifi", 2, 2e-3, 5e6, 16, 1, 2),
            ("wan", 4, 15e-3, 15e6, 16, 1, 4),
            ("a model that cannot be split", 4, 20e-6, 2e9, 1, 1, 4),
        ];
        let why = |max_size| {
            choose_layout(&qwen2(), &nodes(4), &links(4, 20e-6, 2e9), DIMS, max_size)
                .unwrap()
                .why
        };
        assert!(why(1).contains("(the model cannot be split)"), "{}", why(1));
        assert!(why(2).contains("(the model splits at most 2 ways)"), "{}", why(2));
        for &(case, n, latency, bandwidth, max_size, size, stages) in table {
            let choice = choose_layout(&qwen2(), &nodes(n), &links(n, latency, bandwidth), DIMS, max_size).unwrap();
            assert_eq!(choice.chosen.size, size, "{case}: {}", choice.why);
            assert_eq!(choice.chosen.plan.stages.len(), stages, "{case}: {}", choice.why);
            assert!(
                choice.why.contains(&format!("chose tp {size}")),
                "{case}: {}",
                choice.why
            );
        }
    }

    #[test]
    fn tp_auto_models_one_stream_as_the_sum_of_its_stages() {
        let choice = choose_layout(&qwen2(), &nodes(2), &links(2, 20e-6, 2e9), DIMS, 2).unwrap();
        let secs = |size: usize| choice.candidates[size - 1].1.clone().unwrap();
        // A pipeline of two: 24 layers + 9.3 layers of output at 1 ms; three hops (head,
        // stage, stage, head), a hidden state on the middle one.
        let output = 130.0 / 14.0;
        let hops = 3.0 * 20e-6 + 4.0 * 896.0 / 2e9;
        assert!((secs(1) - ((24.0 + output) * 1e-3 + hops)).abs() < 1e-9, "{}", secs(1));
        // One group of two: the same work at 2 × 0.8, two hops, 24 layers of exchanges.
        let exchange = 4.0 * 20e-6 + 4.0 * (3.0 * 896.0 + 4864.0) / 2.0 / 2e9;
        let logits = 4.0 * 151_936.0 / 2.0 / 2e9;
        let expected = (24.0 + output) * 1e-3 / 1.6 + 2.0 * 20e-6 + 24.0 * exchange + logits;
        assert!((secs(2) - expected).abs() < 1e-9, "{} vs {expected}", secs(2));
        assert!((choice.secs - expected).abs() < 1e-12);
    }

    #[test]
    fn tp_auto_groups_where_memory_needs_them() {
        // Nodes that cannot hold the model alone or in pairs: only groups of 4 hold
        // every layer in one stage; pipelines of them still fit, and win on a slow link.
        let cost = qwen2();
        let small: Vec<NodeOffer> = (0..4)
            .map(|i| NodeOffer::single(format!("w{i}"), 200 * MB, 1e-3))
            .collect();
        let fast = choose_layout(&cost, &small, &links(4, 20e-6, 2e9), DIMS, 4).unwrap();
        assert_eq!(fast.chosen.size, 4, "{}", fast.why);
        let slow = choose_layout(&cost, &small, &links(4, 2e-3, 5e6), DIMS, 4).unwrap();
        assert_eq!(slow.chosen.size, 1, "{}", slow.why);
        // Too little memory in every layout is the planner's error.
        let tiny: Vec<NodeOffer> = small
            .iter()
            .map(|n| NodeOffer::single(n.name.clone(), MB, 1e-3))
            .collect();
        let err = choose_layout(&cost, &tiny, &links(4, 20e-6, 2e9), DIMS, 4).unwrap_err();
        assert!(matches!(err, PlanError::NotEnoughMemory { .. }), "{err}");
    }
}

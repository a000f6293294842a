//! The head's side of tensor-parallel groups of workers: which workers each planned
//! node stands for (one worker, a group of them, or the head itself), the plan over
//! them (`--tp N` in groups of N, `--tp auto` choosing N), and the measurement of the
//! head's link to each worker that `--tp auto` weighs.

use std::time::{Duration, Instant};

use baton_model::{ModelFile, TpSplit};
use baton_net::{Link, LinkExt};
use baton_plan::{Dims, LinkOffer, ModelCost, NodeOffer, Plan, TpDegree};
use baton_proto::{Control, Conversation, Message};

use crate::form::RemoteWorker;
use baton_stage::NodeError;

/// The plan, and which workers each of its nodes stands for.
pub(crate) struct Planned {
    pub plan: Plan,
    /// The name of every node offered, in the plan's numbering.
    pub node_names: Vec<String>,
    /// The names of every offered node's devices (a group's members compute on the
    /// CPU).
    pub node_devices: Vec<Vec<String>>,
    /// The head's measured speed on each of its devices, when it offered itself.
    pub head_secs_per_layer: Vec<f64>,
    /// The workers of each plan node, member 0 first; empty for the head's own node.
    nodes: Vec<Vec<usize>>,
}

impl Planned {
    /// The worker that sits in the ring for plan node `node` (its group's member 0);
    /// `None`: the head itself.
    pub fn worker_of(&self, node: usize) -> Option<usize> {
        self.nodes[node].first().copied()
    }

    /// Every worker of plan node `node`, in rank order.
    pub fn members(&self, node: usize) -> &[usize] {
        &self.nodes[node]
    }

    /// The ring address of the stage after each stage and the session its worker opened
    /// for this head (`None` for the last, which answers the head, and for the head's
    /// own stage).
    pub fn nexts(&self, workers: &[RemoteWorker]) -> Vec<Option<(String, u64)>> {
        let stages = &self.plan.stages;
        (0..stages.len())
            .map(|i| {
                let next = stages.get(i + 1)?;
                let caps = &workers[self.worker_of(next.node)?].caps;
                Some((caps.ring_addr.clone(), caps.session))
            })
            .collect()
    }
}

/// Plans over `head` (when it offers itself; never with groups) and the workers'
/// `offers` (in the order given): one stage per node, or in tensor-parallel groups as
/// `tp` says. `split` gives layers per node (per group with groups).
pub(crate) fn plan_nodes(
    file: &ModelFile,
    cost: ModelCost,
    head: Option<NodeOffer>,
    offers: &[NodeOffer],
    workers: &[RemoteWorker],
    split: Option<&[usize]>,
    tp: TpDegree,
) -> Result<Planned, NodeError> {
    let head_secs_per_layer = head
        .iter()
        .flat_map(|h| h.devices.iter().map(|d| d.secs_per_layer))
        .collect();
    let grouped = match tp {
        TpDegree::Fixed(0) => return Err(NodeError::Request("--tp must be at least 1".into())),
        TpDegree::Fixed(1) => {
            let all: Vec<NodeOffer> = head.iter().cloned().chain(offers.iter().cloned()).collect();
            let plan = match split {
                Some(split) => baton_plan::plan_with_split(&cost, &all, split)?,
                None => baton_plan::partition(&cost, &all)?,
            };
            let mut nodes: Vec<Vec<usize>> = head.iter().map(|_| Vec::new()).collect();
            nodes.extend((0..offers.len()).map(|w| vec![w]));
            return Ok(Planned {
                plan,
                node_devices: all
                    .iter()
                    .map(|o| o.devices.iter().map(|d| d.name.clone()).collect())
                    .collect(),
                node_names: all.into_iter().map(|o| o.name).collect(),
                head_secs_per_layer,
                nodes,
            });
        }
        TpDegree::Fixed(size) if size > baton_proto::MAX_TP_MEMBERS => {
            return Err(NodeError::Request(format!(
                "--tp {size}: a group has at most {} members",
                baton_proto::MAX_TP_MEMBERS
            )))
        }
        TpDegree::Fixed(size) => {
            // Refused before any worker loads: the model must split this many ways.
            TpSplit::new(file.hparams(), 0, size)?;
            baton_plan::plan_groups(&cost, offers, size, split)?
        }
        TpDegree::Auto => {
            let links = workers
                .iter()
                .map(|w| {
                    w.link
                        .ok_or_else(|| NodeError::Request(format!("the link to {} was not measured", w.addr)))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let choice = baton_plan::choose_layout(&cost, offers, &links, dims(file), max_split(file, offers.len()))?;
            let mut chosen = choice.chosen;
            chosen.plan.why = format!("{}; {}", choice.why, chosen.plan.why);
            chosen
        }
    };
    let node_names: Vec<String> = grouped
        .groups
        .iter()
        .map(|g| baton_plan::tp::group_offer(offers, g.clone(), 1.0).name)
        .collect();
    Ok(Planned {
        plan: grouped.plan,
        node_devices: vec![vec!["CPU".to_string()]; node_names.len()],
        node_names,
        head_secs_per_layer,
        nodes: grouped.groups.into_iter().map(|g| g.collect()).collect(),
    })
}

/// The most ways (up to `n`) the model of `file` can be split.
fn max_split(file: &ModelFile, n: usize) -> usize {
    (1..=n)
        .rev()
        .find(|&size| size == 1 || TpSplit::new(file.hparams(), 0, size).is_ok())
        .unwrap_or(1)
}

/// What a group's exchanges carry for the model of `file`.
fn dims(file: &ModelFile) -> Dims {
    let hp = file.hparams();
    let n_ff = if hp.moe.n_expert > 0 {
        hp.moe.n_ff_exp * hp.moe.n_expert_used.max(1)
    } else {
        hp.n_ff
    };
    Dims {
        n_embd: hp.n_embd,
        n_ff,
        n_vocab: hp.n_vocab,
    }
}

/// Filler in each large probe: long enough that its time on the wire shows the
/// bandwidth, short enough to cost milliseconds on a slow link.
const PROBE_BYTES: usize = 256 << 10;

/// Probes of each size; the fastest of each counts (the others met a busy moment).
const PROBE_ROUNDS: usize = 5;

/// Longest the head waits for one probe's answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// Times the head's link to the worker at the other end of `link` (before its plan):
/// empty probes give the round trip, large ones the bandwidth.
pub(crate) fn measure_link(link: &mut dyn Link, addr: &str) -> Result<LinkOffer, NodeError> {
    link.set_read_timeout(Some(PROBE_TIMEOUT))?;
    let mut probe = |bytes: usize| -> Result<f64, NodeError> {
        let sent = Instant::now();
        link.send(Message::Probe { data: vec![0; bytes] })?;
        match link.recv_as::<Control>()? {
            Control::Probe { .. } => Ok(sent.elapsed().as_secs_f64()),
            other => Err(NodeError::Protocol(format!(
                "worker {addr} answered a probe with {}",
                other.kind()
            ))),
        }
    };
    let (mut small, mut large) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..PROBE_ROUNDS {
        small = small.min(probe(0)?);
        large = large.min(probe(PROBE_BYTES)?);
    }
    link.set_read_timeout(None)?;
    let measured = link_offer(small, large);
    tracing::info!(worker = %addr, round_trip_us = small * 1e6, mb_per_s = measured.bandwidth / 1e6, "measured the link");
    Ok(measured)
}

/// The link from the fastest round trips of an empty probe and of a
/// [`PROBE_BYTES`]-byte one.
fn link_offer(small: f64, large: f64) -> LinkOffer {
    // Faster than the clock can tell: take 100 GB/s.
    let extra = (large - small).max(PROBE_BYTES as f64 / 100e9);
    LinkOffer {
        latency: small / 2.0,
        bandwidth: PROBE_BYTES as f64 / extra,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_give_latency_and_bandwidth() {
        // 200 µs round trip; 256 KiB take 2.6 ms more: about 100 MB/s.
        let link = link_offer(200e-6, 200e-6 + PROBE_BYTES as f64 / 100e6);
        assert!((link.latency - 100e-6).abs() < 1e-12, "{link:?}");
        assert!((link.bandwidth - 100e6).abs() < 1.0, "{link:?}");
        // A large probe no slower than an empty one (loopback, noise) is capped.
        let fast = link_offer(20e-6, 19e-6);
        assert!((fast.bandwidth - 100e9).abs() < 1.0, "{fast:?}");
    }
}

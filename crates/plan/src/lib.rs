//! Partitioning a model's layers into stages. Pure functions, tested with tables.
#![deny(unsafe_code)]

pub mod tp;

pub use tp::{choose_layout, plan_groups, Dims, GroupPlan, LayoutChoice, LinkOffer, TpDegree};

use std::ops::Range;

/// Why a partition cannot be made.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// No stages asked for.
    #[error("at least one stage is needed")]
    NoStages,
    /// More stages than layers.
    #[error("{stages} stages for {layers} layers: every stage needs at least one layer")]
    TooManyStages { stages: usize, layers: usize },
    /// A `--split` list that is not comma-separated positive integers.
    #[error("bad --split '{0}': expected comma-separated positive layer counts, e.g. 8,8,8")]
    BadSplit(String),
    /// A `--split` list whose counts do not add up to the model's layers.
    #[error("--split {split} covers {covered} layers, but the model has {layers}")]
    SplitMismatch {
        split: String,
        covered: usize,
        layers: usize,
    },
    /// A `--split` list longer than the list of nodes.
    #[error("--split has {stages} entries but there are only {nodes} nodes")]
    SplitTooLong { stages: usize, nodes: usize },
    /// A `--split` that gives a node more than it offers.
    #[error("--split gives {node} layers {first}..{end} needing {needed} bytes, but it offers {offered}")]
    SplitTooBig {
        node: String,
        first: usize,
        end: usize,
        needed: u64,
        offered: u64,
    },
    /// A `--split` that starts a stage at a layer that reuses an earlier layer's work.
    #[error("--split starts {node}'s stage at layer {layer}, which reuses {what} and must stay on that layer's stage")]
    SplitStartsInside {
        node: String,
        layer: usize,
        what: &'static str,
    },
    /// The nodes together cannot hold the model.
    #[error(
        "the nodes cannot hold the model: it needs {needed} bytes (layers, ends and KV cache); \
         the nodes offer {offered} in all{detail}"
    )]
    NotEnoughMemory { needed: u64, offered: u64, detail: String },
}

/// Splits `n_layers` into `n_stages` contiguous ranges whose sizes differ by at most
/// one; earlier stages get the extra layers (the first also embeds, the last samples,
/// so neither end is systematically lighter).
pub fn even_split(n_layers: usize, n_stages: usize) -> Result<Vec<Range<usize>>, PlanError> {
    if n_stages == 0 {
        return Err(PlanError::NoStages);
    }
    if n_stages > n_layers {
        return Err(PlanError::TooManyStages {
            stages: n_stages,
            layers: n_layers,
        });
    }
    let base = n_layers / n_stages;
    let extra = n_layers % n_stages;
    let sizes: Vec<usize> = (0..n_stages).map(|i| base + usize::from(i < extra)).collect();
    Ok(ranges(&sizes))
}

/// Parses `--split 8,8,8` (layer counts per stage) and checks it covers `n_layers`.
pub fn parse_split(split: &str, n_layers: usize) -> Result<Vec<Range<usize>>, PlanError> {
    let sizes = split
        .split(',')
        .map(|s| s.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| PlanError::BadSplit(split.to_string()))?;
    let covered: usize = sizes.iter().sum();
    if covered != n_layers {
        return Err(PlanError::SplitMismatch {
            split: split.to_string(),
            covered,
            layers: n_layers,
        });
    }
    Ok(ranges(&sizes))
}

/// What a model costs, per layer and at its two ends.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelCost {
    /// Weight bytes of each layer (what a stage holding it must have in memory; all
    /// experts of a mixture-of-experts layer).
    pub layer_bytes: Vec<u64>,
    /// Weight bytes of each layer read per generated token (a mixture-of-experts layer
    /// reads only the experts a token uses: far less than it holds).
    pub layer_work_bytes: Vec<u64>,
    /// Bytes only the first stage holds (token embeddings).
    pub first_bytes: u64,
    /// Bytes only the last stage holds (output norm and output projection).
    pub last_bytes: u64,
    /// KV cache bytes of each layer at the planned context size (what the
    /// architecture caches: keys and values, or one compressed row with MLA).
    pub kv_bytes: Vec<u64>,
    /// Layers no stage may start at: each reuses what an earlier layer computed, which
    /// stays on that layer's stage (GLM-5.2's shared indexer layers reuse the previous
    /// full layer's choice of tokens). Empty for most models.
    pub no_stage_start: Vec<usize>,
    /// What those layers reuse, for the error that refuses a split there.
    pub reused: &'static str,
}

impl ModelCost {
    fn n_layers(&self) -> usize {
        self.layer_bytes.len()
    }

    /// Whether a stage (or a device's part of one) may start at `layer`.
    pub fn may_start(&self, layer: usize) -> bool {
        !self.no_stage_start.contains(&layer)
    }

    /// Memory a stage holding `layers` needs: its weights, its ends, its KV cache.
    pub fn stage_bytes(&self, layers: &Range<usize>) -> u64 {
        let weights: u64 = self.layer_bytes[layers.clone()].iter().sum();
        let kv: u64 = self.kv_bytes[layers.clone()].iter().sum();
        let ends = if layers.start == 0 { self.first_bytes } else { 0 }
            + if layers.end == self.n_layers() {
                self.last_bytes
            } else {
                0
            };
        weights + ends + kv
    }

    /// Work of a stage per token, in units of the middle layer (the one workers time,
    /// see `NodeOffer::secs_per_layer`). Generating one token streams every weight it
    /// uses once, so work follows the bytes read: a layer's experts count only as far
    /// as a token uses them; the last stage's output projection counts (it can weigh as
    /// much as several layers), the first stage's embedding lookup reads one row and
    /// does not.
    fn stage_work(&self, layers: &Range<usize>) -> f64 {
        let unit = self.layer_work_bytes.get(self.n_layers() / 2).copied().unwrap_or(0);
        let weights: u64 = self.layer_work_bytes[layers.clone()].iter().sum();
        let last = if layers.end == self.n_layers() {
            self.last_bytes
        } else {
            0
        };
        (weights + last) as f64 / (unit as f64).max(1.0)
    }
}

/// One device a node offers (its CPU, a GPU): the planner gives each device a range
/// of its own.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceOffer {
    /// How the device is named (`CPU`, `Vulkan0`, `CUDA0`).
    pub name: String,
    /// Bytes it can hold.
    pub memory: u64,
    /// Seconds it takes per generated token through the model's middle layer.
    pub secs_per_layer: f64,
}

/// What a node offers the cluster: one or more devices, in the order its stages chain
/// (the hidden state moves between them in memory, never over a socket).
#[derive(Clone, Debug, PartialEq)]
pub struct NodeOffer {
    /// How the node is named in messages (its address).
    pub name: String,
    /// Its devices; at least one.
    pub devices: Vec<DeviceOffer>,
}

impl NodeOffer {
    /// A node with one device (the CPU, named `CPU`).
    pub fn single(name: impl Into<String>, memory: u64, secs_per_layer: f64) -> NodeOffer {
        NodeOffer {
            name: name.into(),
            devices: vec![DeviceOffer {
                name: "CPU".into(),
                memory,
                secs_per_layer,
            }],
        }
    }

    /// Bytes its devices hold together.
    pub fn memory(&self) -> u64 {
        self.devices.iter().map(|d| d.memory).sum()
    }
}

/// The layers one device of a node's stage holds.
#[derive(Clone, Debug, PartialEq)]
pub struct DevicePart {
    /// Index into the node's devices.
    pub device: usize,
    /// Its layers (consecutive with the parts around it).
    pub layers: Range<usize>,
}

/// One stage of a plan: one node, its devices' ranges in order.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedStage {
    /// Index into the offers.
    pub node: usize,
    /// Its layers.
    pub layers: Range<usize>,
    /// How its layers lie on the node's devices, in order; one part for a node with one
    /// device.
    pub parts: Vec<DevicePart>,
    /// Memory it needs.
    pub bytes: u64,
    /// Its expected time per generated token (its devices' times added: a token passes
    /// them in turn).
    pub secs_per_token: f64,
}

/// Stages in ring order, and the nodes the plan does not use with the reason.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Stages in ring order (nodes keep the order they were given in).
    pub stages: Vec<PlannedStage>,
    /// `(node name, why)` for every node without a stage.
    pub left_out: Vec<(String, String)>,
    /// Why the layers are split this way, for people.
    pub why: String,
}

/// Speeds a node measures of itself vary from run to run (other processes, caches,
/// frequency scaling): devices within this fraction of each other count as equally
/// fast, so that equal machines get the same balanced split every time.
pub const SPEED_NOISE: f64 = 0.5;

/// Each device's seconds per layer, with devices whose measurements lie within
/// [`SPEED_NOISE`] of the fastest of their group set to their group's mean. Groups are
/// formed from the fastest device up: a device joins the group of the fastest device
/// not yet grouped if it is within the noise of it.
pub fn settled_speeds(devices: &[&DeviceOffer]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..devices.len()).collect();
    order.sort_by(|&a, &b| devices[a].secs_per_layer.total_cmp(&devices[b].secs_per_layer));
    let mut settled = vec![0.0; devices.len()];
    let mut start = 0;
    while start < order.len() {
        let fastest = devices[order[start]].secs_per_layer;
        let end = start
            + order[start..]
                .iter()
                .take_while(|&&i| devices[i].secs_per_layer <= fastest * (1.0 + SPEED_NOISE))
                .count();
        let group = &order[start..end];
        let mean = group.iter().map(|&i| devices[i].secs_per_layer).sum::<f64>() / group.len() as f64;
        for &i in group {
            settled[i] = mean;
        }
        start = end;
    }
    settled
}

impl Plan {
    /// The slowest stage's time per token: what bounds throughput.
    pub fn bottleneck(&self) -> f64 {
        self.stages.iter().map(|s| s.secs_per_token).fold(0.0, f64::max)
    }
}

/// What the planner places layers on: one device of one node, in ring order.
#[derive(Clone, Debug)]
struct Unit {
    node: usize,
    device: usize,
    memory: u64,
    secs_per_layer: f64,
}

/// Every device of every node in ring order, with speeds settled (see
/// [`settled_speeds`]).
fn units(nodes: &[NodeOffer]) -> Vec<Unit> {
    let devices: Vec<(usize, usize, &DeviceOffer)> = nodes
        .iter()
        .enumerate()
        .flat_map(|(n, node)| node.devices.iter().enumerate().map(move |(d, device)| (n, d, device)))
        .collect();
    let speeds = settled_speeds(&devices.iter().map(|&(_, _, d)| d).collect::<Vec<_>>());
    devices
        .iter()
        .zip(speeds)
        .map(|(&(node, device, offer), secs_per_layer)| Unit {
            node,
            device,
            memory: offer.memory,
            secs_per_layer,
        })
        .collect()
}

/// Places `layers` on `units` (kept in order): every range lands on a unit with the
/// memory for it, and among the placements that fit, the one whose slowest unit is
/// fastest wins; ties go to the lower total time, then to fewer pieces (fewer hops).
/// Returns `(unit, range)` in order, or `None` when nothing fits.
fn place(cost: &ModelCost, layers: Range<usize>, units: &[Unit]) -> Option<Vec<(usize, Range<usize>)>> {
    let (first, n) = (layers.start, layers.len());
    if n == 0 {
        return None;
    }
    // best[i][l]: the best way to place layers first..first+l on units 0..i, as
    // (bottleneck, total, pieces) plus the choice made for unit i-1.
    #[derive(Clone, Copy)]
    struct Cell {
        score: (f64, f64, usize),
        from: usize,
        used: bool,
    }
    let better = |a: (f64, f64, usize), b: (f64, f64, usize)| {
        let eps = 1e-12;
        if (a.0 - b.0).abs() > eps * a.0.max(b.0).max(1.0) {
            return a.0 < b.0;
        }
        if (a.1 - b.1).abs() > eps * a.1.max(b.1).max(1.0) {
            return a.1 < b.1;
        }
        a.2 < b.2
    };
    let mut best: Vec<Vec<Option<Cell>>> = vec![vec![None; n + 1]; units.len() + 1];
    best[0][0] = Some(Cell {
        score: (0.0, 0.0, 0),
        from: 0,
        used: false,
    });
    for (i, unit) in units.iter().enumerate() {
        for l in 0..=n {
            // Unit i holds nothing.
            let mut cell = best[i][l].map(|c| Cell {
                score: c.score,
                from: l,
                used: false,
            });
            // Unit i holds layers s..l.
            for (s, prev) in best[i][..l].iter().enumerate() {
                let Some(prev) = *prev else { continue };
                let range = first + s..first + l;
                if !cost.may_start(range.start) || cost.stage_bytes(&range) > unit.memory {
                    continue;
                }
                let secs = unit.secs_per_layer * cost.stage_work(&range);
                let score = (prev.score.0.max(secs), prev.score.1 + secs, prev.score.2 + 1);
                if cell.is_none_or(|c| better(score, c.score)) {
                    cell = Some(Cell {
                        score,
                        from: s,
                        used: true,
                    });
                }
            }
            best[i + 1][l] = cell;
        }
    }
    best[units.len()][n]?;
    let mut pieces = Vec::new();
    let mut l = n;
    for i in (0..units.len()).rev() {
        let cell = best[i + 1][l].expect("a reachable cell has a reachable predecessor");
        if cell.used {
            pieces.push((i, first + cell.from..first + l));
        }
        l = cell.from;
    }
    pieces.reverse();
    Some(pieces)
}

/// Joins the consecutive pieces that landed on devices of one node into that node's
/// stage.
fn stages_of(cost: &ModelCost, units: &[Unit], pieces: &[(usize, Range<usize>)]) -> Vec<PlannedStage> {
    let mut stages: Vec<PlannedStage> = Vec::new();
    for (u, range) in pieces {
        let unit = &units[*u];
        let part = DevicePart {
            device: unit.device,
            layers: range.clone(),
        };
        let bytes = cost.stage_bytes(range);
        let secs = unit.secs_per_layer * cost.stage_work(range);
        match stages.last_mut() {
            Some(stage) if stage.node == unit.node => {
                stage.layers.end = range.end;
                stage.parts.push(part);
                stage.bytes += bytes;
                stage.secs_per_token += secs;
            }
            _ => stages.push(PlannedStage {
                node: unit.node,
                layers: range.clone(),
                parts: vec![part],
                bytes,
                secs_per_token: secs,
            }),
        }
    }
    stages
}

/// Plans stages over `nodes`, kept in the given order, each device of a node planned
/// as a place of its own (consecutive in the ring): every layer lands on a device with
/// the memory for it (memory limits come first), and among the plans that fit, the one
/// whose slowest device is fastest wins; ties go to the lower total time, then to fewer
/// pieces (fewer hops). A node that cannot hold even one layer is left out, and so is a
/// node the best plan does not need.
pub fn partition(cost: &ModelCost, nodes: &[NodeOffer]) -> Result<Plan, PlanError> {
    let n_layers = cost.n_layers();
    if nodes.is_empty() {
        return Err(PlanError::NoStages);
    }
    let units = units(nodes);
    let pieces = place(cost, 0..n_layers, &units).ok_or_else(|| not_enough_memory(cost, nodes))?;
    let stages = stages_of(cost, &units, &pieces);
    let min_layer = (0..n_layers).map(|l| cost.stage_bytes(&(l..l + 1))).min().unwrap_or(0);
    let left_out = nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| !stages.iter().any(|s| s.node == *i))
        .map(|(_, node)| {
            let largest = node.devices.iter().map(|d| d.memory).max().unwrap_or(0);
            let why = if node.devices.is_empty() {
                "it offers no device".to_string()
            } else if largest < min_layer {
                format!("it offers {largest} bytes, but the smallest layer needs {min_layer}")
            } else {
                "the plan is no faster with it".to_string()
            };
            (node.name.clone(), why)
        })
        .collect();
    let why = explain(cost, nodes, &units, &pieces);
    Ok(Plan { stages, left_out, why })
}

/// Says how the speeds were read and what the split balances.
fn explain(cost: &ModelCost, nodes: &[NodeOffer], units: &[Unit], pieces: &[(usize, Range<usize>)]) -> String {
    let ms = |secs: f64| format!("{:.2} ms", secs * 1e3);
    let measured: Vec<String> = units
        .iter()
        .map(|u| {
            let node = &nodes[u.node];
            let device = &node.devices[u.device];
            match node.devices.len() {
                1 => format!("{} {}", node.name, ms(device.secs_per_layer)),
                _ => format!("{} {} {}", node.name, device.name, ms(device.secs_per_layer)),
            }
        })
        .collect();
    let groups = {
        let mut distinct: Vec<f64> = units.iter().map(|u| u.secs_per_layer).collect();
        distinct.sort_by(f64::total_cmp);
        distinct.dedup();
        distinct.len()
    };
    let speed = if groups == 1 && units.len() > 1 {
        format!(
            "measured per layer and token: {} (within {:.0}% of each other: equally fast)",
            measured.join(", "),
            SPEED_NOISE * 100.0
        )
    } else {
        format!("measured per layer and token: {}", measured.join(", "))
    };
    let output = cost.last_bytes as f64 / (cost.layer_bytes.iter().sum::<u64>() as f64 / cost.n_layers().max(1) as f64);
    let bottleneck = pieces
        .iter()
        .map(|(u, layers)| units[*u].secs_per_layer * cost.stage_work(layers))
        .fold(0.0, f64::max);
    format!(
        "{speed}; layers split to balance time per token (the last stage's output projection \
         weighs {output:.1} layers), slowest device {} per token",
        ms(bottleneck)
    )
}

/// A plan from `--split`: `sizes[i]` layers on node `i` (0 leaves the node out); every
/// stage must fit its node's memory. A node with several devices has its layers placed
/// on them as [`partition`] would.
pub fn plan_with_split(cost: &ModelCost, nodes: &[NodeOffer], sizes: &[usize]) -> Result<Plan, PlanError> {
    let n_layers = cost.n_layers();
    let split = sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    if sizes.len() > nodes.len() {
        return Err(PlanError::SplitTooLong {
            stages: sizes.len(),
            nodes: nodes.len(),
        });
    }
    let covered: usize = sizes.iter().sum();
    if covered != n_layers {
        return Err(PlanError::SplitMismatch {
            split,
            covered,
            layers: n_layers,
        });
    }
    let units = units(nodes);
    let mut stages = Vec::new();
    let mut left_out = Vec::new();
    let mut start = 0;
    for (i, node) in nodes.iter().enumerate() {
        let n = sizes.get(i).copied().unwrap_or(0);
        if n == 0 {
            left_out.push((node.name.clone(), "--split gives it no layers".to_string()));
            continue;
        }
        let layers = start..start + n;
        start += n;
        if !cost.may_start(layers.start) {
            return Err(PlanError::SplitStartsInside {
                node: node.name.clone(),
                layer: layers.start,
                what: cost.reused,
            });
        }
        let own: Vec<Unit> = units.iter().filter(|u| u.node == i).cloned().collect();
        let pieces = place(cost, layers.clone(), &own).ok_or_else(|| PlanError::SplitTooBig {
            node: node.name.clone(),
            first: layers.start,
            end: layers.end,
            needed: cost.stage_bytes(&layers),
            offered: node.memory(),
        })?;
        stages.extend(stages_of(cost, &own, &pieces));
    }
    Ok(Plan {
        stages,
        left_out,
        why: format!("--split {split}"),
    })
}

/// The largest KV cache, in cells, that `fits` (a plan over the nodes succeeds, or one
/// machine holds it): `most` itself when it fits, else the largest multiple of `step`
/// below it that does; `None` when not even `step` cells fit. `fits` must be monotonic
/// (what fits with more cells fits with fewer); it is asked about a logarithmic number
/// of sizes.
pub fn largest_context(most: usize, step: usize, mut fits: impl FnMut(usize) -> bool) -> Option<usize> {
    if most > 0 && fits(most) {
        return Some(most);
    }
    let step = step.max(1);
    // The largest k with k × step < most and fits(k × step); 0 stands for none.
    let (mut lo, mut hi) = (0, most.saturating_sub(1) / step);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid * step) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    (lo > 0).then_some(lo * step)
}

fn not_enough_memory(cost: &ModelCost, nodes: &[NodeOffer]) -> PlanError {
    let needed = cost.stage_bytes(&(0..cost.n_layers()));
    let offered = nodes.iter().map(NodeOffer::memory).sum();
    let largest = (0..cost.n_layers())
        .map(|l| cost.stage_bytes(&(l..l + 1)))
        .max()
        .unwrap_or(0);
    let detail = if needed <= offered {
        format!(" (enough in sum, but not in layer-sized pieces: one layer needs up to {largest})")
    } else {
        String::new()
    };
    PlanError::NotEnoughMemory {
        needed,
        offered,
        detail,
    }
}

/// Parses a cluster's `--split` (layer counts per node, in node order; 0 leaves a node
/// out). [`plan_with_split`] checks the counts against the model and the nodes.
pub fn parse_node_split(split: &str) -> Result<Vec<usize>, PlanError> {
    split
        .split(',')
        .map(|s| s.trim().parse::<usize>().ok())
        .collect::<Option<Vec<usize>>>()
        .filter(|sizes| sizes.iter().any(|&n| n > 0))
        .ok_or_else(|| PlanError::BadSplit(split.to_string()))
}

fn ranges(sizes: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&n| {
            let range = start..start + n;
            start += n;
            range
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one stage holding every layer is the case
    fn even_split_table() {
        let cases: &[(usize, usize, &[Range<usize>])] = &[
            (24, 1, &[0..24]),
            (24, 2, &[0..12, 12..24]),
            (24, 3, &[0..8, 8..16, 16..24]),
            (18, 4, &[0..5, 5..10, 10..14, 14..18]),
            (3, 3, &[0..1, 1..2, 2..3]),
            (5, 2, &[0..3, 3..5]),
        ];
        for (layers, stages, expected) in cases {
            assert_eq!(
                even_split(*layers, *stages).unwrap(),
                expected.to_vec(),
                "{layers} layers / {stages} stages"
            );
        }
    }

    #[test]
    fn even_split_errors() {
        assert_eq!(even_split(24, 0), Err(PlanError::NoStages));
        assert_eq!(even_split(2, 3), Err(PlanError::TooManyStages { stages: 3, layers: 2 }));
    }

    const MB: u64 = 1 << 20;

    /// 24 layers of 10 MB, 5 MB embeddings, a 20 MB head (two layers of work), no KV.
    fn cost() -> ModelCost {
        dense(24, 0)
    }

    /// `n` dense layers of 10 MB with `kv` MB of cache each; 5 MB embeddings, a 20 MB head.
    fn dense(n: usize, kv: u64) -> ModelCost {
        ModelCost {
            layer_bytes: vec![10 * MB; n],
            layer_work_bytes: vec![10 * MB; n],
            first_bytes: 5 * MB,
            last_bytes: 20 * MB,
            kv_bytes: vec![kv * MB; n],
            no_stage_start: Vec::new(),
            reused: "",
        }
    }

    fn node(name: &str, memory_mb: u64, secs_per_layer: f64) -> NodeOffer {
        NodeOffer::single(name, memory_mb * MB, secs_per_layer)
    }

    /// A node with several devices: `(name, memory MB, seconds per layer)` each.
    fn multi(name: &str, devices: &[(&str, u64, f64)]) -> NodeOffer {
        NodeOffer {
            name: name.into(),
            devices: devices
                .iter()
                .map(|&(device, memory_mb, secs_per_layer)| DeviceOffer {
                    name: device.into(),
                    memory: memory_mb * MB,
                    secs_per_layer,
                })
                .collect(),
        }
    }

    /// `(node, [(device, layers)])` of each stage.
    type Parts = Vec<(usize, Vec<(usize, Range<usize>)>)>;

    fn parts(plan: &Plan) -> Parts {
        plan.stages
            .iter()
            .map(|s| (s.node, s.parts.iter().map(|p| (p.device, p.layers.clone())).collect()))
            .collect()
    }

    fn layers(plan: &Plan) -> Vec<(usize, Range<usize>)> {
        plan.stages.iter().map(|s| (s.node, s.layers.clone())).collect()
    }

    #[test]
    #[allow(clippy::type_complexity)] // a table: (name, model, nodes, expected ranges, head)
    fn partition_table() {
        let big = 10_000;
        let cases: Vec<(&str, ModelCost, Vec<NodeOffer>, Vec<(usize, Range<usize>)>, usize)> = vec![
            // Equal nodes share the work of 24 layers plus the two-layer head evenly:
            // 13 + 13 (11 layers and the head).
            (
                "two equal nodes",
                cost(),
                vec![node("a", big, 1.0), node("b", big, 1.0)],
                vec![(0, 0..13), (1, 13..24)],
                0,
            ),
            (
                "three equal nodes",
                cost(),
                vec![node("a", big, 1.0), node("b", big, 1.0), node("c", big, 1.0)],
                vec![(0, 0..8), (1, 8..17), (2, 17..24)],
                0,
            ),
            // A node twice as slow gets about half the work.
            (
                "one slow node",
                cost(),
                vec![node("a", big, 1.0), node("slow", big, 2.0), node("c", big, 1.0)],
                vec![(0, 0..10), (1, 10..15), (2, 15..24)],
                0,
            ),
            // A small node takes what fits (5 MB embeddings + 3 layers), the rest goes on.
            (
                "one small node",
                cost(),
                vec![node("small", 35, 1.0), node("b", big, 1.0)],
                vec![(0, 0..3), (1, 3..24)],
                0,
            ),
            // A node that cannot hold one layer is left out, with the reason.
            (
                "node too small for a layer",
                cost(),
                vec![node("a", big, 1.0), node("tiny", 9, 1.0), node("b", big, 1.0)],
                vec![(0, 0..13), (2, 13..24)],
                1,
            ),
            // Four layers, six nodes: one layer each on the nodes that help.
            (
                "more nodes than layers",
                ModelCost {
                    first_bytes: 0,
                    last_bytes: 0,
                    ..dense(4, 0)
                },
                (0..6).map(|i| node(&format!("n{i}"), big, 1.0)).collect(),
                vec![(0, 0..1), (1, 1..2), (2, 2..3), (3, 3..4)],
                2,
            ),
            // KV cache counts: 10 MB of weights + 10 MB of cache per layer.
            (
                "kv cache counts against memory",
                dense(24, 10),
                vec![node("a", 205, 1.0), node("b", big, 1.0)],
                vec![(0, 0..10), (1, 10..24)],
                0,
            ),
        ];
        for (name, cost, nodes, expected, n_left_out) in cases {
            let plan = partition(&cost, &nodes).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(layers(&plan), expected, "{name}");
            assert_eq!(plan.left_out.len(), n_left_out, "{name}: {:?}", plan.left_out);
            for stage in &plan.stages {
                assert!(stage.bytes <= nodes[stage.node].memory(), "{name}: stage over memory");
            }
        }
    }

    /// Regression: equal nodes whose self-measured speeds differed by noise were split
    /// 0..5 / 5..21 / 21..24 on one run and otherwise on the next.
    #[test]
    fn equal_nodes_measured_with_noise_get_the_balanced_split() {
        let exact = partition(
            &cost(),
            &[node("a", 10_000, 1.0), node("b", 10_000, 1.0), node("c", 10_000, 1.0)],
        )
        .unwrap();
        for speeds in [[1.0, 1.2, 0.97], [1.24, 1.0, 1.1], [0.9, 0.95, 1.1]] {
            let nodes: Vec<NodeOffer> = ["a", "b", "c"]
                .iter()
                .zip(speeds)
                .map(|(name, secs)| node(name, 10_000, secs))
                .collect();
            let plan = partition(&cost(), &nodes).unwrap();
            assert_eq!(layers(&plan), layers(&exact), "{speeds:?}");
            assert!(plan.why.contains("equally fast"), "{}", plan.why);
        }
        // A node clearly slower than the others still gets less work.
        let plan = partition(
            &cost(),
            &[node("a", 10_000, 1.0), node("b", 10_000, 2.0), node("c", 10_000, 1.0)],
        )
        .unwrap();
        assert!(plan.stages[1].layers.len() < plan.stages[0].layers.len(), "{plan:?}");
        assert!(!plan.why.contains("equally fast"), "{}", plan.why);
    }

    #[test]
    fn settled_speeds_table() {
        let offers = |speeds: &[f64]| -> Vec<DeviceOffer> {
            speeds
                .iter()
                .map(|&secs_per_layer| DeviceOffer {
                    name: "CPU".into(),
                    memory: 1,
                    secs_per_layer,
                })
                .collect()
        };
        let cases: &[(&[f64], &[f64])] = &[
            (&[1.0], &[1.0]),
            (&[1.0, 1.2], &[1.1, 1.1]),
            (&[1.0, 1.6], &[1.0, 1.6]),
            (&[2.0, 1.0, 1.1, 2.2], &[2.1, 1.05, 1.05, 2.1]),
        ];
        for (measured, settled) in cases {
            let offers = offers(measured);
            let got = settled_speeds(&offers.iter().collect::<Vec<_>>());
            for (g, s) in got.iter().zip(*settled) {
                assert!((g - s).abs() < 1e-9, "{measured:?}: {got:?}");
            }
        }
    }

    /// Layers that reuse an earlier layer's work (GLM-5.2's shared indexer layers) start
    /// no stage and no device's part: the plan moves its cut to the nearest layer that
    /// may start one, and a `--split` that cuts there is refused with the layer named.
    #[test]
    fn stages_never_start_at_layers_tied_to_the_one_before() {
        let big = 10_000;
        let nodes = vec![node("a", big, 1.0), node("b", big, 1.0)];
        let free = partition(&dense(8, 0), &nodes).unwrap();
        let cut = free.stages[1].layers.start;
        let tied = ModelCost {
            no_stage_start: vec![cut],
            reused: "an earlier layer's choice of tokens (a shared indexer layer)",
            ..dense(8, 0)
        };
        let plan = partition(&tied, &nodes).unwrap();
        assert_eq!(plan.stages.len(), 2);
        let moved = plan.stages[1].layers.start;
        assert!(moved == cut - 1 || moved == cut + 1, "cut at {cut} moved to {moved}");
        let err = plan_with_split(&tied, &nodes, &[cut, 8 - cut]).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "--split starts b's stage at layer {cut}, which reuses an earlier layer's choice of tokens \
                 (a shared indexer layer) and must stay on that layer's stage"
            )
        );
        // Two devices of one node: neither part starts there either.
        let two_devices = vec![multi("ab", &[("d0", big, 1.0), ("d1", big, 1.0)])];
        let plan = partition(&tied, &two_devices).unwrap();
        assert!(plan.stages[0].parts.iter().all(|p| p.layers.start != cut), "{plan:?}");
    }

    /// A mixture-of-experts model: a dense leading layer (10 MB, all read per token),
    /// then 11 MoE layers holding 100 MB each of which a token reads 20 MB.
    fn moe() -> ModelCost {
        let mut cost = dense(12, 0);
        for layer in 1..12 {
            cost.layer_bytes[layer] = 100 * MB;
            cost.layer_work_bytes[layer] = 20 * MB;
        }
        cost
    }

    #[test]
    fn experts_weigh_in_memory_but_only_used_ones_in_work() {
        let big = 10_000;
        // Work in middle-layer units: the dense layer 0.5, each MoE layer 1, the head 1.
        // Equal nodes split it 6.5 + 6, not by the bytes they hold (410 + 680 MB).
        let plan = partition(&moe(), &[node("a", big, 1.0), node("b", big, 1.0)]).unwrap();
        assert_eq!(layers(&plan), vec![(0, 0..7), (1, 7..12)]);
        assert_eq!(plan.stages[0].bytes, (5 + 10 + 6 * 100) * MB);
        assert!((plan.bottleneck() - 6.5).abs() < 1e-9, "{}", plan.bottleneck());
        // Memory limits count every expert: 350 MB holds the embeddings, the dense
        // layer and 3 MoE layers.
        let plan = partition(&moe(), &[node("a", 350, 1.0), node("b", big, 1.0)]).unwrap();
        assert_eq!(layers(&plan), vec![(0, 0..4), (1, 4..12)]);
        // The dense model of the same bytes read per token splits the same work at the
        // same place only if its layers weigh the same: here every layer is 1 unit.
        let plan = partition(&dense(12, 0), &[node("a", big, 1.0), node("b", big, 1.0)]).unwrap();
        assert_eq!(layers(&plan), vec![(0, 0..7), (1, 7..12)]);
    }

    #[test]
    fn kv_cache_counts_per_layer() {
        // 20 MB of cache on 6 of 12 layers: a 100 MB node holds 3 layers with their
        // cache, or 7 where the cache is not (and work balance then stops it at 7).
        let with_cache = |layers: Range<usize>| {
            let mut cost = dense(12, 0);
            for kv in &mut cost.kv_bytes[layers] {
                *kv = 20 * MB;
            }
            cost
        };
        let nodes = [node("a", 100, 1.0), node("b", 10_000, 1.0)];
        let plan = partition(&with_cache(0..6), &nodes).unwrap();
        assert_eq!(layers(&plan), vec![(0, 0..3), (1, 3..12)]);
        assert_eq!(plan.stages[0].bytes, (5 + 3 * 30) * MB);
        let plan = partition(&with_cache(6..12), &nodes).unwrap();
        assert_eq!(layers(&plan), vec![(0, 0..7), (1, 7..12)]);
        assert_eq!(plan.stages[0].bytes, (5 + 7 * 10 + 20) * MB);
    }

    #[test]
    fn left_out_nodes_say_why() {
        let plan = partition(&cost(), &[node("a", 10_000, 1.0), node("tiny", 9, 1.0)]).unwrap();
        assert_eq!(plan.left_out.len(), 1);
        assert_eq!(plan.left_out[0].0, "tiny");
        assert!(
            plan.left_out[0].1.contains("smallest layer needs 10485760"),
            "{}",
            plan.left_out[0].1
        );
    }

    #[test]
    fn the_largest_context_that_fits_is_found() {
        // (most, step, the largest size that fits, expected)
        for (most, step, limit, expected) in [
            (32768, 256, usize::MAX, Some(32768)),
            (32768, 256, 32767, Some(32512)),
            (32768, 256, 10_000, Some(9984)),
            (32768, 1024, 10_000, Some(9216)),
            (32768, 256, 256, Some(256)),
            (32768, 256, 255, None),
            (1000, 256, 999, Some(768)),
            (100, 256, 99, None),
            (100, 256, 100, Some(100)),
            (0, 256, usize::MAX, None),
        ] {
            let mut asked = 0;
            let got = largest_context(most, step, |n| {
                asked += 1;
                n <= limit
            });
            assert_eq!(got, expected, "most {most}, step {step}, limit {limit}");
            assert!(asked <= 10, "{asked} sizes asked for most {most}");
        }
    }

    #[test]
    fn too_little_memory_is_an_error() {
        let err = partition(&cost(), &[node("a", 100, 1.0), node("b", 100, 1.0)]).unwrap_err();
        assert!(matches!(err, PlanError::NotEnoughMemory { .. }), "{err}");
        assert!(err.to_string().contains("needs 277872640 bytes"), "{err}");
        // Enough in sum, but every node is smaller than one layer.
        let err = partition(
            &cost(),
            &(0..40).map(|i| node(&format!("n{i}"), 9, 1.0)).collect::<Vec<_>>(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("not in layer-sized pieces"), "{err}");
    }

    #[test]
    fn split_overrides_the_planner() {
        let nodes = [node("a", 10_000, 1.0), node("b", 10_000, 5.0), node("c", 10_000, 1.0)];
        let plan = plan_with_split(&cost(), &nodes, &[0, 20, 4]).unwrap();
        assert_eq!(layers(&plan), vec![(1, 0..20), (2, 20..24)]);
        assert_eq!(
            plan.left_out,
            vec![("a".to_string(), "--split gives it no layers".to_string())]
        );
        assert!(matches!(
            plan_with_split(&cost(), &nodes, &[12, 11]),
            Err(PlanError::SplitMismatch { covered: 23, .. })
        ));
        assert!(matches!(
            plan_with_split(&cost(), &nodes, &[6; 4]),
            Err(PlanError::SplitTooLong { .. })
        ));
        let small = [node("a", 50, 1.0), node("b", 10_000, 1.0)];
        let err = plan_with_split(&cost(), &small, &[12, 12]).unwrap_err();
        assert!(err.to_string().contains("gives a layers 0..12"), "{err}");
    }

    /// Issue 15: a worker offers each of its devices, and the plan gives each a
    /// consecutive range of its own (not an even split made inside the worker).
    #[test]
    fn devices_of_a_node_get_ranges_of_their_own() {
        let big = 10_000;
        let cases: Vec<(&str, Vec<NodeOffer>, Parts)> = vec![
            // A GPU 4x faster than its host's CPU takes about 4/5 of the work (26 units:
            // 24 layers and the two-layer output): 21 layers (5.25 units of time), the
            // CPU 3 layers and the output (5).
            (
                "fast gpu and its cpu",
                vec![multi("w", &[("CUDA0", big, 0.25), ("CPU", big, 1.0)])],
                vec![(0, vec![(0, 0..21), (1, 21..24)])],
            ),
            // The GPU holds what fits (5 MB embeddings + 10 layers), the CPU the rest.
            (
                "small gpu",
                vec![multi("w", &[("CUDA0", 105, 0.1), ("CPU", big, 1.0)])],
                vec![(0, vec![(0, 0..10), (1, 10..24)])],
            ),
            // Two workers with a GPU each: every device is a place of its own (GPUs 9
            // layers, 4.5 units of time; CPUs 4 units).
            (
                "two workers with gpu and cpu",
                vec![
                    multi("a", &[("CUDA0", big, 0.5), ("CPU", big, 1.0)]),
                    multi("b", &[("CUDA0", big, 0.5), ("CPU", big, 1.0)]),
                ],
                vec![(0, vec![(0, 0..9), (1, 9..13)]), (1, vec![(0, 13..22), (1, 22..24)])],
            ),
            // A device too slow to help is left without a part; the node still serves
            // with the other.
            (
                "slow cpu beside a fast gpu",
                vec![
                    multi("w", &[("CUDA0", big, 0.01), ("CPU", big, 1.0)]),
                    node("b", big, 1.0),
                ],
                vec![(0, vec![(0, 0..24)])],
            ),
        ];
        for (name, nodes, expected) in cases {
            let plan = partition(&cost(), &nodes).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(parts(&plan), expected, "{name}: {}", plan.why);
            for stage in &plan.stages {
                let covered: usize = stage.parts.iter().map(|p| p.layers.len()).sum();
                assert_eq!(covered, stage.layers.len(), "{name}");
                for part in &stage.parts {
                    let device = &nodes[stage.node].devices[part.device];
                    assert!(
                        cost().stage_bytes(&part.layers) <= device.memory,
                        "{name}: part over memory"
                    );
                }
            }
        }
        // The explanation names the devices of a node that has several.
        let plan = partition(&cost(), &[multi("w", &[("CUDA0", big, 0.25), ("CPU", big, 1.0)])]).unwrap();
        assert!(plan.why.contains("w CUDA0 250.00 ms, w CPU 1000.00 ms"), "{}", plan.why);
    }

    #[test]
    fn split_places_a_nodes_layers_on_its_devices() {
        let big = 10_000;
        let nodes = [
            node("a", big, 1.0),
            multi("b", &[("CUDA0", big, 0.25), ("CPU", big, 1.0)]),
        ];
        let plan = plan_with_split(&cost(), &nodes, &[4, 20]).unwrap();
        // b's 20 layers and the output (22 units): 18 layers on its GPU (4.5 units of time), 2 and the output on its CPU (4).
        assert_eq!(
            parts(&plan),
            vec![(0, vec![(0, 0..4)]), (1, vec![(0, 4..22), (1, 22..24)])]
        );
        // A split that no arrangement of the node's devices can hold is refused.
        let small = [multi("b", &[("CUDA0", 50, 0.25), ("CPU", 50, 1.0)])];
        let err = plan_with_split(&cost(), &small, &[24]).unwrap_err();
        assert!(matches!(err, PlanError::SplitTooBig { .. }), "{err}");
    }

    #[test]
    fn parse_split_table() {
        assert_eq!(parse_split("8,8,8", 24).unwrap(), vec![0..8, 8..16, 16..24]);
        assert_eq!(parse_split("1, 23", 24).unwrap(), vec![0..1, 1..24]);
        assert_eq!(parse_split("24", 24).unwrap(), vec![0..24]);
        for bad in ["", "8,,8", "8,0,16", "a,b", "-1,25"] {
            assert_eq!(parse_split(bad, 24), Err(PlanError::BadSplit(bad.into())), "{bad:?}");
        }
        assert_eq!(
            parse_split("8,8", 24).unwrap_err().to_string(),
            "--split 8,8 covers 16 layers, but the model has 24"
        );
    }
}

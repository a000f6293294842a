//! The head forming a cluster: connect to every worker, check the protocol version and
//! the model's identity, plan from one capabilities message each (no probing round
//! trips), tell each worker its range, stream tensors to workers that lack the file,
//! and hand back a [`Head`] whose ring runs through the workers.

use std::path::Path;
use std::sync::Arc;

use baton_model::{ModelFile, StageSpan};
use baton_net::{client_handshake, Counters, LinkOptions, TcpLink};
use baton_plan::{ModelCost, NodeOffer, Plan};
use baton_proto::auth::identity_hash;
use baton_proto::{Capabilities, LoadPlan, Message, ModelRef, Role};

use super::stream::send_stage_tensors;
use crate::head::Head;
use crate::NodeError;

/// How the head forms the cluster.
#[derive(Clone, Debug, Default)]
pub struct ClusterOptions {
    /// Cluster secret shared with every worker.
    pub token: Option<String>,
    /// Layers per worker (overrides the planner), e.g. `[12, 12]`.
    pub split: Option<Vec<usize>>,
    /// KV cells per stage.
    pub n_ctx: usize,
    /// Send hidden states between stages as f16.
    pub wire_f16: bool,
    /// Repack weights like llama.cpp's default.
    pub repack: bool,
    /// Socket settings.
    pub link: LinkOptions,
}

/// A worker as the head sees it.
pub struct RemoteWorker {
    /// Address given on the command line.
    pub addr: String,
    /// What it offered.
    pub caps: Capabilities,
    /// Its layers, if the plan uses it.
    pub layers: Option<std::ops::Range<usize>>,
    /// Weight bytes it received by streaming.
    pub streamed: u64,
}

/// A ring of remote stages, driven by `head`.
pub struct RemoteRing {
    /// Drives generation around the ring.
    pub head: Head,
    /// The workers, in the order given.
    pub workers: Vec<RemoteWorker>,
    /// The plan that was applied.
    pub plan: Plan,
    /// Bytes the head sent to the first stage.
    pub to_first: Arc<Counters>,
    /// Bytes the head received from the last stage.
    pub from_last: Arc<Counters>,
    // Control links of the middle stages stay open for the session's lifetime.
    _idle: Vec<TcpLink>,
}

/// The cheap identity of a model file (hash of header and tensor index).
pub fn model_ref(file: &ModelFile) -> ModelRef {
    let header = &file.bytes()[..file.gguf().data_offset as usize];
    ModelRef {
        file_name: file
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        identity: identity_hash(header),
        size: file.bytes().len() as u64,
    }
}

/// What each layer and each end of the model costs in memory, for the planner.
pub fn model_cost(file: &ModelFile, n_ctx: usize) -> ModelCost {
    let hp = file.hparams();
    let tensor_bytes = |name: &str| file.gguf().tensor(name).map_or(0, |t| t.n_bytes);
    let output = if file.gguf().tensor("output.weight").is_some() {
        "output.weight"
    } else {
        "token_embd.weight"
    };
    ModelCost {
        layer_bytes: (0..hp.n_layer).map(|l| file.layer_bytes(l)).collect(),
        first_bytes: tensor_bytes("token_embd.weight"),
        last_bytes: tensor_bytes("output_norm.weight") + tensor_bytes(output),
        kv_bytes_per_layer: ((hp.n_embd_k_gqa() + hp.n_embd_v_gqa()) * 2 * n_ctx) as u64,
    }
}

/// Connects to `workers`, plans, loads, and links the ring.
pub fn connect_cluster(model: &Path, workers: &[String], opts: &ClusterOptions) -> Result<RemoteRing, NodeError> {
    if workers.is_empty() {
        return Err(NodeError::Request("no workers given".into()));
    }
    let file = ModelFile::open(model)?;
    let model_ref = model_ref(&file);
    let token = opts.token.as_deref().map(str::as_bytes);

    let mut links = Vec::new();
    let mut remote = Vec::new();
    for addr in workers {
        let mut link = TcpLink::connect(addr, &opts.link)?;
        client_handshake(&mut link, Role::Head, token)?;
        link.send(&Message::Describe {
            model: model_ref.clone(),
        })?;
        let caps = match link.recv()? {
            Message::Capabilities(caps) => caps,
            Message::Refused { reason } => return Err(NodeError::Request(format!("worker {addr} refused: {reason}"))),
            other => {
                return Err(NodeError::Protocol(format!(
                    "worker {addr} sent {} instead of Capabilities",
                    other.kind()
                )))
            }
        };
        if let Some(other) = caps
            .models
            .iter()
            .find(|m| m.file_name == model_ref.file_name && m.identity != model_ref.identity)
        {
            return Err(NodeError::Request(format!(
                "worker {addr} holds a different {}: its header hash {} differs from the head's {} (size {} vs {})",
                other.file_name,
                baton_proto::auth::hex(&other.identity[..6]),
                baton_proto::auth::hex(&model_ref.identity[..6]),
                other.size,
                model_ref.size,
            )));
        }
        tracing::info!(worker = %addr, memory = caps.memory, secs_per_layer = ?caps.secs_per_layer, "worker described itself");
        links.push(link);
        remote.push(RemoteWorker {
            addr: addr.clone(),
            caps,
            layers: None,
            streamed: 0,
        });
    }

    let cost = model_cost(&file, opts.n_ctx);
    let known: Vec<f32> = remote.iter().filter_map(|w| w.caps.secs_per_layer).collect();
    // A worker without the file cannot measure itself on it: assume the average.
    let fallback = if known.is_empty() {
        1e-3
    } else {
        known.iter().sum::<f32>() / known.len() as f32
    };
    let offers: Vec<NodeOffer> = remote
        .iter()
        .map(|w| NodeOffer {
            name: w.addr.clone(),
            memory: w.caps.memory,
            secs_per_layer: w.caps.secs_per_layer.unwrap_or(fallback) as f64,
        })
        .collect();
    let plan = match &opts.split {
        Some(split) => baton_plan::plan_with_split(&cost, &offers, split)?,
        None => baton_plan::partition(&cost, &offers)?,
    };
    for (name, why) in &plan.left_out {
        tracing::warn!(worker = %name, "left out of the plan: {why}");
    }

    let n = plan.stages.len();
    for (i, stage) in plan.stages.iter().enumerate() {
        let worker = &mut remote[stage.node];
        worker.layers = Some(stage.layers.clone());
        let holds = worker
            .caps
            .models
            .iter()
            .any(|m| m.identity == model_ref.identity && m.complete);
        let next = plan.stages.get(i + 1).map(|s| remote_ring_addr(&remote, s.node));
        let load = LoadPlan {
            model: model_ref.clone(),
            layer_start: stage.layers.start as u32,
            layer_end: stage.layers.end as u32,
            first: i == 0,
            last: i + 1 == n,
            n_ctx: opts.n_ctx as u32,
            next,
            stream: !holds,
            wire_f16: opts.wire_f16,
            repack: opts.repack,
        };
        let link = &mut links[stage.node];
        link.send(&Message::LoadPlan(load))?;
        if !holds {
            let span = StageSpan {
                layers: stage.layers.clone(),
                first: i == 0,
                last: i + 1 == n,
            };
            let addr = remote[stage.node].addr.clone();
            let sent = send_stage_tensors(&file, &span, link, |done, total| {
                tracing::debug!(worker = %addr, done, total, "streaming weights");
            })?;
            remote[stage.node].streamed = sent;
            tracing::info!(worker = %addr, bytes = sent, "streamed weights");
        }
    }
    for stage in &plan.stages {
        let link = &mut links[stage.node];
        match link.recv()? {
            Message::Loaded { resident, received } => {
                tracing::info!(worker = %link.peer(), resident, received, "stage ready");
            }
            Message::Refused { reason } => {
                return Err(NodeError::Request(format!(
                    "worker {} could not load: {reason}",
                    link.peer()
                )))
            }
            other => return Err(NodeError::Protocol(format!("expected Loaded, got {}", other.kind()))),
        }
    }

    // The ring: head → first stage's control link; last stage's control link → head.
    let first = plan.stages[0].node;
    let last = plan.stages[n - 1].node;
    let mut slots: Vec<Option<TcpLink>> = links.into_iter().map(Some).collect();
    let (tx, rx, idle) = if first == last {
        let (tx, rx) = slots[first].take().expect("each node appears once").split()?;
        (tx, rx, Vec::new())
    } else {
        let (tx, _) = slots[first].take().expect("each node appears once").split()?;
        let (_, rx) = slots[last].take().expect("each node appears once").split()?;
        (tx, rx, slots.into_iter().flatten().collect())
    };
    let (to_first, from_last) = (tx.counters(), rx.counters());
    Ok(RemoteRing {
        head: Head::new(Box::new(tx), Box::new(rx)),
        workers: remote,
        plan,
        to_first,
        from_last,
        _idle: idle,
    })
}

fn remote_ring_addr(remote: &[RemoteWorker], node: usize) -> String {
    remote[node].caps.ring_addr.clone()
}

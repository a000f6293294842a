//! The head forming a cluster: connect to every worker, check the protocol version and
//! the model's identity, plan from one capabilities message each (no probing round
//! trips), tell each worker its range, stream tensors to workers that lack the file,
//! and hand back a [`Head`] whose ring runs through the workers.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use baton_ggml::Device;
use baton_model::{KvTypes, ModelFile, StageConfig, StageSpan};
use baton_net::{
    client_handshake, connect, connect_by, local_link, Counters, Link, LinkCloser, LinkExt, LinkOptions, NetError, Rx,
    Tx,
};
use baton_plan::{DeviceOffer, LinkOffer, ModelCost, NodeOffer, Plan, PlanError, TpDegree};
use baton_proto::auth::identity_hash;
use baton_proto::{
    Capabilities, Control, Conversation, DeviceRange, HeldModel, LoadPlan, Message, ModelRef, Role, TpPlace,
};

use crate::error::ClusterError;
use crate::groups::{measure_link, plan_nodes, Planned};
use crate::stream::send_stage_tensors;
use baton_engine::{Head, RingEnds};
use baton_stage::probe::LinkProbe;
use baton_stage::NodeError;
use baton_stage::{run, StageWorker};
use indicatif::MultiProgress;

/// Called with a worker's address, the session it opened for this head (which the
/// head's heartbeat names, see [`Capabilities::session`]), a handle that closes its
/// control link and that link's counters (where the heartbeat records round trips).
pub type OnReached = Arc<dyn Fn(&str, u64, LinkCloser, Arc<Counters>) + Send + Sync>;

/// How the head sizes every stage's KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContextFit {
    /// [`ClusterOptions::n_ctx`] cells: a plan whose nodes cannot hold them is refused
    /// with the numbers.
    #[default]
    Exact,
    /// The most cells, up to [`ClusterOptions::n_ctx`], that the planner finds room for
    /// on the nodes: `n_ctx` itself, or a multiple of 256 per sequence below it.
    Fit,
}

/// How the head forms the cluster.
#[derive(Clone, Default)]
pub struct ClusterOptions {
    /// Cluster secret shared with every worker.
    pub token: Option<String>,
    /// Layers per worker (overrides the planner), e.g. `[12, 12]`.
    pub split: Option<Vec<usize>>,
    /// KV cells per stage (the most, with [`ContextFit::Fit`]).
    pub n_ctx: usize,
    /// Whether `n_ctx` is what every stage gets, or the most it may get.
    pub ctx_fit: ContextFit,
    /// Sequences with a region of the KV cache each (0: shared cells).
    pub n_seq: usize,
    /// Element types of every stage's cached keys and values (one setting for the
    /// ring, sent in each worker's `LoadPlan`).
    pub kv_types: KvTypes,
    /// Send hidden states between stages as f16.
    pub wire_f16: bool,
    /// Repack weights like llama.cpp's default.
    pub repack: bool,
    /// Socket settings.
    pub link: LinkOptions,
    /// Offer the head itself as the first node: it runs the first stage when the
    /// planner gives it layers.
    pub head_stage: bool,
    /// Compute threads of the head's own stage.
    pub threads: usize,
    /// Memory the head offers (default: what the machine has available).
    pub head_memory: Option<u64>,
    /// Devices of the head's own stage, in order (empty: the CPU); the planner gives
    /// each a range like a worker's.
    pub head_devices: Vec<Device>,
    /// The head's own speed on each of its devices (seconds per layer per token), when
    /// already measured (empty: measure).
    pub head_secs_per_layer: Vec<f64>,
    /// Leave out workers that cannot be reached (instead of failing), and plan over the
    /// rest; `split` then applies only if every worker answered.
    pub skip_unreachable: bool,
    /// Longest a worker may take to answer the handshake and describe itself (`None`:
    /// no limit).
    pub handshake_timeout: Option<std::time::Duration>,
    /// Told of each worker's control link as soon as the worker answers, so that a
    /// watch can close it if the worker dies or hangs while the ring forms (loading
    /// may take long, and has no timeout of its own).
    pub on_reached: Option<OnReached>,
    /// Tensor-parallel groups: workers taken in order, this many to a group, each group
    /// one pipeline stage (`Auto`: the size the planner models fastest). With groups
    /// the head runs no stage of its own.
    pub tp: TpDegree,
    /// The model, already opened by the caller (reading its header again costs tens
    /// of ms); used when its path is the one given to [`connect_cluster`].
    pub opened: Option<Arc<ModelFile>>,
}

/// A worker as the head sees it.
pub struct RemoteWorker {
    /// Address given on the command line.
    pub addr: String,
    /// What it offered.
    pub caps: Capabilities,
    /// Its layers, if the plan uses it.
    pub layers: Option<std::ops::Range<usize>>,
    /// Weight bytes the head streamed to it.
    pub streamed: u64,
    /// Weight bytes it received in all (from the head and from workers that hold the
    /// file).
    pub received: u64,
    /// Its rank and its group's size, when the plan puts it in a tensor-parallel group.
    pub tp: Option<(usize, usize)>,
    /// The head's link to it, when measured (`--tp auto`).
    pub link: Option<LinkOffer>,
}

/// A ring of remote stages, driven by its head.
pub struct RemoteRing {
    /// Drives generation around the ring, until [`take_ends`](Self::take_ends) gives
    /// the ring's ends to another driver.
    head: Option<Head>,
    /// The workers, in the order given.
    pub workers: Vec<RemoteWorker>,
    /// The plan that was applied; node 0 is the head when it was offered, the
    /// workers follow in the order given.
    pub plan: Plan,
    /// KV cells of every stage (what [`ContextFit::Fit`] found room for).
    pub n_ctx: usize,
    /// The name of every planned node, in the plan's numbering.
    pub node_names: Vec<String>,
    /// The names of every planned node's devices, in the plan's numbering.
    pub node_devices: Vec<Vec<String>>,
    /// Bytes the head sent to the first stage.
    pub to_first: Arc<Counters>,
    /// Bytes the head received from the last stage.
    pub from_last: Arc<Counters>,
    /// Workers left out because they could not be reached or refused, and why (only
    /// with `skip_unreachable`).
    pub unreachable: Vec<(String, NodeError)>,
    /// The head's measured speed on each of its devices, when it offered itself.
    pub head_secs_per_layer: Vec<f64>,
    // Control links of the middle stages stay open for the session's lifetime.
    _idle: Vec<Box<dyn Link>>,
    // The head's own stage, when it runs one.
    head_stage: Option<JoinHandle<()>>,
    // Keeps the round trip of the head's stage's link to the next stage current.
    _probe: Option<LinkProbe>,
}

impl RemoteRing {
    /// Drives the ring one request at a time; `None` once its ends went to a driver of
    /// their own ([`take_ends`](Self::take_ends)).
    pub fn head(&mut self) -> Option<&mut Head> {
        self.head.as_mut()
    }

    /// Each stage for people, in ring order: its node and layers, and where they lie
    /// on its devices (`head layers 0..11`, `10.0.0.2:7100 layers 11..24 (CUDA0
    /// 11..20, CPU 20..24)`).
    pub fn describe_stages(&self) -> Vec<String> {
        self.plan
            .stages
            .iter()
            .map(|s| {
                let node = format!(
                    "{} layers {}..{}",
                    self.node_names[s.node], s.layers.start, s.layers.end
                );
                let devices = &self.node_devices[s.node];
                match s.parts.as_slice() {
                    [part] if devices[part.device] == "CPU" => node,
                    parts => {
                        let on: Vec<String> = parts
                            .iter()
                            .map(|p| format!("{} {}..{}", devices[p.device], p.layers.start, p.layers.end))
                            .collect();
                        format!("{node} ({})", on.join(", "))
                    }
                }
            })
            .collect()
    }

    /// Gives the ring's ends to another driver (the engine); the workers' sessions and
    /// the head's own stage stay up as long as this value lives.
    pub fn take_ends(&mut self) -> Option<RingEnds> {
        self.head.take().map(Head::into_ends)
    }
}

impl Drop for RemoteRing {
    fn drop(&mut self) {
        if let Some(head) = self.head.as_mut() {
            let _ = head.shutdown();
        }
        if let Some(thread) = self.head_stage.take() {
            // A broken ring may leave the head's stage blocked on a hung worker's socket
            // for a while: it is not waited for past a second.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
            while !thread.is_finished() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            if thread.is_finished() {
                let _ = thread.join();
            }
        }
    }
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

/// Where the head keeps what it computes about model files (their content hashes).
fn head_cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join("baton");
    let _ = std::fs::create_dir_all(&dir);
    dir
}

/// Refuses a worker that holds a file of the model's name with another header hash, or
/// a file with the model's header hash but other content (when both sides know the
/// content hash: each computes it once, in the background, and keeps it).
fn check_held(
    addr: &str,
    model_ref: &ModelRef,
    own_content: Option<[u8; 32]>,
    held: &[HeldModel],
) -> Result<(), NodeError> {
    let short = |hash: &[u8; 32]| baton_proto::auth::hex(&hash[..6]);
    for other in held {
        if other.file_name == model_ref.file_name && other.identity != model_ref.identity {
            return Err(NodeError::Request(format!(
                "worker {addr} holds a different {}: its header hash {} differs from the head's {} (size {} vs {})",
                other.file_name,
                short(&other.identity),
                short(&model_ref.identity),
                other.size,
                model_ref.size,
            )));
        }
        if let (Some(theirs), Some(ours)) = (other.content, own_content) {
            if other.identity == model_ref.identity && theirs != ours {
                return Err(NodeError::Request(format!(
                    "worker {addr} holds a damaged or altered {}: same header, but its content hash {} differs from the head's {}",
                    other.file_name,
                    short(&theirs),
                    short(&ours),
                )));
            }
        }
    }
    Ok(())
}

/// What each layer and each end of the model costs in memory, for the planner.
pub fn model_cost(file: &ModelFile, n_ctx: usize, n_seq: usize, kv_types: KvTypes) -> ModelCost {
    let hp = file.hparams();
    let (no_stage_start, reused) = hp.no_stage_start();
    ModelCost {
        layer_bytes: (0..hp.n_layer).map(|l| file.layer_bytes(l)).collect(),
        layer_work_bytes: (0..hp.n_layer).map(|l| file.layer_work_bytes(l)).collect(),
        first_bytes: file.end_bytes(true, false),
        last_bytes: file.end_bytes(false, true),
        kv_bytes: (0..hp.n_layer)
            .map(|l| hp.layer_cache_bytes(l, n_ctx, n_seq, kv_types))
            .collect(),
        no_stage_start,
        reused,
    }
}

/// Connects to `workers`, plans, loads, and links the ring: `reach_all`, `plan`,
/// `load`, `link`, in that order.
pub fn connect_cluster(model: &Path, workers: &[String], opts: &ClusterOptions) -> Result<RemoteRing, ClusterError> {
    if workers.is_empty() {
        return Err(ClusterError::NoWorkers);
    }
    let file = match &opts.opened {
        Some(file) if file.path() == model => file.clone(),
        _ => ModelFile::open(model)?,
    };
    let model_ref = model_ref(&file);
    let mut reached = reach_all(workers, model, &model_ref, opts)?;
    let (planned, n_ctx) =
        plan(&file, model, &reached.workers, &reached.unreachable, opts).map_err(ClusterError::Plan)?;
    let opts = &ClusterOptions { n_ctx, ..opts.clone() };
    let head_stage = load(&file, model, &model_ref, &mut reached, &planned, opts).map_err(ClusterError::Load)?;
    let ends = link(reached.links, &planned, head_stage).map_err(ClusterError::Link)?;
    Ok(RemoteRing {
        head: Some(Head::new(RingEnds {
            tx: ends.tx,
            rx: ends.rx,
        })),
        workers: reached.workers,
        plan: planned.plan,
        n_ctx,
        node_names: planned.node_names,
        node_devices: planned.node_devices,
        to_first: ends.to_first,
        from_last: ends.from_last,
        unreachable: reached.unreachable,
        head_secs_per_layer: planned.head_secs_per_layer,
        _idle: ends.idle,
        head_stage: ends.head_stage,
        _probe: ends.probe,
    })
}

/// The workers that answered, each with its control link (in the same order), and those
/// that did not.
struct Reached {
    links: Vec<Box<dyn Link>>,
    workers: Vec<RemoteWorker>,
    unreachable: Vec<(String, NodeError)>,
}

/// Reaches every worker and checks the copy of the model it holds. One that does not
/// answer is an error, or left out with `opts.skip_unreachable`.
fn reach_all(
    workers: &[String],
    model: &Path,
    model_ref: &ModelRef,
    opts: &ClusterOptions,
) -> Result<Reached, ClusterError> {
    // Known from an earlier start (or `None`, and computed in the background for the next).
    let own_content = baton_stage::models::content_hash(model, &model_ref.identity, &head_cache_dir());
    let mut reached = Reached {
        links: Vec::new(),
        workers: Vec::new(),
        unreachable: Vec::new(),
    };
    for addr in workers {
        let (mut link, caps) = match reach(addr, model_ref, opts) {
            Ok(answered) => answered,
            Err(e) if opts.skip_unreachable => {
                tracing::warn!(worker = %addr, "left out: {e}");
                reached.unreachable.push((addr.clone(), e));
                continue;
            }
            Err(e) => return Err(ClusterError::Reach(e)),
        };
        check_held(addr, model_ref, own_content, &caps.models).map_err(ClusterError::Reach)?;
        tracing::info!(worker = %addr, devices = ?caps.devices, "worker described itself");
        if let Some(on_reached) = &opts.on_reached {
            let closer = link.closer().map_err(|e| ClusterError::Reach(e.into()))?;
            on_reached(addr, caps.session, closer, link.counters());
        }
        let measured = match opts.tp {
            TpDegree::Auto => Some(measure_link(link.as_mut(), addr).map_err(ClusterError::Reach)?),
            TpDegree::Fixed(_) => None,
        };
        reached.links.push(link);
        reached.workers.push(RemoteWorker {
            addr: addr.clone(),
            caps,
            layers: None,
            streamed: 0,
            received: 0,
            tp: None,
            link: measured,
        });
    }
    if reached.workers.is_empty() && !opts.head_stage {
        return Err(ClusterError::NoneAnswered(reached.unreachable));
    }
    Ok(reached)
}

/// Plans over the head (when offered) and the workers that answered: from their
/// memory and measured speed, or `opts.split` when every worker answered; in
/// tensor-parallel groups with `opts.tp` (see `groups.rs`). Returns the plan and the
/// KV cells of every stage: `opts.n_ctx`, or with [`ContextFit::Fit`] the most up to it
/// that a plan finds room for.
fn plan(
    file: &ModelFile,
    model: &Path,
    workers: &[RemoteWorker],
    unreachable: &[(String, NodeError)],
    opts: &ClusterOptions,
) -> Result<(Planned, usize), NodeError> {
    // Groups of workers are the stages: the head runs none of its own.
    let grouped = opts.tp != TpDegree::Fixed(1);
    let head = match opts.head_stage && !grouped {
        true => Some(head_offer(model, opts)?),
        false => None,
    };
    let known: Vec<f64> = head
        .iter()
        .flat_map(|h| h.devices.iter().map(|d| d.secs_per_layer))
        .chain(
            workers
                .iter()
                .flat_map(|w| w.caps.devices.iter().filter_map(|d| d.secs_per_layer.map(f64::from))),
        )
        .collect();
    // A worker without the file cannot measure itself on it: assume the average.
    let fallback = if known.is_empty() {
        1e-3
    } else {
        known.iter().sum::<f64>() / known.len() as f64
    };
    let offers: Vec<NodeOffer> = workers
        .iter()
        .map(|w| NodeOffer {
            name: w.addr.clone(),
            devices: w
                .caps
                .devices
                .iter()
                .map(|d| DeviceOffer {
                    name: d.name.clone(),
                    memory: d.memory,
                    secs_per_layer: d.secs_per_layer.map_or(fallback, f64::from),
                })
                .collect(),
        })
        .collect();
    let split = opts.split.as_deref().filter(|_| unreachable.is_empty());
    let plan_for = |n_ctx: usize| {
        let cost = model_cost(file, n_ctx, opts.n_seq, opts.kv_types);
        plan_nodes(file, cost, head.clone(), &offers, workers, split, opts.tp)
    };
    let n_ctx = match opts.ctx_fit {
        ContextFit::Exact => opts.n_ctx,
        // When not even the smallest fits, the context asked for fails with the numbers.
        ContextFit::Fit => {
            baton_plan::largest_context(opts.n_ctx, CONTEXT_STEP * opts.n_seq.max(1), |n| plan_for(n).is_ok())
                .unwrap_or(opts.n_ctx)
        }
    };
    let planned = plan_for(n_ctx).map_err(|e| context_refused(e, n_ctx, opts, head.as_ref(), &offers))?;
    if n_ctx < opts.n_ctx {
        tracing::info!(
            n_ctx,
            most = opts.n_ctx,
            "the nodes' memory holds a KV cache of {n_ctx} cells"
        );
    }
    tracing::info!("plan: {}", planned.plan.why);
    for (name, why) in &planned.plan.left_out {
        tracing::warn!(node = %name, "left out of the plan: {why}");
    }
    Ok((planned, n_ctx))
}

/// Cells per sequence a fitted KV cache is a multiple of (llama.cpp pads its cache to
/// 256 cells, and attention looks at 256 at a time).
pub const CONTEXT_STEP: usize = 256;

/// A plan that found no room: when memory is what is missing, the error also says
/// which context was asked for, what its KV cache takes, and what each node offers.
fn context_refused(
    e: NodeError,
    n_ctx: usize,
    opts: &ClusterOptions,
    head: Option<&NodeOffer>,
    offers: &[NodeOffer],
) -> NodeError {
    match e {
        NodeError::Plan(PlanError::NotEnoughMemory {
            needed,
            offered,
            detail,
        }) => {
            let nodes: Vec<String> = head
                .into_iter()
                .chain(offers)
                .map(|o| format!("{} {}", o.name, mib(o.memory())))
                .collect();
            let detail = format!(
                "{detail}; a KV cache of {n_ctx} cells ({}/{}) is part of that; offered by node: {}",
                opts.kv_types.k,
                opts.kv_types.v,
                nodes.join(", ")
            );
            NodeError::Plan(PlanError::NotEnoughMemory {
                needed,
                offered,
                detail,
            })
        }
        other => other,
    }
}

/// `bytes` in MiB, for people.
fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / f64::from(1 << 20))
}

/// What the head offers for its own stage: each of its devices with its memory and
/// speed (measured once per distinct device, unless known from an earlier ring: the
/// CPU named twice is one speed).
fn head_offer(model: &Path, opts: &ClusterOptions) -> Result<NodeOffer, NodeError> {
    let devices = baton_stage::or_cpu(&opts.head_devices);
    let speeds = match opts.head_secs_per_layer.len() == devices.len() {
        true => opts.head_secs_per_layer.clone(),
        false => {
            let mut measured: Vec<(Device, f64)> = Vec::new();
            for &device in &devices {
                if !measured.iter().any(|(d, _)| *d == device) {
                    let secs = baton_stage::speed::measure(model, opts.threads, device)?;
                    measured.push((device, f64::from(secs)));
                }
            }
            devices
                .iter()
                .map(|d| measured.iter().find(|(m, _)| m == d).map_or(0.0, |(_, secs)| *secs))
                .collect()
        }
    };
    let memory = baton_stage::device_memory(&devices, opts.head_memory);
    Ok(NodeOffer {
        name: "head".into(),
        devices: devices
            .iter()
            .zip(memory)
            .zip(speeds)
            .map(|((device, memory), secs_per_layer)| DeviceOffer {
                name: device.name(),
                memory,
                secs_per_layer,
            })
            .collect(),
    })
}

/// The head's own stage, loaded, its link to the second stage (when there is one) and
/// the probe of that link.
struct HeadStage {
    worker: StageWorker,
    next: Option<Box<dyn Link>>,
    probe: Option<LinkProbe>,
}

/// Releases the workers the plan leaves out, tells the others their ranges (streaming
/// tensors to those that lack them), loads the head's own stage meanwhile, and waits
/// until every worker has loaded and linked to the next stage.
fn load(
    file: &ModelFile,
    model: &Path,
    model_ref: &ModelRef,
    reached: &mut Reached,
    planned: &Planned,
    opts: &ClusterOptions,
) -> Result<Option<HeadStage>, NodeError> {
    let stages = &planned.plan.stages;
    let n = stages.len();
    // Workers the plan leaves out are released now, not held for the session.
    for (w, link) in reached.links.iter_mut().enumerate() {
        if !stages.iter().any(|s| planned.members(s.node).contains(&w)) {
            link.send(Message::Shutdown)?;
        }
    }
    let nexts = planned.nexts(&reached.workers);
    // Every worker gets its plan before any tensor is streamed: the members of a group
    // link with each other as soon as they have theirs.
    let mut streams = Vec::new();
    // Workers of the plan that hold the whole file: they send part of the tensors to
    // those that lack it, beside the head.
    let mut holders = Vec::new();
    for (i, stage) in stages.iter().enumerate() {
        let members = planned.members(stage.node);
        let addrs: Vec<String> = members
            .iter()
            .map(|&w| reached.workers[w].caps.ring_addr.clone())
            .collect();
        let group = (members.len() > 1).then(random_group);
        let span = StageSpan {
            layers: stage.layers.clone(),
            first: i == 0,
            last: i + 1 == n,
        };
        for (rank, &w) in members.iter().enumerate() {
            let worker = &mut reached.workers[w];
            worker.layers = Some(stage.layers.clone());
            worker.tp = group.map(|_| (rank, members.len()));
            let holds = worker
                .caps
                .models
                .iter()
                .any(|m| m.identity == model_ref.identity && m.complete);
            let place = Place {
                span: &span,
                rank,
                next: nexts[i].as_ref(),
                group: group.map(|group| (group, &addrs)),
            };
            let load = load_plan(model_ref, stage, worker, &place, holds, opts);
            reached.links[w].send(Message::LoadPlan(Box::new(load)))?;
            if !holds {
                streams.push((w, span.clone()));
            } else {
                holders.push(worker.caps.ring_addr.clone());
            }
        }
    }
    // Workers that lack the file get their tensors at once, each over its own link
    // (one thread per worker), while the head loads its own stage (always the first
    // when it has one) and links it to the second.
    let addrs: Vec<String> = reached.workers.iter().map(|w| w.addr.clone()).collect();
    let bars = MultiProgress::new();
    let cache = head_cache_dir();
    let (head_stage, streamed) = std::thread::scope(|scope| {
        let sending: Vec<_> = reached
            .links
            .iter_mut()
            .enumerate()
            .filter_map(|(w, link)| {
                let (_, span) = streams.iter().find(|(s, _)| *s == w)?;
                let (addr, bars, holders, cache) = (&addrs[w], &bars, &holders, &cache);
                Some((
                    w,
                    scope.spawn(move || send_stage_tensors(file, span, link.as_mut(), addr, holders, bars, cache)),
                ))
            })
            .collect();
        let head_stage = load_head_stage(model, planned, opts, &nexts);
        let streamed: Vec<(usize, Result<u64, NodeError>)> = sending
            .into_iter()
            .map(|(w, thread)| {
                let sent = thread
                    .join()
                    .unwrap_or_else(|_| Err(NodeError::Protocol("the thread streaming weights panicked".into())));
                (w, sent)
            })
            .collect();
        (head_stage, streamed)
    });
    for (w, sent) in streamed {
        let worker = &mut reached.workers[w];
        worker.streamed = sent?;
        tracing::info!(worker = %worker.addr, bytes = worker.streamed, "streamed weights");
    }
    let head_stage = head_stage?;

    await_loaded(reached, planned)?;
    Ok(head_stage)
}

/// Where one worker sits in the plan: its stage's span, its rank in the stage's group,
/// the stage after it (address and session), and its group (number and members).
struct Place<'a> {
    span: &'a StageSpan,
    rank: usize,
    next: Option<&'a (String, u64)>,
    group: Option<(u64, &'a Vec<String>)>,
}

/// The `LoadPlan` of the worker at `place`, holding the file (`holds`) or to be streamed.
fn load_plan(
    model_ref: &ModelRef,
    stage: &baton_plan::PlannedStage,
    worker: &RemoteWorker,
    place: &Place<'_>,
    holds: bool,
    opts: &ClusterOptions,
) -> LoadPlan {
    LoadPlan {
        model: model_ref.clone(),
        layer_start: stage.layers.start as u32,
        layer_end: stage.layers.end as u32,
        first: place.span.first,
        last: place.span.last,
        n_ctx: opts.n_ctx as u32,
        n_seq: opts.n_seq as u32,
        // Only member 0 sits in the ring.
        next: place.next.filter(|_| place.rank == 0).map(|(addr, _)| addr.clone()),
        next_session: place
            .next
            .filter(|_| place.rank == 0)
            .map_or(0, |&(_, session)| session),
        stream: !holds,
        wire_f16: opts.wire_f16,
        repack: opts.repack,
        // A group's members compute on the CPU; a lone worker's devices take the ranges
        // the plan gave them.
        devices: match place.group {
            Some(_) => Vec::new(),
            None => stage
                .parts
                .iter()
                .map(|part| DeviceRange {
                    device: worker.caps.devices[part.device].name.clone(),
                    layer_end: part.layers.end as u32,
                })
                .collect(),
        },
        tp: place.group.map(|(group, members)| TpPlace {
            group,
            rank: place.rank as u32,
            members: members.clone(),
        }),
        cache_type_k: opts.kv_types.k.name().into(),
        cache_type_v: opts.kv_types.v.name().into(),
    }
}

/// Waits for every worker of the plan to say its stage is loaded and linked.
fn await_loaded(reached: &mut Reached, planned: &Planned) -> Result<(), NodeError> {
    for &w in planned.plan.stages.iter().flat_map(|stage| planned.members(stage.node)) {
        let link = &mut reached.links[w];
        match link.recv_as::<Control>()? {
            Control::Loaded { resident, received } => {
                tracing::info!(worker = %link.peer(), resident, received, "stage ready");
                reached.workers[w].received = received;
            }
            Control::Refused { code, reason } => {
                return Err(NodeError::Refused {
                    worker: link.peer().to_string(),
                    code,
                    reason,
                })
            }
            other => return Err(NodeError::Protocol(format!("expected Loaded, got {}", other.kind()))),
        }
    }
    Ok(())
}

/// Loads the head's own stage when the plan gives it one (always the first), and links
/// it to the second stage.
fn load_head_stage(
    model: &Path,
    planned: &Planned,
    opts: &ClusterOptions,
    nexts: &[Option<(String, u64)>],
) -> Result<Option<HeadStage>, NodeError> {
    let stages = &planned.plan.stages;
    let n = stages.len();
    Ok(match stages.first() {
        Some(stage) if planned.worker_of(stage.node).is_none() => {
            let span = StageSpan {
                layers: stage.layers.clone(),
                first: true,
                last: n == 1,
            };
            let config = StageConfig {
                n_ctx: opts.n_ctx,
                n_threads: opts.threads,
                repack: opts.repack,
                n_seq: opts.n_seq,
                kv_types: opts.kv_types,
                n_ubatch: baton_model::DEFAULT_UBATCH,
            };
            let devices = baton_stage::or_cpu(&opts.head_devices);
            let parts = stage
                .parts
                .iter()
                .map(|p| (p.layers.clone(), devices[p.device]))
                .collect();
            let loaded =
                baton_stage::load_chain(&ModelFile::open(model)?, baton_stage::part_spans(&span, parts), &config)?;
            tracing::info!(layers = ?stage.layers, resident = loaded.resident_bytes(), "head stage ready");
            let token = opts.token.as_deref().map(str::as_bytes);
            let (next, probe) = match nexts.first() {
                Some(Some((next, session))) => {
                    let mut down = dial(next, &opts.link, opts.handshake_timeout)?;
                    client_handshake(down.as_mut(), Role::Ring, token)?;
                    down.send(Message::JoinRing { session: *session })?;
                    down.set_deadline(None)?;
                    let probe = LinkProbe::start(next, &opts.link, token, down.counters());
                    (Some(down), Some(probe))
                }
                _ => (None, None),
            };
            Some(HeadStage {
                worker: StageWorker::new(loaded).with_wire_f16(opts.wire_f16),
                next,
                probe,
            })
        }
        _ => None,
    })
}

/// The head's two ends of the ring, what they count, the head's own stage thread when
/// it runs one, and the control links that must stay open.
struct Linked {
    tx: Box<dyn Tx>,
    rx: Box<dyn Rx>,
    to_first: Arc<Counters>,
    from_last: Arc<Counters>,
    head_stage: Option<JoinHandle<()>>,
    /// Control links of the middle stages: a worker's session lives as long as its
    /// control link.
    idle: Vec<Box<dyn Link>>,
    /// The probe of the head's stage's link to the next stage.
    probe: Option<LinkProbe>,
}

/// Closes the ring: the head sends on the first stage's link (its own stage's, or the
/// first worker's control link) and receives on the last worker's control link (or
/// from its own stage, when that holds every layer).
fn link(links: Vec<Box<dyn Link>>, planned: &Planned, head_stage: Option<HeadStage>) -> Result<Linked, NodeError> {
    let stages = &planned.plan.stages;
    let last = stages[stages.len() - 1].node;
    let mut slots: Vec<Option<Box<dyn Link>>> = links.into_iter().map(Some).collect();
    let mut take = |node: usize| {
        let link = planned.worker_of(node).and_then(|w| slots[w].take());
        link.ok_or_else(|| NodeError::Protocol("a worker appears twice in the plan".into()))
    };
    let mut ends = match head_stage {
        Some(HeadStage { worker, next, probe }) => {
            let (head_tx, stage_rx) = local_link("head stage");
            let (rx, stage_tx, counted): (Box<dyn Rx>, Box<dyn Tx>, _) = match next {
                // The head holds every layer: its stage answers it directly.
                None => {
                    let (stage_tx, head_rx) = local_link("head");
                    (Box::new(head_rx), Box::new(stage_tx), None)
                }
                Some(down) => {
                    let (down_tx, _) = down.split()?;
                    let (_, rx) = take(last)?.split()?;
                    let counted = (down_tx.counters(), rx.counters());
                    (rx, down_tx, Some(counted))
                }
            };
            let (to_first, from_last) = counted.unwrap_or_default();
            Linked {
                tx: Box::new(head_tx),
                rx,
                to_first,
                from_last,
                head_stage: Some(spawn_stage(worker, stage_rx, stage_tx)?),
                idle: Vec::new(),
                probe,
            }
        }
        None => {
            let first = stages[0].node;
            let (tx, rx) = if first == last {
                take(first)?.split()?
            } else {
                let (tx, _) = take(first)?.split()?;
                let (_, rx) = take(last)?.split()?;
                (tx, rx)
            };
            Linked {
                to_first: tx.counters(),
                from_last: rx.counters(),
                tx,
                rx,
                head_stage: None,
                idle: Vec::new(),
                probe: None,
            }
        }
    };
    ends.idle = slots.into_iter().flatten().collect();
    Ok(ends)
}

/// Connects to the worker at `addr`, authenticates, and asks it to describe itself.
fn reach(addr: &str, model_ref: &ModelRef, opts: &ClusterOptions) -> Result<(Box<dyn Link>, Capabilities), NodeError> {
    let link_opts = LinkOptions {
        read_timeout: opts.handshake_timeout,
        ..opts.link.clone()
    };
    let mut link = dial(addr, &link_opts, opts.handshake_timeout).map_err(|e| match e {
        NetError::Unreachable { reason, .. } => NodeError::Unreachable {
            worker: addr.to_string(),
            reason,
        },
        other => other.into(),
    })?;
    client_handshake(link.as_mut(), Role::Head, opts.token.as_deref().map(str::as_bytes))?;
    link.set_deadline(None)?;
    link.send(Message::Describe {
        model: model_ref.clone(),
    })?;
    let caps = match link.recv_as::<Control>()? {
        Control::Capabilities(caps) => caps,
        Control::Refused { code, reason } => {
            return Err(NodeError::Refused {
                worker: addr.to_string(),
                code,
                reason,
            })
        }
        other => {
            return Err(NodeError::Protocol(format!(
                "worker {addr} sent {} instead of Capabilities",
                other.kind()
            )))
        }
    };
    // Loading may take long; from here on the heartbeat watches the worker.
    link.set_read_timeout(opts.link.read_timeout)?;
    Ok((link, caps))
}

/// A random name for a tensor-parallel group of this ring (its members refuse links
/// that name another).
fn random_group() -> u64 {
    let nonce = baton_proto::auth::new_nonce();
    u64::from_le_bytes(nonce[..8].try_into().expect("8 bytes"))
}

/// Connects to `addr`; with a handshake timeout, the connection, TLS and the baton
/// handshake that follows must all be done within it (the caller clears the deadline
/// after the handshake), so a peer cannot stall the head by answering a byte at a time.
fn dial(
    addr: &str,
    link: &LinkOptions,
    handshake_timeout: Option<std::time::Duration>,
) -> Result<Box<dyn Link>, NetError> {
    match handshake_timeout {
        Some(timeout) => connect_by(addr, link, std::time::Instant::now() + timeout),
        None => connect(addr, link),
    }
}

/// Runs the head's own stage on a thread of its own, like a worker would.
fn spawn_stage(worker: StageWorker, rx: impl Rx + 'static, tx: impl Tx + 'static) -> Result<JoinHandle<()>, NodeError> {
    std::thread::Builder::new()
        .name("head-stage".into())
        .spawn(move || match run(worker, rx, tx) {
            Ok(()) | Err(NodeError::Net(NetError::Closed { .. })) => {}
            Err(e) => tracing::warn!("the head's stage stopped: {e}"),
        })
        .map_err(|e| NodeError::Protocol(format!("cannot start the head's stage thread: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_with_another_or_a_damaged_copy_are_refused() {
        let model = ModelRef {
            file_name: "m.gguf".into(),
            identity: [1; 32],
            size: 100,
        };
        let held = |name: &str, identity: u8, content: Option<u8>| HeldModel {
            file_name: name.into(),
            identity: [identity; 32],
            size: 100,
            complete: true,
            content: content.map(|c| [c; 32]),
        };
        let check = |own: Option<u8>, worker: HeldModel| {
            check_held("w:1", &model, own.map(|c| [c; 32]), &[worker]).map_err(|e| e.to_string())
        };
        assert!(check(Some(5), held("m.gguf", 1, Some(5))).is_ok());
        assert!(
            check(None, held("m.gguf", 1, Some(5))).is_ok(),
            "the head's hash is not known yet"
        );
        assert!(
            check(Some(5), held("m.gguf", 1, None)).is_ok(),
            "the worker's hash is not known yet"
        );
        assert!(check(Some(5), held("other.gguf", 2, Some(6))).is_ok(), "another model");
        let err = check(Some(5), held("m.gguf", 2, None)).unwrap_err();
        assert!(err.contains("holds a different m.gguf") && err.contains("w:1"), "{err}");
        let err = check(Some(5), held("copy.gguf", 1, Some(6))).unwrap_err();
        assert!(err.contains("damaged or altered copy.gguf"), "{err}");
    }

    #[test]
    fn the_step_that_failed_is_its_own_variant() {
        let gemma = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../models/gemma-3-270m-q4_k_m.gguf"
        ));
        let opts = ClusterOptions::default();
        // Nothing listens on port 1 of loopback.
        let closed = vec!["127.0.0.1:1".to_string()];
        assert!(matches!(
            connect_cluster(gemma, &[], &opts),
            Err(ClusterError::NoWorkers)
        ));
        let missing = Path::new("/nonexistent/baton/model.gguf");
        assert!(matches!(
            connect_cluster(missing, &closed, &opts),
            Err(ClusterError::Model(_))
        ));

        let err = connect_cluster(gemma, &closed, &opts).err().expect("unreachable");
        assert!(
            matches!(&err, ClusterError::Reach(NodeError::Unreachable { worker, .. }) if worker == "127.0.0.1:1"),
            "{err:?}"
        );
        let skipping = ClusterOptions {
            skip_unreachable: true,
            ..ClusterOptions::default()
        };
        let err = connect_cluster(gemma, &closed, &skipping).err().expect("none answered");
        assert!(
            matches!(&err, ClusterError::NoneAnswered(left) if left.len() == 1),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .starts_with("no worker answered (127.0.0.1:1: worker 127.0.0.1:1 could not be reached"),
            "{err}"
        );
    }
}

//! `baton worker`: answers one head per model at once (a server of several models plans
//! each of them over the same workers). For each head it describes itself, loads the
//! layer range it is told to from its own copy of the model (or receives just those
//! tensors once), links into that head's ring, and runs the stage until the head goes
//! away.
//!
//! Every connection runs on its own thread. Anything malformed, unauthenticated or
//! out of place ends that connection with one log line; the listener keeps serving.
//!
//! The head watches each worker over a heartbeat connection of its own (`Ping` /
//! `Pong`), answered here on a thread apart from the stage, so a busy stage still
//! answers. The watch goes both ways: when the head's pings stop (it died, hung, or gave
//! up on this ring after losing another node), the worker shuts its session's sockets,
//! which ends the session wherever it was blocked, and the model is free for the next
//! head.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use baton_ggml::Device;
use baton_model::{CacheType, KvTypes, ModelFile, Stage, StageChain, StageConfig, StageGroup, StageSpan};
use baton_net::{
    client_handshake, connect_by, refuse_unexpected_auth, Link, LinkCloser, LinkOptions, Listener, NetError,
};
use baton_proto::{Capabilities, Control, DeviceCaps, DeviceRange, Heartbeat, LoadPlan, Message, RefusalCode, Role};

use crate::error::{TurnedAway, WorkerError};
use crate::group::{form_mesh, Arrived, Mesh};
use crate::receive::{check_stage_complete, receive_stage_tensors, serve_fetch, Recording};
pub(crate) use baton_stage::gate::ConnSlot;
use baton_stage::gate::{refuse, Admitted, Gate, GateConfig};
use baton_stage::models::ModelDir;
use baton_stage::probe::LinkProbe;
use baton_stage::tp_net::{serve_member, MeshCollective, Peer, RemoteMember};
use baton_stage::NodeError;
use baton_stage::{run, StageWorker};

/// How a worker is set up.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Address to listen on (`host:port`, or `unix:/path` for a Unix-domain socket).
    pub listen: String,
    /// Directory of GGUF files (and baton's cache of streamed tensors).
    pub models: PathBuf,
    /// Cluster secret; `None` accepts any peer (loopback or `--insecure` only). At least
    /// [`MIN_TOKEN_LEN`](baton_proto::auth::MIN_TOKEN_LEN) bytes.
    pub token: Option<String>,
    /// Compute threads.
    pub threads: usize,
    /// Memory offered; `None`: what the machine has available.
    pub memory: Option<u64>,
    /// Address other stages should use to reach this worker (default: the address the
    /// head reached it at).
    pub advertise: Option<String>,
    /// Socket settings.
    pub link: LinkOptions,
    /// Longest a peer may take to complete the handshake, TLS included: a deadline for
    /// the whole of it, however the peer spaces its bytes.
    pub handshake_timeout: Duration,
    /// Most authenticated connections served at once (heads, ring links, heartbeats),
    /// and most connections in their handshake at once (see `admission.rs`).
    pub max_connections: usize,
    /// Most connections in their handshake at once from one source (an IPv4 address,
    /// an IPv6 /64).
    pub max_handshakes_per_source: usize,
    /// The devices the worker's stage computes on (weights, KV cache and compute
    /// there), in this order: each is offered to the head with its memory and speed,
    /// the plan gives each its layers (an even split when the plan names none), and
    /// the hidden state passes from one to the next in memory.
    pub devices: Vec<Device>,
}

/// A bound, not yet serving, worker.
pub struct Worker {
    listener: Listener,
    shared: Arc<Shared>,
}

/// Most heads a worker serves at once, one per model: a server of several models
/// plans each of them over the same workers.
pub const MAX_SESSIONS: usize = 8;

pub(crate) struct Shared {
    pub(crate) config: WorkerConfig,
    models: ModelDir,
    /// Which connections are served (handshakes and authenticated ones).
    gate: Arc<Gate>,
    /// Told to leave the cluster: new heads are refused, and the heads' next heartbeats
    /// are answered `Leaving` (see [`Leave`]).
    leaving: AtomicBool,
    /// The head sessions now running, at most one per model.
    sessions: Mutex<Vec<Session>>,
    /// Ring links from previous stages, each for the session its `JoinRing` names,
    /// until that session takes it.
    upstreams: Mutex<Vec<Upstream>>,
    upstream_ready: Condvar,
    /// Links other members of a tensor-parallel group dialed, until the session takes
    /// them (see `group.rs`).
    pub(crate) members: Mutex<Vec<Arrived>>,
    pub(crate) members_ready: Condvar,
}

/// One head's session.
struct Session {
    /// Random, so that only the head this session serves (told it in `Capabilities`)
    /// can name it in its heartbeat and its ring links; 0 is never a session.
    id: u64,
    /// The model the head described: another head for the same model is refused.
    model: Option<[u8; 32]>,
    /// Bytes the session's stage holds, once loaded: memory the next head is not
    /// offered.
    resident: u64,
    /// The session's control link and the member links it dialed or took.
    closers: Vec<LinkCloser>,
    /// The latest upstream (ring) link's closer.
    upstream: Option<LinkCloser>,
    aborted: bool,
}

/// A ring link waiting for its session.
struct Upstream {
    session: u64,
    link: Box<dyn Link>,
    slot: ConnSlot,
}

/// A head's session; dropping it (the session ended, or its thread panicked) ends its
/// bookkeeping. Before this was a guard, a panic while a head was served left every
/// later head refused as "another head".
struct HeadSlot<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for HeadSlot<'_> {
    fn drop(&mut self) {
        self.shared.sessions().retain(|s| s.id != self.id);
        self.shared.upstreams().retain(|u| u.session != self.id);
    }
}

impl Shared {
    fn sessions(&self) -> MutexGuard<'_, Vec<Session>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn upstreams(&self) -> MutexGuard<'_, Vec<Upstream>> {
        self.upstreams.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens a session for a head whose control link `control` closes, unless the
    /// worker serves [`MAX_SESSIONS`] heads already (the reason).
    fn begin_session(&self, control: Option<LinkCloser>) -> Result<HeadSlot<'_>, TurnedAway> {
        let mut sessions = self.sessions();
        if sessions.len() >= MAX_SESSIONS {
            return Err(TurnedAway::SessionsFull);
        }
        let id = loop {
            let nonce = baton_proto::auth::new_nonce();
            let id = u64::from_le_bytes(nonce[..8].try_into().expect("8 bytes"));
            if id != 0 && sessions.iter().all(|s| s.id != id) {
                break id;
            }
        };
        sessions.push(Session {
            id,
            model: None,
            resident: 0,
            closers: control.into_iter().collect(),
            upstream: None,
            aborted: false,
        });
        Ok(HeadSlot { shared: self, id })
    }

    /// Gives session `id` the model `identity`, unless another head's session has it
    /// (a head that re-forms its ring ends its old session first).
    fn claim_model(&self, id: u64, identity: &[u8; 32]) -> bool {
        let mut sessions = self.sessions();
        if sessions
            .iter()
            .any(|s| s.id != id && s.model.as_ref() == Some(identity))
        {
            return false;
        }
        if let Some(session) = sessions.iter_mut().find(|s| s.id == id) {
            session.model = Some(*identity);
        }
        true
    }

    /// Runs `f` on session `id`, if it runs.
    fn with_session<R>(&self, id: u64, f: impl FnOnce(&mut Session) -> R) -> Option<R> {
        self.sessions().iter_mut().find(|s| s.id == id).map(f)
    }

    /// Bytes the stages of the sessions other than `id` hold.
    fn held_by_others(&self, id: u64) -> u64 {
        self.sessions()
            .iter()
            .filter(|s| s.id != id)
            .fold(0, |sum: u64, s| sum.saturating_add(s.resident))
    }

    /// Memory offered to session `id`, per device: with `--memory`, what the other
    /// sessions' stages leave of it (without, the free memory the system reports
    /// already counts them).
    fn memory_for(&self, id: u64, devices: &[Device]) -> Vec<u64> {
        let limit = self.config.memory.map(|m| m.saturating_sub(self.held_by_others(id)));
        baton_stage::device_memory(devices, limit)
    }

    /// Adds a link that ending session `id` must close.
    pub(crate) fn attach(&self, id: u64, closer: Option<LinkCloser>) {
        self.with_session(id, |s| s.closers.extend(closer));
    }

    /// Ends session `id` if it still runs: closes its links, so whatever it waits on
    /// returns an error and it unwinds.
    fn abort_session(&self, id: u64) -> bool {
        let found = self.with_session(id, |session| {
            session.aborted = true;
            for closer in session.closers.drain(..).chain(session.upstream.take()) {
                closer.close();
            }
        });
        if found.is_none() {
            return false;
        }
        self.upstreams().retain(|u| u.session != id);
        // A session still waiting for its upstream (or its group's members) wakes up
        // and finds it never came.
        self.upstream_ready.notify_all();
        self.members_ready.notify_all();
        true
    }

    pub(crate) fn is_aborted(&self, id: u64) -> bool {
        self.with_session(id, |s| s.aborted).unwrap_or(false)
    }

    /// A link to another worker as `role`, authenticated, its handshake done within
    /// the handshake timeout.
    fn dial(&self, addr: &str, role: Role) -> Result<Box<dyn Link>, NodeError> {
        let deadline = Instant::now() + self.config.handshake_timeout;
        let mut link = connect_by(addr, &self.config.link, deadline)?;
        client_handshake(link.as_mut(), role, self.config.token.as_deref().map(str::as_bytes))?;
        link.set_deadline(None)?;
        Ok(link)
    }

    /// Whether `id` is a session now running.
    fn is_current(&self, id: u64) -> bool {
        id != 0 && self.with_session(id, |_| ()).is_some()
    }

    /// Keeps a ring link until session `session` takes it ([`wait_upstream`]); a newer
    /// link for the same session replaces an older one, so replaced links keep no
    /// socket open.
    fn arrive_upstream(
        &self,
        session: u64,
        link: Box<dyn Link>,
        closer: Option<LinkCloser>,
        slot: ConnSlot,
    ) -> Result<(), (Box<dyn Link>, TurnedAway)> {
        if self.with_session(session, |s| s.upstream = closer).is_none() {
            return Err((link, TurnedAway::NoSession(session)));
        }
        let mut upstreams = self.upstreams();
        upstreams.retain(|u| u.session != session);
        upstreams.push(Upstream { session, link, slot });
        self.upstream_ready.notify_all();
        Ok(())
    }
}

impl Worker {
    /// Binds the listening socket and opens the models directory. An empty or short
    /// token is refused.
    pub fn bind(config: WorkerConfig) -> Result<Worker, WorkerError> {
        let listener = Listener::bind(&config.listen).map_err(WorkerError::Bind)?;
        Worker::on(listener, config)
    }

    /// A worker serving on `listener`, bound already (a worker that joins with an
    /// invite binds first: the head is told its port before it has a token).
    pub fn on(listener: Listener, config: WorkerConfig) -> Result<Worker, WorkerError> {
        if let Some(token) = &config.token {
            baton_proto::auth::check_token(token.as_bytes())?;
        }
        let models = ModelDir::new(&config.models).map_err(WorkerError::Models)?;
        let gate = Gate::new(GateConfig {
            token: config.token.clone(),
            link: config.link.clone(),
            handshake_timeout: config.handshake_timeout,
            max_connections: config.max_connections,
            per_source: config.max_handshakes_per_source,
        });
        let shared = Arc::new(Shared {
            config,
            models,
            gate,
            leaving: AtomicBool::new(false),
            sessions: Mutex::new(Vec::new()),
            upstreams: Mutex::new(Vec::new()),
            upstream_ready: Condvar::new(),
            members: Mutex::new(Vec::new()),
            members_ready: Condvar::new(),
        });
        Ok(Worker { listener, shared })
    }

    /// The address actually bound, as peers dial it (port 0 resolved, socket path
    /// absolute).
    pub fn local_addr(&self) -> &str {
        self.listener.local_addr()
    }

    /// A handle that tells this worker to leave the cluster.
    pub fn leave_handle(&self) -> Leave {
        Leave(self.shared.clone())
    }

    /// Serves connections until the process ends.
    pub fn serve(self) {
        loop {
            let incoming = match self.listener.accept() {
                Ok(incoming) => incoming,
                Err(e) => {
                    // Out of file descriptors, most likely: wait rather than spin.
                    tracing::debug!("accepting a connection failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            let peer = incoming.peer().to_string();
            let admitted = match self.shared.gate.accept(incoming) {
                Ok(admitted) => admitted,
                Err(why) => {
                    tracing::warn!(%peer, "{why}");
                    continue;
                }
            };
            let shared = self.shared.clone();
            let spawned = std::thread::Builder::new()
                .name("conn".into())
                .spawn(move || handle(&shared, admitted, &peer));
            if spawned.is_err() {
                // The slot went down with the closure.
                tracing::warn!("dropping a connection: cannot start a thread for it");
            }
        }
    }
}

/// Makes a worker leave its cluster without failing a request: it refuses new heads,
/// and answers the running head's next heartbeat with `Refused { Leaving }`, which the
/// head takes as the worker lost: it forms a new ring without it and replays its
/// running requests there (the same text, as after any loss).
pub struct Leave(Arc<Shared>);

impl Leave {
    /// Starts leaving, and waits until no head session runs here (the head has formed
    /// its ring without this worker), at most `timeout`; false if one still runs.
    pub fn drain(&self, timeout: Duration) -> bool {
        self.0.leaving.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + timeout;
        while !self.0.sessions().is_empty() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        true
    }
}

/// What a leaving worker tells a head or a heartbeat.
const LEAVING: &str = "this worker is leaving the cluster";

/// Serves one connection: its handshake, under one deadline, then its role.
fn handle(shared: &Shared, admitted: Admitted, peer: &str) {
    match serve_connection(shared, admitted) {
        Ok(()) => tracing::info!(%peer, "connection finished"),
        Err(e) => tracing::warn!(%peer, "dropping connection: {e}"),
    }
}

fn serve_connection(shared: &Shared, admitted: Admitted) -> Result<(), NodeError> {
    let local = admitted.local_addr().to_string();
    let (mut link, role, conn) = admitted.handshake()?;
    // A handle that can close this connection from another thread.
    let closer = link.closer().ok();
    match role {
        Role::Head => {
            if shared.leaving.load(Ordering::SeqCst) {
                refuse(link.as_mut(), RefusalCode::Leaving, LEAVING.into());
                return Err(NodeError::Request(format!("a head connected: {LEAVING}")));
            }
            let head = match shared.begin_session(closer) {
                Ok(head) => head,
                Err(why) => return Err(why.refuse(link.as_mut())),
            };
            session(shared, link, head, &local)
        }
        Role::Ring => {
            // The first frame (within the handshake's read timeout) names the session
            // whose ring the link belongs to.
            let session = match link.recv()? {
                Message::JoinRing { session } => session,
                other => {
                    let reason = format!("{} where a ring link's JoinRing was due", other.kind());
                    refuse(link.as_mut(), RefusalCode::BadRequest, reason.clone());
                    return Err(NodeError::Protocol(reason));
                }
            };
            link.set_read_timeout(None)?;
            shared
                .arrive_upstream(session, link, closer, conn)
                .map_err(|(mut link, why)| why.refuse(link.as_mut()))
        }
        Role::Heartbeat => heartbeat(shared, link),
        Role::Member => crate::group::accept_member(shared, link, closer, conn),
        Role::Fetch => {
            // Chunks go out as fast as the peer takes them; a stalled peer is dropped.
            link.set_read_timeout(Some(Duration::from_secs(60)))?;
            serve_fetch(&shared.models, link.as_mut())
        }
        Role::Worker => {
            let reason = "workers do not connect to workers as workers";
            refuse(link.as_mut(), RefusalCode::BadRequest, reason.into());
            Err(NodeError::Request("a peer announced itself as a worker".into()))
        }
    }
}

/// Answers the head's pings. When they stop for longer than the head said they might
/// (or the connection closes), the session this heartbeat watches is ended.
fn heartbeat(shared: &Shared, mut link: Box<dyn Link>) -> Result<(), NodeError> {
    // The session this heartbeat watches: the one its first `Ping` names, if that one
    // is running. Issue 16: it used to be whichever session ran when the heartbeat
    // connected, so a probe (or a head that was refused) ended another head's session
    // when it hung up.
    let mut watched: Option<Option<u64>> = None;
    let why = loop {
        let msg = link.recv().map(|msg| (msg.kind(), Heartbeat::try_from(msg)));
        match msg {
            Ok((_, Ok(Heartbeat::Ping { .. }))) if shared.leaving.load(Ordering::SeqCst) => {
                refuse(link.as_mut(), RefusalCode::Leaving, LEAVING.into());
                break LEAVING.to_string();
            }
            Ok((_, Ok(Heartbeat::Ping { timeout_ms, session }))) => {
                let bound = *watched.get_or_insert_with(|| shared.is_current(session).then_some(session));
                if bound.is_some_and(|id| id != session) {
                    let reason = format!("this heartbeat watches another session than {session}");
                    refuse(link.as_mut(), RefusalCode::BadRequest, reason.clone());
                    break reason;
                }
                if timeout_ms > baton_proto::MAX_HEARTBEAT_MS {
                    let reason = format!(
                        "a heartbeat timeout of {timeout_ms} ms is longer than the {} ms a worker allows",
                        baton_proto::MAX_HEARTBEAT_MS
                    );
                    refuse(link.as_mut(), RefusalCode::BadRequest, reason.clone());
                    break reason;
                }
                link.set_read_timeout(Some(Duration::from_millis(u64::from(timeout_ms.max(1)))))?;
                link.send(Heartbeat::Pong.into())?;
            }
            Ok((_, Ok(Heartbeat::Auth { .. }))) => break refuse_unexpected_auth(link.as_mut()).to_string(),
            // A head never sends `Pong` or `Refused`, nor another conversation's frames.
            Ok((kind, _)) => {
                let reason = format!("{kind} is not a heartbeat message");
                refuse(link.as_mut(), RefusalCode::BadRequest, reason.clone());
                break reason;
            }
            Err(NetError::Timeout { .. }) => break "the head's heartbeats stopped".to_string(),
            Err(NetError::Closed { .. }) => break "the head closed its heartbeat".to_string(),
            Err(e) => break e.to_string(),
        }
    };
    if let Some(Some(id)) = watched {
        if shared.abort_session(id) {
            tracing::warn!("{why}: ending the head's session");
        }
    }
    Ok(())
}

/// Refuses a head for a model another head's session serves here.
fn another_head(link: &mut dyn Link, file_name: &str) -> NodeError {
    let reason = format!("another head is already connected to this worker for {file_name}");
    refuse(link, RefusalCode::Busy, reason.clone());
    NodeError::Request(reason)
}

/// One head's session: describe, load, then run the stage until the ring closes.
///
/// `head` comes after `link` so that, when a panic unwinds this frame, the worker is
/// free again before the head's connection closes (parameters drop in reverse order): a
/// head that reconnects the moment it sees the close is not told "another head". For
/// the same reason a refusal frees the worker before it is sent.
fn session(shared: &Shared, mut link: Box<dyn Link>, head: HeadSlot<'_>, local: &str) -> Result<(), NodeError> {
    let id = head.id;
    // The head may take its time between messages (planning, other workers loading).
    link.set_read_timeout(None)?;
    let plan = loop {
        let msg = link.recv()?;
        let kind = msg.kind();
        match Control::try_from(msg) {
            Ok(Control::Describe { model }) => {
                #[cfg(test)]
                if tests::PANIC_ON_DESCRIBE.load(Ordering::SeqCst) {
                    panic!("a test made this session panic");
                }
                if !shared.claim_model(id, &model.identity) {
                    drop(head);
                    return Err(another_head(link.as_mut(), &model.file_name));
                }
                let caps = describe(shared, &model.file_name, &model.identity, local, id);
                link.send(Control::Capabilities(caps).into())?;
            }
            Ok(Control::LoadPlan(plan)) if !shared.claim_model(id, &plan.model.identity) => {
                drop(head);
                return Err(another_head(link.as_mut(), &plan.model.file_name));
            }
            Ok(Control::LoadPlan(plan)) => break plan,
            // The head times its link to this worker (`--tp auto`).
            Ok(Control::Probe { .. }) => link.send(Control::Probe { data: Vec::new() }.into())?,
            // The head planned without this worker.
            Ok(Control::Shutdown) => {
                tracing::info!("the head's plan leaves this worker out");
                return Ok(());
            }
            Ok(Control::Auth { .. }) => {
                drop(head);
                return Err(refuse_unexpected_auth(link.as_mut()).into());
            }
            // A head sends no worker's answers, no streaming before its plan, and no
            // other conversation's frames.
            _ => {
                let reason = format!("{kind} is not expected before a load plan");
                drop(head);
                refuse(link.as_mut(), RefusalCode::BadRequest, reason.clone());
                return Err(NodeError::Protocol(reason));
            }
        }
    };
    let started = Instant::now();
    let loaded = match load(shared, &plan, link.as_mut(), id) {
        Ok(loaded) => loaded,
        Err(e) => {
            // Regression (CI): the head read the refusal, connected again at once and
            // was told "another head" while this session was still closing the link.
            drop(head);
            refuse(link.as_mut(), RefusalCode::LoadFailed, e.to_string());
            return Err(e);
        }
    };
    let (loaded, recording) = loaded;
    let resident = match &loaded {
        Loaded::Ring { stage, .. } => stage.resident_bytes(),
        Loaded::Member { stage, .. } => stage.resident_bytes(),
    };
    shared.with_session(id, |s| s.resident = resident);
    let (stage, received, _member_links) = match loaded {
        Loaded::Ring { stage, received, mesh } => (stage, received, mesh),
        Loaded::Member {
            stage,
            leader,
            received,
            mesh,
        } => {
            tracing::info!(layers = ?(plan.layer_start..plan.layer_end), received, secs = started.elapsed().as_secs_f32(), "tensor-parallel member loaded");
            link.send(Message::Loaded {
                resident: stage.resident_bytes(),
                received,
            })?;
            finish_recording(recording);
            // Member 0 drives this one until it shuts the group down or goes; the head's
            // control link stays open (the head watches this worker by heartbeat).
            let result = serve_member(*stage, leader);
            drop(mesh);
            return match result {
                Ok(()) | Err(NodeError::Net(NetError::Closed { .. })) => Ok(()),
                Err(e) => Err(e),
            };
        }
    };
    run_ring_stage(shared, link, head, &plan, stage, received, recording, started)
}

/// Runs a loaded stage of session `head.id`'s ring: links it to the next stage, waits for
/// the previous stage's link, tells the head it is loaded, then computes until the ring
/// closes. `head` comes after `link` for the reason [`session`] gives.
#[allow(clippy::too_many_arguments)]
fn run_ring_stage(
    shared: &Shared,
    mut link: Box<dyn Link>,
    head: HeadSlot<'_>,
    plan: &LoadPlan,
    stage: StageChain,
    received: u64,
    recording: Option<Recording>,
    started: Instant,
) -> Result<(), NodeError> {
    let id = head.id;
    let on: Vec<String> = stage
        .stages()
        .map(|s| format!("{} {:?}", s.device().name(), s.span().layers))
        .collect();
    tracing::info!(layers = ?(plan.layer_start..plan.layer_end), devices = %on.join(", "), received, secs = started.elapsed().as_secs_f32(), "stage loaded");

    let token = shared.config.token.as_deref().map(str::as_bytes);
    // The link to the next stage, and the probe that keeps its round trip current for
    // as long as the session runs.
    let (downstream, _probe) = match &plan.next {
        Some(next) => {
            let mut down = shared.dial(next, Role::Ring)?;
            down.send(Message::JoinRing {
                session: plan.next_session,
            })?;
            let probe = LinkProbe::start(next, &shared.config.link, token, down.counters());
            (Some(down), Some(probe))
        }
        None => (None, None),
    };
    // The upstream link's slot is held as long as the link is used.
    let (upstream, _upstream_slot) = match plan.first {
        true => (None, None),
        false => {
            let (link, slot) = wait_upstream(shared, id)?;
            (Some(link), Some(slot))
        }
    };
    link.send(Message::Loaded {
        resident: stage.resident_bytes(),
        received,
    })?;
    finish_recording(recording);

    let worker = StageWorker::new(stage).with_wire_f16(plan.wire_f16);
    let (control_tx, control_rx) = link.split()?;
    let result = match (upstream, downstream) {
        (None, None) => run(worker, control_rx, control_tx),
        (None, Some(down)) => run(worker, control_rx, down.split()?.0),
        (Some(up), None) => run(worker, up.split()?.1, control_tx),
        (Some(up), Some(down)) => run(worker, up.split()?.1, down.split()?.0),
    };
    match result {
        Ok(()) | Err(NodeError::Net(NetError::Closed { .. })) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Waits for the ring link from the previous stage of session `id`'s ring.
fn wait_upstream(shared: &Shared, id: u64) -> Result<(Box<dyn Link>, ConnSlot), NodeError> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut slot = shared.upstreams();
    loop {
        if let Some(at) = slot.iter().position(|u| u.session == id) {
            let upstream = slot.swap_remove(at);
            return Ok((upstream.link, upstream.slot));
        }
        if shared.is_aborted(id) {
            return Err(NodeError::Request(
                "the session ended while waiting for the previous stage".into(),
            ));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(NodeError::Request(
                "the previous stage did not connect within 60 s".into(),
            ));
        }
        slot = shared
            .upstream_ready
            .wait_timeout(slot, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

fn describe(shared: &Shared, file_name: &str, identity: &[u8; 32], local: &str, session: u64) -> Capabilities {
    let config = &shared.config;
    let path = shared.models.find_complete(file_name, identity);
    let devices = baton_stage::or_cpu(&config.devices);
    let memory = shared.memory_for(session, &devices);
    let devices = devices
        .iter()
        .zip(memory)
        .map(|(&device, memory)| DeviceCaps {
            name: device.name(),
            memory,
            secs_per_layer: path
                .as_deref()
                .and_then(|path| speed_on(shared, path, identity, device)),
        })
        .collect();
    // Other stages reach this worker where the head did (the same interface and port,
    // or the same socket), unless told otherwise.
    let ring_addr = config.advertise.clone().unwrap_or_else(|| local.to_string());
    Capabilities {
        devices,
        threads: config.threads as u32,
        models: shared.models.list(),
        ring_addr,
        session,
    }
}

/// The worker's seconds per layer and token on `device`: measured once, then cached
/// on its disk.
fn speed_on(shared: &Shared, path: &std::path::Path, identity: &[u8; 32], device: Device) -> Option<f32> {
    let threads = shared.config.threads;
    let name = device.name();
    if let Some(secs) = shared.models.cached_speed(identity, threads, &name) {
        return Some(secs);
    }
    let secs = baton_stage::speed::measure(path, threads, device)
        .inspect_err(|e| tracing::warn!(device = %name, "could not measure this device's speed: {e}"))
        .ok()?;
    shared.models.store_speed(identity, threads, &name, secs);
    Some(secs)
}

/// What a worker loaded for its session.
enum Loaded {
    /// A stage of the ring: whole, or member 0 of a group driving the others.
    Ring {
        stage: StageChain,
        received: u64,
        /// The group's links, when it is member 0 of one.
        mesh: Option<Mesh>,
    },
    /// Another member of a group: it answers member 0 (`leader`) only.
    Member {
        stage: Box<Stage>,
        leader: Arc<Peer>,
        received: u64,
        mesh: Mesh,
    },
}

/// Loads the planned stage from a local file, or from tensors the head streams; the
/// member's slice of it when the plan places this worker in a tensor-parallel group,
/// after linking with the group's other members (before any tensor is received: the
/// head sends every member its plan before it streams to any).
/// Also returns, when tensors were received, the thread still recording them.
fn load(
    shared: &Shared,
    plan: &LoadPlan,
    link: &mut dyn Link,
    id: u64,
) -> Result<(Loaded, Option<Recording>), NodeError> {
    // Refused before anything is received.
    plan_kv_types(plan)?;
    let mesh = plan.tp.as_ref().map(|place| form_mesh(shared, id, place)).transpose()?;
    let (file, received, verified, recording) = if plan.stream {
        let dial = |peer: &str| shared.dial(peer, Role::Fetch);
        let got = receive_stage_tensors(&shared.models, &plan.model, link, &dial)?;
        (got.model?, got.bytes, Some(got.verified), Some(got.recording))
    } else {
        let path = shared
            .models
            .find_complete(&plan.model.file_name, &plan.model.identity)
            .ok_or_else(|| {
                NodeError::Request(format!(
                    "model {} with the head's identity is not in {}",
                    plan.model.file_name,
                    shared.config.models.display()
                ))
            })?;
        (ModelFile::open(&path)?, 0, None, None)
    };
    Ok((
        build(shared, plan, file, verified.as_ref(), mesh, received, id)?,
        recording,
    ))
}

/// Waits for the record of received tensors (written while the stage was built and
/// linked: the stage runs from the verified bytes either way). One that could not be
/// written costs only the next start, which receives those tensors again.
fn finish_recording(recording: Option<Recording>) {
    if let Some(Err(e)) = recording.map(|mut recording| recording.wait()) {
        tracing::warn!("received tensors not recorded, the next start receives them again: {e}");
    }
}

/// Builds session `id`'s stage (or the member's slice) from `file`, once `verified`
/// (the tensors received and verified, when they were streamed) holds every tensor it
/// reads.
fn build(
    shared: &Shared,
    plan: &LoadPlan,
    file: Arc<ModelFile>,
    verified: Option<&std::collections::BTreeSet<String>>,
    mesh: Option<Mesh>,
    received: u64,
    id: u64,
) -> Result<Loaded, NodeError> {
    let kv_types = plan_kv_types(plan)?;
    let span = StageSpan {
        layers: plan.layer_start as usize..plan.layer_end as usize,
        first: plan.first,
        last: plan.last,
    };
    if let Some(verified) = verified {
        check_stage_complete(&file, &span, verified)?;
    }
    let config = StageConfig {
        n_ctx: plan.n_ctx as usize,
        n_threads: shared.config.threads,
        repack: plan.repack,
        n_seq: plan.n_seq as usize,
        kv_types,
        n_ubatch: baton_model::DEFAULT_UBATCH,
    };
    let devices = baton_stage::or_cpu(&shared.config.devices);
    let offered = shared
        .memory_for(id, &devices)
        .iter()
        .fold(0, |a: u64, &m| a.saturating_add(m));
    check_kv_fits(&file, &span, &config, offered)?;
    let Some(mesh) = mesh else {
        let parts = match plan.devices.is_empty() {
            true => split_between(&span, &devices),
            false => planned_parts(&span, &plan.devices, &devices)?,
        };
        return Ok(Loaded::Ring {
            stage: baton_stage::load_chain(&file, parts, &config)?,
            received,
            mesh: None,
        });
    };
    // The exchanges are host ops over activations in host memory: members compute on
    // the CPU whatever devices the worker has (docs/tensor-parallel.md).
    if shared.config.devices.iter().any(|d| !d.is_cpu()) {
        tracing::info!("this worker's tensor-parallel slice computes on the CPU");
    }
    let (rank, size) = (mesh.rank, mesh.size);
    let split = baton_model::tp_splits(&file, size)?.swap_remove(rank);
    let collective = Arc::new(MeshCollective::new(rank, mesh.peers.clone()));
    let stage = Stage::load_member(file, span, &config, Some((split, collective)))?;
    if rank == 0 {
        let members = mesh
            .peers
            .iter()
            .map(|p| Box::new(RemoteMember::new(p.clone())) as Box<dyn baton_model::GroupMember>)
            .collect();
        return Ok(Loaded::Ring {
            stage: StageChain::from(StageGroup::new(stage, members)),
            received,
            mesh: Some(mesh),
        });
    }
    let leader = mesh
        .peers
        .iter()
        .find(|p| p.rank() == 0)
        .cloned()
        .ok_or_else(|| NodeError::Protocol("the group's member 0 is not among its links".into()))?;
    Ok(Loaded::Member {
        stage: Box::new(stage),
        leader,
        received,
        mesh,
    })
}

/// The span's layers on the devices the plan names, in order (the codec checked that
/// the ranges tile the span). The plan names devices as this worker offered them; a
/// name given twice (two CPU devices) means the next device of that name.
fn planned_parts(
    span: &StageSpan,
    ranges: &[DeviceRange],
    devices: &[Device],
) -> Result<Vec<(StageSpan, Device)>, NodeError> {
    let mut parts = Vec::new();
    let mut start = span.layers.start;
    let mut next = 0;
    for range in ranges {
        let found = devices[next..].iter().position(|d| d.name() == range.device);
        let Some(at) = found.map(|at| next + at) else {
            let offered: Vec<String> = devices.iter().map(Device::name).collect();
            return Err(NodeError::Request(format!(
                "the plan puts layers ..{} on device {}, which this worker does not offer in that order (it offers {})",
                range.layer_end,
                range.device,
                offered.join(", ")
            )));
        };
        let end = range.layer_end as usize;
        parts.push((start..end, devices[at]));
        start = end;
        next = at + 1;
    }
    Ok(baton_stage::part_spans(span, parts))
}

/// The span's layers split evenly between `devices`, in order (fewer devices when
/// there are fewer layers): consecutive ranges, the first embedding, the last with
/// logits.
fn split_between(span: &StageSpan, devices: &[Device]) -> Vec<(StageSpan, Device)> {
    let n_layers = span.layers.len();
    let n = devices.len().clamp(1, n_layers.max(1));
    let base = n_layers / n;
    let mut start = span.layers.start;
    let parts = baton_stage::or_cpu(devices)
        .into_iter()
        .take(n)
        .enumerate()
        .map(|(i, device)| {
            let len = base + usize::from(i < n_layers % n);
            start += len;
            (start - len..start, device)
        });
    baton_stage::part_spans(span, parts.collect())
}

/// The element types of the KV cache the head chose for the ring.
fn plan_kv_types(plan: &LoadPlan) -> Result<KvTypes, NodeError> {
    let parse = |name: &str| CacheType::parse(name).map_err(|e| NodeError::Request(format!("the head's plan: {e}")));
    Ok(KvTypes {
        k: parse(&plan.cache_type_k)?,
        v: parse(&plan.cache_type_v)?,
    })
}

/// Refuses a plan whose KV cache alone exceeds the memory this worker offers: the head
/// chose `n_ctx`, and the cache is allocated and zeroed at once, so an absurd one would
/// otherwise take the worker's memory (or the process) with it.
fn check_kv_fits(file: &ModelFile, span: &StageSpan, config: &StageConfig, offered: u64) -> Result<(), NodeError> {
    let hp = file.hparams();
    let kv: u128 = span
        .layers
        .clone()
        .map(|l| hp.layer_cache_bytes(l, config.n_ctx, config.n_seq, config.kv_types) as u128)
        .sum();
    if kv > offered as u128 {
        return Err(NodeError::Request(format!(
            "a context of {} tokens needs {:.1} GiB of KV cache for layers {:?}, more than the {:.1} GiB this \
             worker offers (--memory)",
            config.n_ctx,
            kv as f64 / (1u64 << 30) as f64,
            span.layers,
            offered as f64 / (1u64 << 30) as f64
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use baton_net::connect;
    use baton_proto::auth::TokenError;
    use baton_proto::ModelRef;

    use super::*;

    /// Makes every session panic when it is asked to describe the worker.
    pub(crate) static PANIC_ON_DESCRIBE: AtomicBool = AtomicBool::new(false);

    /// Held by the tests whose workers describe themselves, so that none of them runs
    /// while another makes every description panic.
    static DESCRIBING: std::sync::Mutex<()> = std::sync::Mutex::new(());

    const TOKEN: &str = "worker-test-secret";

    /// Connects as a head and asks the worker to describe itself.
    fn describe_once(addr: &str) -> Result<Message, NetError> {
        let mut link = connect(addr, &LinkOptions::default())?;
        client_handshake(link.as_mut(), Role::Head, Some(TOKEN.as_bytes()))?;
        link.set_read_timeout(Some(Duration::from_secs(10)))?;
        link.send(Message::Describe {
            model: ModelRef {
                file_name: "absent.gguf".into(),
                identity: [0; 32],
                size: 1,
            },
        })?;
        link.recv()
    }

    /// Issue 16: a panic while a head was served left `busy` set, and every later
    /// head was refused with "another head is already connected" (and each panic also
    /// kept a connection counted for ever).
    /// Starts a worker on loopback serving `models`; returns its address.
    fn start_worker(models: &std::path::Path) -> String {
        let worker = Worker::bind(WorkerConfig {
            listen: "127.0.0.1:0".into(),
            models: models.to_path_buf(),
            token: Some(TOKEN.into()),
            threads: 1,
            memory: Some(1 << 30),
            advertise: None,
            link: LinkOptions::default(),
            handshake_timeout: Duration::from_secs(5),
            max_connections: 4,
            max_handshakes_per_source: 8,
            devices: vec![Device::cpu()],
        })
        .unwrap();
        let addr = worker.local_addr().to_string();
        std::thread::spawn(move || worker.serve());
        addr
    }

    #[test]
    fn a_panic_in_a_session_leaves_the_worker_free_for_the_next_head() {
        let _serial = DESCRIBING.lock().unwrap_or_else(|p| p.into_inner());
        let models = std::env::temp_dir().join(format!("baton-panic-{}", std::process::id()));
        let addr = start_worker(&models);

        PANIC_ON_DESCRIBE.store(true, Ordering::SeqCst);
        // More panicking heads than --max-connections: no slot may leak either.
        for _ in 0..6 {
            let answer = describe_once(&addr);
            assert!(
                answer.is_err(),
                "the session panicked, its connection closed: {answer:?}"
            );
        }
        PANIC_ON_DESCRIBE.store(false, Ordering::SeqCst);
        let answer = describe_once(&addr).unwrap();
        assert!(matches!(answer, Message::Capabilities(_)), "{answer:?}");
        std::fs::remove_dir_all(&models).unwrap();
    }

    /// CI failure (tests/hardening.rs): a head that read a refusal and connected again
    /// at once was told "another head", because the refused session held the worker
    /// until its link had closed. The first head here keeps its link open, so that
    /// closing takes its full second.
    #[test]
    fn a_refused_head_leaves_the_worker_free_before_the_refusal_arrives() {
        let _serial = DESCRIBING.lock().unwrap_or_else(|p| p.into_inner());
        let models = std::env::temp_dir().join(format!("baton-refused-{}", std::process::id()));
        let addr = start_worker(&models);
        let mut first = connect(&addr, &LinkOptions::default()).unwrap();
        client_handshake(first.as_mut(), Role::Head, Some(TOKEN.as_bytes())).unwrap();
        first.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        first.send(Message::Pong).unwrap();
        let answer = first.recv().unwrap();
        assert!(
            matches!(
                answer,
                Message::Refused {
                    code: RefusalCode::BadRequest,
                    ..
                }
            ),
            "{answer:?}"
        );
        let answer = describe_once(&addr).unwrap();
        assert!(matches!(answer, Message::Capabilities(_)), "{answer:?}");
        drop(first);
        let _ = std::fs::remove_dir_all(&models);
    }

    #[test]
    fn a_workers_layers_are_split_evenly_between_its_devices() {
        let cpu = Device::cpu();
        let span = StageSpan {
            layers: 3..10,
            first: false,
            last: true,
        };
        let parts = split_between(&span, &[cpu, cpu, cpu]);
        let ranges: Vec<_> = parts.iter().map(|(s, _)| s.layers.clone()).collect();
        assert_eq!(ranges, vec![3..6, 6..8, 8..10]);
        let roles: Vec<_> = parts.iter().map(|(s, _)| (s.first, s.last)).collect();
        assert_eq!(roles, vec![(false, false), (false, false), (false, true)]);
        let one_layer = StageSpan {
            layers: 0..1,
            first: true,
            last: false,
        };
        assert_eq!(split_between(&one_layer, &[cpu, cpu]), vec![(one_layer.clone(), cpu)]);
    }

    /// Issue 15: the plan, not the worker, says which layers each device holds.
    #[test]
    fn the_plan_places_layers_on_the_named_devices() {
        let cpu = Device::cpu();
        let span = StageSpan {
            layers: 4..12,
            first: false,
            last: true,
        };
        let range = |device: &str, layer_end| DeviceRange {
            device: device.into(),
            layer_end,
        };
        // Two devices of one name: each range takes the next.
        let parts = planned_parts(&span, &[range("CPU", 9), range("CPU", 12)], &[cpu, cpu]).unwrap();
        let got: Vec<_> = parts.iter().map(|(s, _)| (s.layers.clone(), s.first, s.last)).collect();
        assert_eq!(got, vec![(4..9, false, false), (9..12, false, true)]);
        // A plan may leave a device out.
        let parts = planned_parts(&span, &[range("CPU", 12)], &[cpu, cpu]).unwrap();
        assert_eq!(parts.len(), 1);
        // A device the worker does not offer, or one named more often than offered.
        for ranges in [vec![range("CUDA0", 12)], vec![range("CPU", 6), range("CPU", 12)]] {
            let err = planned_parts(&span, &ranges, &[cpu]).unwrap_err().to_string();
            assert!(
                err.contains("which this worker does not offer in that order (it offers CPU)"),
                "{err}"
            );
        }
    }

    /// A worker on loopback over `models` with `token`.
    fn bind_config(models: PathBuf, token: Option<&str>) -> WorkerConfig {
        WorkerConfig {
            listen: "127.0.0.1:0".into(),
            models,
            token: token.map(str::to_string),
            threads: 1,
            memory: None,
            advertise: None,
            link: LinkOptions::default(),
            handshake_timeout: Duration::from_secs(5),
            max_connections: 4,
            max_handshakes_per_source: 8,
            devices: vec![Device::cpu()],
        }
    }

    #[test]
    fn a_short_token_is_refused_when_binding() {
        let err = Worker::bind(bind_config(std::env::temp_dir(), Some("tiny")))
            .err()
            .unwrap();
        assert!(err.to_string().contains("4 bytes long"), "{err}");
    }

    #[test]
    fn a_bad_token_a_bad_models_directory_and_a_taken_address_are_told_apart() {
        let err = Worker::bind(bind_config(std::env::temp_dir(), Some("tiny")))
            .err()
            .unwrap();
        assert!(
            matches!(err, WorkerError::Token(TokenError::Short { len: 4 })),
            "{err:?}"
        );

        // A file where the models directory should be.
        let file = std::env::temp_dir().join(format!("baton-worker-models-{}", std::process::id()));
        std::fs::write(&file, b"not a directory").unwrap();
        let err = Worker::bind(bind_config(file.clone(), None)).err().unwrap();
        std::fs::remove_file(&file).unwrap();
        assert!(matches!(err, WorkerError::Models(NodeError::File { .. })), "{err:?}");

        let taken = Listener::bind("127.0.0.1:0").unwrap();
        let config = WorkerConfig {
            listen: taken.local_addr().to_string(),
            ..bind_config(std::env::temp_dir(), None)
        };
        let err = Worker::bind(config).err().unwrap();
        assert!(matches!(err, WorkerError::Bind(_)), "{err:?}");
    }
}

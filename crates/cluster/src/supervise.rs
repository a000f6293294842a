//! Keeping a cluster's ring alive: the [`Supervisor`] forms the ring over the workers
//! that answer, watches each with a heartbeat, forms it again over the ones that remain
//! when one is lost, and notices when a lost worker answers again so the engine can move
//! back to the better plan.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use baton_net::{client_handshake, connect_by, Counters, LinkCloser, LinkOptions};
use baton_plan::PlanError;
use baton_proto::{RefusalCode, Role};

use crate::error::ClusterError;
use crate::form::{connect_cluster, ClusterOptions, ContextFit, OnReached, RemoteRing};
use crate::watch::{OnLost, Watch};
use baton_engine::{Better, FormError, Formed, RingSource, WorkerLink};
use baton_stage::probe::ping;
use baton_stage::NodeError;

/// Most workers a cluster takes: those given, and those that join.
pub const MAX_WORKERS: usize = 64;

/// The workers a supervisor forms rings over: those it was given, and those that
/// joined since (found on the network, say). Cloned handles share the list.
#[derive(Clone, Default)]
pub struct Members {
    addrs: Arc<Mutex<Vec<String>>>,
    /// Some worker joined since the last ring was formed (set and cleared under the
    /// list's lock; read without it, by the engine's loop at every event).
    joined: Arc<AtomicBool>,
}

impl Members {
    /// Members `addrs` to begin with.
    pub fn new(addrs: &[String]) -> Members {
        let members = Members::default();
        *members.list() = addrs.to_vec();
        members
    }

    fn list(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.addrs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a worker that joins; the supervisor forms a ring with it. False when it is
    /// a member already, or the cluster has [`MAX_WORKERS`].
    pub fn join(&self, addr: &str) -> bool {
        let mut list = self.list();
        if list.iter().any(|a| a == addr) {
            return false;
        }
        if list.len() >= MAX_WORKERS {
            tracing::warn!(worker = %addr, "not taken in: the cluster has {MAX_WORKERS} workers");
            return false;
        }
        tracing::warn!(worker = %addr, "a worker joins the cluster: forming a ring with it");
        list.push(addr.to_string());
        self.joined.store(true, Ordering::SeqCst);
        true
    }

    /// The members now.
    pub fn addrs(&self) -> Vec<String> {
        self.list().clone()
    }

    fn joined(&self) -> bool {
        self.joined.load(Ordering::SeqCst)
    }

    /// The members, marking the joins seen.
    fn take(&self) -> Vec<String> {
        let list = self.list();
        self.joined.store(false, Ordering::SeqCst);
        list.clone()
    }
}

/// Forms and re-forms the ring over a cluster's workers.
pub struct Supervisor {
    model: PathBuf,
    members: Members,
    /// The workers given at the start (those a `--split` names).
    given: Vec<String>,
    /// Rings formed so far.
    formed: u64,
    opts: ClusterOptions,
    heartbeat: Duration,
    ring: Option<RemoteRing>,
    watches: Vec<Watch>,
    /// Workers out of the ring because they were lost or did not answer, and why.
    lost: Arc<Mutex<BTreeMap<String, String>>>,
    /// A lost worker answers again.
    returned: Arc<AtomicBool>,
    prober: Option<Prober>,
}

impl Supervisor {
    /// A supervisor for `members` (which may grow while it runs); nothing is connected
    /// until [`RingSource::form`]. A worker silent for `heartbeat` is lost.
    pub fn new(model: &Path, members: Members, opts: ClusterOptions, heartbeat: Duration) -> Supervisor {
        Supervisor {
            model: model.to_path_buf(),
            given: members.addrs(),
            formed: 0,
            members,
            opts,
            heartbeat,
            ring: None,
            watches: Vec::new(),
            lost: Arc::default(),
            returned: Arc::default(),
            prober: None,
        }
    }

    /// The ring now formed, if any.
    pub fn ring(&self) -> Option<&RemoteRing> {
        self.ring.as_ref()
    }

    fn lost(&self) -> BTreeMap<String, String> {
        self.lost.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Connects over `candidates`; a worker that still holds its previous session (it
    /// has not noticed the old ring closing yet) is given a moment and asked again.
    fn connect(
        &mut self,
        candidates: &[String],
        reached: &Mutex<Vec<(String, Watch)>>,
        on_reached: OnReached,
    ) -> Result<RemoteRing, ClusterError> {
        let deadline = Instant::now() + Duration::from_secs(3);
        // A `--split` names the workers given; with others the planner decides.
        let mut opts = self.opts.clone();
        opts.on_reached = Some(on_reached);
        if candidates != self.given {
            opts.split = None;
        }
        loop {
            // Watches of an earlier attempt watch sessions that are gone.
            reached.lock().unwrap_or_else(|p| p.into_inner()).clear();
            match connect_cluster(&self.model, candidates, &opts) {
                Ok(ring) => {
                    let busy = ring
                        .unreachable
                        .iter()
                        .any(|(_, why)| why.refusal() == Some(RefusalCode::Busy));
                    if busy && Instant::now() < deadline {
                        drop(ring);
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                    return Ok(ring);
                }
                Err(e) if e.refusal() == Some(RefusalCode::Busy) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Supervisor {
    /// What to do with each worker that answers while a ring forms: watch it from then
    /// on, and when it is lost, record why, close its control link and, while the ring
    /// still forms, every reached worker's (`closers`), then tell `on_lost`.
    fn watch_each(
        &self,
        on_lost: OnLost,
        reached: &Arc<Mutex<Vec<(String, Watch)>>>,
        forming: &Arc<AtomicBool>,
        closers: &Arc<Mutex<Vec<Arc<LinkCloser>>>>,
    ) -> impl Fn(&str, u64, LinkCloser, Arc<Counters>) + Send + Sync + 'static {
        let reached = reached.clone();
        let lost = self.lost.clone();
        let link = self.opts.link.clone();
        let token = self.opts.token.clone();
        let heartbeat = self.heartbeat;
        let (forming, closers) = (forming.clone(), closers.clone());
        move |addr: &str, session: u64, closer: LinkCloser, counters: Arc<Counters>| {
            let lost = lost.clone();
            let notify = on_lost.clone();
            let closer = Arc::new(closer);
            closers.lock().unwrap_or_else(|p| p.into_inner()).push(closer.clone());
            let (forming, closers) = (forming.clone(), closers.clone());
            let callback: OnLost = Arc::new(move |addr: &str, why: &str| {
                lost.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(addr.to_string(), why.to_string());
                closer.close();
                if forming.load(Ordering::SeqCst) {
                    closers
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .iter()
                        .for_each(|c| c.close());
                }
                notify(addr, why);
            });
            let token = token.as_deref().map(str::as_bytes);
            match Watch::start(addr, &link, token, session, heartbeat, counters, callback) {
                Ok(watch) => reached
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((addr.to_string(), watch)),
                Err(e) => tracing::warn!(worker = %addr, "cannot watch it: {e}"),
            }
        }
    }

    /// The error of a formation that failed with `e`: a lack of memory is a capacity
    /// problem, anything else is retried; both say which workers are awaited.
    fn not_formed(&mut self, candidates: &[String], e: ClusterError) -> FormError {
        self.mark_unreachable(candidates);
        self.start_prober();
        let lost = self.lost();
        let why = describe_lost(&lost);
        match e {
            ClusterError::Plan(NodeError::Plan(PlanError::NotEnoughMemory { .. })) => FormError::Capacity(format!(
                "the workers that answer cannot hold the model ({e}); waiting for {why}"
            )),
            other if lost.is_empty() => FormError::Retry(other.to_string()),
            other => FormError::Retry(format!("{other}; waiting for {why}")),
        }
    }
}

impl RingSource for Supervisor {
    fn form(&mut self, on_lost: OnLost) -> Result<Formed, FormError> {
        // Stop watching the old ring first: its workers end their sessions when the
        // heartbeats stop, and are free for the new one.
        self.watches.clear();
        self.ring = None;
        self.prober = None;
        self.returned.store(false, Ordering::SeqCst);
        let lost_before = self.lost();
        let candidates: Vec<String> = self
            .members
            .take()
            .into_iter()
            .filter(|w| !lost_before.contains_key(w))
            .collect();

        // Each worker is watched from the moment it answers: one that dies or hangs
        // while the ring forms (loading has no timeout) has its control link closed,
        // which ends the formation instead of stalling it.
        let reached: Arc<Mutex<Vec<(String, Watch)>>> = Arc::default();
        // While the ring forms, a worker lost ends the formation at once: every reached
        // worker's control link is closed, wherever the head is blocked. (A member of a
        // tensor-parallel group lost before it linked leaves the others waiting for it,
        // and the head waiting on them, not on the lost one.)
        let forming = Arc::new(AtomicBool::new(true));
        let closers: Arc<Mutex<Vec<Arc<LinkCloser>>>> = Arc::default();
        let on_reached = self.watch_each(on_lost, &reached, &forming, &closers);
        let result = self.connect(&candidates, &reached, Arc::new(on_reached));
        forming.store(false, Ordering::SeqCst);
        let ring = match result {
            Ok(ring) => ring,
            Err(e) => return Err(self.not_formed(&candidates, e)),
        };
        {
            let mut lost = self.lost.lock().unwrap_or_else(|p| p.into_inner());
            for (addr, why) in &ring.unreachable {
                lost.insert(addr.clone(), why.to_string());
            }
        }
        self.opts.head_secs_per_layer = ring.head_secs_per_layer.clone();
        // Later rings keep this one's context: the engine's slots were sized by it.
        self.opts.n_ctx = ring.n_ctx;
        self.opts.ctx_fit = ContextFit::Exact;
        // The first ring needs every worker (a wrong address or token is a mistake to
        // report); later ones are formed over whoever answers.
        self.opts.skip_unreachable = true;
        // Later rings read the file again: it may have been replaced since.
        self.opts.opened = None;

        // Keep watching the workers of the plan; the others were sent away.
        let planned: Vec<&str> = ring
            .workers
            .iter()
            .filter(|w| w.layers.is_some())
            .map(|w| w.addr.as_str())
            .collect();
        let mut watched = reached.lock().unwrap_or_else(|p| p.into_inner());
        self.watches = watched
            .drain(..)
            .filter(|(addr, _)| planned.contains(&addr.as_str()))
            .map(|(_, watch)| watch)
            .collect();
        drop(watched);

        let stages = ring.describe_stages();
        // The first ring is announced by the command; later ones (after a loss, a
        // return or a join) are told here, with the planner's reasons.
        if self.formed > 0 {
            tracing::warn!("new ring: {}; plan: {}", stages.join(", "), ring.plan.why);
        }
        self.formed += 1;
        let n_ctx = ring.n_ctx;
        let mut ring = ring;
        let ends = ring
            .take_ends()
            .ok_or_else(|| FormError::Retry("the new ring has no ends to give".into()))?;
        self.ring = Some(ring);
        if !self.lost().is_empty() {
            self.start_prober();
        }
        let workers = self
            .watches
            .iter()
            .map(|watch| WorkerLink {
                addr: watch.addr().to_string(),
                counters: watch.round_trip(),
            })
            .collect();
        Ok(Formed {
            ends,
            stages,
            lost: self.lost().into_iter().collect(),
            workers,
            n_ctx: Some(n_ctx),
        })
    }

    fn better(&self) -> Option<Better> {
        if self.members.joined() {
            Some(Better::Joined)
        } else if self.returned.load(Ordering::SeqCst) {
            Some(Better::Returned)
        } else {
            None
        }
    }
}

impl Supervisor {
    /// After a failed formation, finds which of `candidates` do not even accept a
    /// connection, so that errors and `/health` name them and the prober waits for them.
    fn mark_unreachable(&self, candidates: &[String]) {
        let opts = LinkOptions {
            read_timeout: Some(self.heartbeat),
            ..self.opts.link.clone()
        };
        let token = self.opts.token.as_deref().map(str::as_bytes);
        for addr in candidates {
            // A bare handshake: its heartbeat names no session, so ends none.
            let deadline = Instant::now() + self.heartbeat;
            let answered = connect_by(addr, &opts, deadline)
                .and_then(|mut conn| client_handshake(conn.as_mut(), Role::Heartbeat, token));
            if let Err(e) = answered {
                self.lost
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(addr.clone(), e.to_string());
            }
        }
    }

    /// Starts asking the lost workers, with backoff, whether they answer again.
    fn start_prober(&mut self) {
        if self.prober.is_some() {
            return;
        }
        self.prober = Some(Prober::start(
            self.lost.clone(),
            self.returned.clone(),
            self.opts.link.clone(),
            self.opts.token.clone(),
            self.heartbeat,
        ));
    }
}

fn describe_lost(lost: &BTreeMap<String, String>) -> String {
    if lost.is_empty() {
        return "the workers".into();
    }
    let names: Vec<String> = lost.iter().map(|(a, why)| format!("worker {a} ({why})")).collect();
    format!("{} to return", names.join(", "))
}

/// A thread that reconnects to lost workers (a bare authenticated handshake) with
/// exponential backoff, and takes those that answer off the lost list.
struct Prober {
    stop: Arc<AtomicBool>,
    _thread: JoinHandle<()>,
}

impl Prober {
    fn start(
        lost: Arc<Mutex<BTreeMap<String, String>>>,
        returned: Arc<AtomicBool>,
        link: LinkOptions,
        token: Option<String>,
        timeout: Duration,
    ) -> Prober {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let opts = LinkOptions {
                read_timeout: Some(timeout),
                ..link
            };
            let mut backoff = Duration::from_millis(250);
            while !stopped.load(Ordering::SeqCst) {
                let addrs: Vec<String> = lost.lock().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect();
                if addrs.is_empty() {
                    return;
                }
                for addr in addrs {
                    // A heartbeat that names no session: a worker that is leaving
                    // refuses it, and it ends no session of another head.
                    let answered = connect_by(&addr, &opts, Instant::now() + timeout)
                        .and_then(|mut conn| {
                            client_handshake(conn.as_mut(), Role::Heartbeat, token.as_deref().map(str::as_bytes))?;
                            Ok(conn)
                        })
                        .is_ok_and(|mut conn| ping(conn.as_mut(), 0, timeout).is_ok());
                    if answered && !stopped.load(Ordering::SeqCst) {
                        tracing::info!(worker = %addr, "a lost worker answers again");
                        lost.lock().unwrap_or_else(|p| p.into_inner()).remove(&addr);
                        returned.store(true, Ordering::SeqCst);
                    }
                }
                let until = Instant::now() + backoff;
                while !stopped.load(Ordering::SeqCst) && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(50));
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        });
        Prober { stop, _thread: thread }
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

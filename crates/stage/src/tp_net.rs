//! Tensor-parallel groups across processes: the members' all-gathers over links (each
//! member sends its slice to every other and joins what it gets in rank order: one link
//! latency per exchange for 2-4 members), member 0 driving the others with the ring's
//! own messages (`Forward`, `TruncateSeq`, `EndSeq`, `Shutdown`), and the loop a member
//! process runs.
//!
//! Links form a full mesh. Member `r` (1..n) listens; it dials every member in `1..r`,
//! then accepts one link from each member above it and one from member 0, which dials
//! them all. A dialing member introduces itself with `Partial { sum: 0, values:
//! [rank] }`; the group's exchanges are numbered from 1.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_model::tp::join_rows;
use baton_model::{
    decode_best, encode_best, Batch, Collective, CollectiveError, GroupMember, LogitReply, ModelError, Stage,
    StageInput, StageOutput,
};
use baton_net::{client_handshake, connect_by, Link, LinkOptions, Listener, Rx, Tx};
use baton_proto::{Conversation, Forward, Group, Message, Payload, RefusalCode, Role};

use crate::gate::refuse;
use crate::NodeError;

/// Slices up to this size are sent from the computing thread before it reads the
/// others' (they fit the sockets' buffers, so two members sending at once cannot block
/// each other); larger ones (prompt chunks) are sent from a second thread meanwhile.
const DIRECT_BYTES: usize = 64 << 10;

/// One link of a member to another member.
pub struct Peer {
    rank: usize,
    name: String,
    tx: Mutex<Box<dyn Tx>>,
    rx: Mutex<Box<dyn Rx>>,
}

impl Peer {
    /// Member `rank` at the other end of `link` (already through its handshake and
    /// introduction).
    pub fn from_link(rank: usize, link: Box<dyn Link>) -> Result<Arc<Peer>, NodeError> {
        Peer::new(rank, link)
    }

    /// The member's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    fn new(rank: usize, link: Box<dyn Link>) -> Result<Arc<Peer>, NodeError> {
        let name = format!("member {rank} ({})", link.peer());
        let (tx, rx) = link.split()?;
        Ok(Arc::new(Peer {
            rank,
            name,
            tx: Mutex::new(tx),
            rx: Mutex::new(rx),
        }))
    }

    fn send(&self, msg: Group) -> Result<(), CollectiveError> {
        let mut tx = self.tx.lock().map_err(|_| self.aborted("its link's writer panicked"))?;
        tx.send(msg.into()).map_err(|e| self.aborted(&e.to_string()))
    }

    /// The next message of the group's conversation; one of another is the peer's fault.
    fn recv(&self) -> Result<Group, CollectiveError> {
        let mut rx = self.rx.lock().map_err(|_| self.aborted("its link's reader panicked"))?;
        let msg = rx.recv().map_err(|e| self.aborted(&e.to_string()))?;
        Group::try_from(msg).map_err(|wrong| self.unexpected(wrong.to_string()))
    }

    fn aborted(&self, why: &str) -> CollectiveError {
        CollectiveError::Aborted(format!("{}: {why}", self.name))
    }

    fn unexpected(&self, reason: String) -> CollectiveError {
        CollectiveError::Peer {
            peer: self.rank,
            reason,
        }
    }
}

/// A member's exchanges over its links to all the others.
pub struct MeshCollective {
    rank: usize,
    /// Every other member, by rank.
    peers: Vec<Arc<Peer>>,
    next_sum: AtomicU64,
}

impl MeshCollective {
    /// Member `rank`'s exchanges over `peers` (every other member once).
    pub fn new(rank: usize, mut peers: Vec<Arc<Peer>>) -> MeshCollective {
        peers.sort_by_key(|p| p.rank);
        MeshCollective {
            rank,
            peers,
            next_sum: AtomicU64::new(1),
        }
    }

    /// Sends `data` to every peer and receives each peer's slice of `expected(rank)`
    /// values.
    fn exchange(
        &self,
        sum: u64,
        data: &[f32],
        expected: &dyn Fn(usize) -> usize,
    ) -> Result<Vec<(usize, Vec<f32>)>, CollectiveError> {
        let msg = Group::Partial {
            sum,
            values: data.to_vec(),
        };
        let receive = || {
            self.peers
                .iter()
                .map(|peer| match peer.recv()? {
                    Group::Partial { sum: s, values } if s == sum && values.len() == expected(peer.rank) => {
                        Ok((peer.rank, values))
                    }
                    Group::Partial { sum: s, values } => Err(peer.unexpected(format!(
                        "exchange {s} of {} values where exchange {sum} of {} was due",
                        values.len(),
                        expected(peer.rank)
                    ))),
                    Group::Error { message, .. } => Err(peer.aborted(&message)),
                    other => Err(peer.unexpected(format!("{} where a partial sum was due", other.kind()))),
                })
                .collect::<Result<Vec<_>, _>>()
        };
        if data.len() * 4 <= DIRECT_BYTES {
            self.peers.iter().try_for_each(|p| p.send(msg.clone()))?;
            return receive();
        }
        std::thread::scope(|scope| {
            let sender = scope.spawn(|| self.peers.iter().try_for_each(|p| p.send(msg.clone())));
            let received = receive();
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err(CollectiveError::Aborted("sender panicked".into())));
            sent.and(received)
        })
    }
}

impl Collective for MeshCollective {
    fn all_gather(&self, mine: &[f32], widths: &[usize], rows: usize, out: &mut [f32]) -> Result<(), CollectiveError> {
        let sum = self.next_sum.fetch_add(1, Ordering::Relaxed);
        let expected = |rank: usize| widths.get(rank).map_or(usize::MAX, |w| w * rows);
        let theirs = self.exchange(sum, mine, &expected)?;
        let mut parts: Vec<(usize, &[f32])> = theirs.iter().map(|(r, v)| (*r, v.as_slice())).collect();
        parts.push((self.rank, mine));
        parts.sort_by_key(|(r, _)| *r);
        join_rows(parts.into_iter().map(|(_, p)| p), widths, rows, out)
    }

    fn abort(&self, reason: &str) {
        for peer in &self.peers {
            let _ = peer.send(Group::Error {
                first_layer: 0,
                fault: baton_proto::Fault::Compute,
                message: format!("member {} aborted: {reason}", self.rank),
            });
        }
    }
}

/// Member 0's handle on a member process (over the same link the two sum on).
pub struct RemoteMember {
    peer: Arc<Peer>,
    step: u64,
    /// What the last batch sent asked for, and its logit rows: how to read the answer.
    asked: LogitReply,
    n_rows: usize,
}

impl RemoteMember {
    /// Drives the member at the other end of `peer`.
    pub fn new(peer: Arc<Peer>) -> RemoteMember {
        RemoteMember {
            peer,
            step: 0,
            asked: LogitReply::Logits,
            n_rows: 0,
        }
    }
}

fn model_error(e: CollectiveError) -> ModelError {
    ModelError::Collective(e)
}

impl GroupMember for RemoteMember {
    fn send_forward(&mut self, batch: &Batch<'_>, reply: LogitReply) -> Result<(), ModelError> {
        self.step += 1;
        (self.asked, self.n_rows) = (reply, batch.logit_rows.len());
        let payload = match batch.input {
            StageInput::Tokens(t) => Payload::Tokens(t.to_vec()),
            StageInput::Hidden(h) => Payload::Hidden(h.to_vec()),
        };
        let forward = Forward {
            step: self.step,
            payload,
            positions: batch.positions.to_vec(),
            seq_ids: batch.seq_ids.to_vec(),
            sample_rows: batch.logit_rows.to_vec(),
            row_tokens: Vec::new(),
        };
        let msg = match reply {
            LogitReply::Best => Group::ForwardBest(forward),
            LogitReply::Logits => Group::Forward(forward),
            // For embeddings `StageGroup::forward` asks the members for their share of
            // the logits: member 0 alone pools.
            LogitReply::Normed => {
                return Err(ModelError::Unsupported(
                    "embeddings on a tensor-parallel last stage".into(),
                ))
            }
        };
        self.peer.send(msg).map_err(model_error)
    }

    fn recv(&mut self) -> Result<StageOutput, ModelError> {
        match self.peer.recv().map_err(model_error)? {
            Group::Share { step, values } if step == self.step => match self.asked {
                LogitReply::Logits => Ok(StageOutput::Logits(values)),
                LogitReply::Normed => Err(ModelError::Unsupported(
                    "embeddings on a tensor-parallel last stage".into(),
                )),
                LogitReply::Best => decode_best(&values, self.n_rows, self.peer.rank)
                    .map(StageOutput::Best)
                    .map_err(model_error),
            },
            Group::Done => Ok(StageOutput::Hidden(Vec::new())),
            Group::Error { message, .. } => Err(model_error(self.peer.aborted(&message))),
            other => Err(model_error(self.peer.unexpected(format!(
                "{} where the answer to step {} was due",
                other.kind(),
                self.step
            )))),
        }
    }

    fn truncate_seq(&mut self, seq: u32, len: usize) -> Result<(), ModelError> {
        self.peer
            .send(Group::TruncateSeq { seq, len: len as u32 })
            .map_err(model_error)
    }
}

impl Drop for RemoteMember {
    fn drop(&mut self) {
        let _ = self.peer.send(Group::Shutdown);
    }
}

/// Serves member 0 over `leader` until it sends `Shutdown` or goes: computes each
/// `Forward` on `stage` (this member's slice) and answers with its logits (`Share`;
/// for a `ForwardBest`, each row's best of them as [`encode_best`] writes it), `Done`,
/// or `Error`.
pub fn serve_member(mut stage: Stage, leader: Arc<Peer>) -> Result<(), NodeError> {
    let first_layer = stage.span().layers.start as u32;
    loop {
        let msg = leader.recv().map_err(|e| NodeError::Protocol(e.to_string()))?;
        let reply = match msg {
            Group::Forward(ref f) | Group::ForwardBest(ref f) => {
                let reply = match msg {
                    Group::ForwardBest(_) => LogitReply::Best,
                    _ => LogitReply::Logits,
                };
                let hidden;
                let input = match &f.payload {
                    Payload::Tokens(t) => StageInput::Tokens(t),
                    Payload::Hidden(h) => StageInput::Hidden(h),
                    Payload::HiddenF16 { .. } => {
                        hidden = f
                            .payload
                            .widen_f16()
                            .ok_or_else(|| NodeError::Protocol("an f16 payload that does not widen".into()))?;
                        StageInput::Hidden(&hidden)
                    }
                };
                let batch = Batch {
                    input,
                    positions: &f.positions,
                    seq_ids: &f.seq_ids,
                    logit_rows: &f.sample_rows,
                    decode: false,
                };
                match stage.forward(&batch, reply) {
                    Ok(StageOutput::Logits(values)) => Group::Share { step: f.step, values },
                    Ok(StageOutput::Best(best)) => Group::Share {
                        step: f.step,
                        values: encode_best(&best),
                    },
                    Ok(StageOutput::Hidden(_)) => Group::Done,
                    Ok(StageOutput::Normed(_)) => Group::Error {
                        first_layer,
                        fault: baton_proto::Fault::Protocol,
                        message: "a member was asked for normed rows".into(),
                    },
                    Err(e) => {
                        let e = crate::stage_loop::StageError::Model(e);
                        Group::Error {
                            first_layer,
                            fault: e.fault(),
                            message: e.to_string(),
                        }
                    }
                }
            }
            Group::TruncateSeq { seq, len } => {
                stage.truncate_seq(seq, len as usize);
                continue;
            }
            Group::EndSeq { seq } => {
                stage.clear_seq(seq);
                continue;
            }
            Group::Shutdown => return Ok(()),
            other => return Err(NodeError::Protocol(format!("{} from member 0", other.kind()))),
        };
        leader.send(reply).map_err(|e| NodeError::Protocol(e.to_string()))?;
    }
}

/// How long member links wait for each other to come up.
const FORM_TIMEOUT: Duration = Duration::from_secs(60);

/// Member 0 dials members 1.. at `addrs` (in rank order); the links, by rank.
pub fn dial_members(addrs: &[String], token: Option<&[u8]>, opts: &LinkOptions) -> Result<Vec<Arc<Peer>>, NodeError> {
    addrs
        .iter()
        .enumerate()
        .map(|(i, addr)| dial(i + 1, addr, 0, token, opts))
        .collect()
}

fn dial(rank: usize, addr: &str, me: usize, token: Option<&[u8]>, opts: &LinkOptions) -> Result<Arc<Peer>, NodeError> {
    let deadline = Instant::now() + FORM_TIMEOUT;
    let mut link = loop {
        match connect_by(addr, opts, deadline) {
            Ok(link) => break link,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e.into()),
        }
    };
    client_handshake(link.as_mut(), Role::Ring, token)?;
    link.send(Message::Partial {
        sum: 0,
        values: vec![me as f32],
    })?;
    // The dial's deadline bounds every read of the link until cleared: a member that
    // computes for longer than FORM_TIMEOUT after the group formed must not time out.
    link.set_deadline(None)?;
    link.set_read_timeout(None)?;
    Peer::new(rank, link)
}

/// Member `from` of worker group `group` dials another member at `addr` (a `baton
/// worker`'s listener, reached as [`Role::Member`]) and introduces itself with
/// `JoinGroup`; the link is ready for the group's exchanges. Tries again until
/// `deadline` while nothing answers and `keep_trying` says so (the session goes on).
pub fn dial_group_member(
    addr: &str,
    group: u64,
    from: usize,
    token: Option<&[u8]>,
    opts: &LinkOptions,
    deadline: Instant,
    keep_trying: &dyn Fn() -> bool,
) -> Result<Box<dyn Link>, NodeError> {
    let mut link = loop {
        // Each attempt is short, so that an ended session stops trying soon.
        let attempt = deadline.min(Instant::now() + Duration::from_secs(2));
        match connect_by(addr, opts, attempt) {
            Ok(link) => break link,
            Err(_) if Instant::now() < deadline && keep_trying() => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e.into()),
        }
    };
    client_handshake(link.as_mut(), Role::Member, token)?;
    link.send(Message::JoinGroup {
        group,
        rank: from as u32,
    })?;
    link.set_deadline(None)?;
    link.set_read_timeout(None)?;
    Ok(link)
}

/// How a `baton tp-member` lets the other members in while its group forms: the
/// worker's door ([`crate::cluster`]'s gate): handshake slots per source, an absolute
/// deadline, a small frame limit until authenticated.
#[derive(Clone, Debug)]
pub struct MemberDoor {
    /// The cluster secret (`None`: loopback or `--insecure` only).
    pub token: Option<String>,
    /// Socket settings.
    pub link: LinkOptions,
    /// Longest a peer may take for its handshake and introduction.
    pub handshake_timeout: Duration,
    /// Connections in their handshake (and authenticated) at once.
    pub max_connections: usize,
    /// Connections in their handshake at once from one source.
    pub per_source: usize,
}

/// Member `rank` joins its group: dials the members below it, and takes one link from
/// each member above it and from member 0 through `listener`. A connection that fails
/// its handshake, introduces itself wrongly or comes a second time is refused and
/// logged; the member keeps waiting for the right ones (as long as it takes member 0
/// to come). Connections after the group formed are refused for as long as the
/// process runs.
pub fn join_group(
    rank: usize,
    addrs: &[String],
    listener: Listener,
    door: &MemberDoor,
) -> Result<(Vec<Arc<Peer>>, Arc<Peer>), NodeError> {
    use crate::gate::{Gate, GateConfig};
    let n = addrs.len() + 1;
    let gate = Gate::new(GateConfig {
        token: door.token.clone(),
        link: door.link.clone(),
        handshake_timeout: door.handshake_timeout,
        max_connections: door.max_connections,
        per_source: door.per_source,
    });
    let (arrived, arrivals) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("tp-accept".into())
        .spawn(move || accept_members(&listener, &gate, &arrived))
        .map_err(|e| NodeError::Request(format!("cannot start the member listener: {e}")))?;
    let token = door.token.as_deref().map(str::as_bytes);
    let mut peers = Vec::new();
    for lower in 1..rank {
        peers.push(dial(lower, &addrs[lower - 1], rank, token, &door.link)?);
    }
    let mut leader = None;
    while peers.len() < n - 1 {
        let (their, mut link): (usize, Box<dyn Link>) = arrivals
            .recv()
            .map_err(|_| NodeError::Protocol("the member listener stopped".into()))?;
        let expected = their == 0 || (rank + 1..n).contains(&their);
        if !expected || peers.iter().any(|p: &Arc<Peer>| p.rank == their) {
            let reason = format!("member {their} is not expected here, or linked already");
            tracing::warn!(peer = link.peer(), "refusing a member link: {reason}");
            refuse(link.as_mut(), RefusalCode::BadRequest, reason);
            continue;
        }
        let peer = Peer::new(their, link)?;
        if their == 0 {
            leader = Some(peer.clone());
        }
        peers.push(peer);
    }
    let leader = leader.ok_or_else(|| NodeError::Protocol("member 0 never dialed in".into()))?;
    Ok((peers, leader))
}

/// Accepts connections for as long as the process runs, each on a thread of its own
/// behind `gate`; a member's link, introduced, goes to `arrived` (refused once nobody
/// listens there: the group has formed).
fn accept_members(
    listener: &Listener,
    gate: &Arc<crate::gate::Gate>,
    arrived: &std::sync::mpsc::Sender<(usize, Box<dyn Link>)>,
) {
    loop {
        let incoming = match listener.accept() {
            Ok(incoming) => incoming,
            Err(e) => {
                // Out of file descriptors, most likely: wait rather than spin.
                tracing::debug!("accepting a connection failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let peer = incoming.peer().to_string();
        let admitted = match gate.accept(incoming) {
            Ok(admitted) => admitted,
            Err(why) => {
                tracing::warn!(%peer, "{why}");
                continue;
            }
        };
        let arrived = arrived.clone();
        let spawned = std::thread::Builder::new().name("tp-conn".into()).spawn(move || {
            let introduced = admitted.handshake().and_then(|(mut link, role, slot)| {
                let their = introduction(link.as_mut(), role)?;
                link.set_read_timeout(None)?;
                Ok((their, link, slot))
            });
            match introduced {
                Ok((their, link, _slot)) => {
                    if let Err(std::sync::mpsc::SendError((_, mut link))) = arrived.send((their, link)) {
                        let reason = "this member's group has formed".to_string();
                        tracing::warn!(%peer, "refusing member {their}: {reason}");
                        refuse(link.as_mut(), RefusalCode::Busy, reason);
                    }
                }
                Err(e) => tracing::warn!(%peer, "dropping connection: {e}"),
            }
        });
        if spawned.is_err() {
            tracing::warn!("dropping a connection: cannot start a thread for it");
        }
    }
}

/// The rank a member dialing in says it is (`Partial { sum: 0, values: [rank] }`, right
/// after its handshake as a ring link).
fn introduction(link: &mut dyn Link, role: Role) -> Result<usize, NodeError> {
    if role != Role::Ring {
        let reason = format!("a {role:?} connection is not a member of this group");
        refuse(link, RefusalCode::BadRequest, reason.clone());
        return Err(NodeError::Protocol(reason));
    }
    match link.recv()? {
        Message::Partial { sum: 0, values } if values.len() == 1 && values[0] >= 0.0 && values[0] < 256.0 => {
            Ok(values[0] as usize)
        }
        other => {
            let reason = format!("{} where a member's introduction was due", other.kind());
            refuse(link, RefusalCode::BadRequest, reason.clone());
            Err(NodeError::Protocol(reason))
        }
    }
}

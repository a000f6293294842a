//! A worker's links to the other members of the tensor-parallel group the head placed
//! it in ([`baton_proto::TpPlace`]): a full mesh over the workers' own listeners. Member
//! `r` dials every member below it (as [`baton_proto::Role::Member`], introducing itself
//! with `JoinGroup`) and takes the links of every member above it, which the listener
//! keeps for the session (`Shared::wait_members`). Every link is authenticated and
//! sealed like any other, and ending the session (its head's heartbeat stopped) closes
//! them all, so no member waits on a dead group.

use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use baton_net::{Link, LinkCloser};
use baton_proto::{Message, RefusalCode, TpPlace, MAX_TP_MEMBERS};

use baton_stage::gate::refuse;

use crate::error::TurnedAway;
use crate::server::{ConnSlot, Shared};
use baton_stage::tp_net::{dial_group_member, Peer};
use baton_stage::NodeError;

/// A member link another member of a tensor-parallel group dialed, waiting for this
/// worker's session to take it.
pub(crate) struct Arrived {
    group: u64,
    rank: u32,
    link: Box<dyn Link>,
    /// Closes the link once a session has taken it.
    closer: Option<LinkCloser>,
    slot: ConnSlot,
    /// When it arrived: a link no session takes within a handshake's time is dropped.
    at: Instant,
}

/// Serves a connection that announced itself as [`baton_proto::Role::Member`]: its
/// first frame (within the handshake's read timeout) must say which group and member
/// it is; the link then waits for this worker's session to take it.
pub(crate) fn accept_member(
    shared: &Shared,
    mut link: Box<dyn Link>,
    closer: Option<LinkCloser>,
    slot: ConnSlot,
) -> Result<(), NodeError> {
    let (group, rank) = match link.recv()? {
        Message::JoinGroup { group, rank } => (group, rank),
        other => {
            let reason = format!("{} where a member's JoinGroup was due", other.kind());
            refuse(link.as_mut(), RefusalCode::BadRequest, reason.clone());
            return Err(NodeError::Protocol(reason));
        }
    };
    link.set_read_timeout(None)?;
    let arrived = Arrived {
        group,
        rank,
        link,
        closer,
        slot,
        at: Instant::now(),
    };
    shared
        .arrive(arrived)
        .map_err(|(mut arrived, why)| why.refuse(arrived.link.as_mut()))
}

impl Shared {
    pub(crate) fn arrived(&self) -> MutexGuard<'_, Vec<Arrived>> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps a member link until the session takes it ([`Shared::wait_members`]); a
    /// second link from the same member of the same group, or more links than a group
    /// can have, are refused (given back with the reason).
    fn arrive(&self, arrived: Arrived) -> Result<(), (Arrived, TurnedAway)> {
        let mut waiting = self.arrived();
        // Links parked for longer than a group takes to form belong to no session.
        let stale = self.config.handshake_timeout;
        waiting.retain(|a| a.at.elapsed() < stale);
        if waiting
            .iter()
            .any(|a| a.group == arrived.group && a.rank == arrived.rank)
        {
            let why = TurnedAway::MemberLinked(arrived.rank);
            return Err((arrived, why));
        }
        if waiting.len() >= MAX_TP_MEMBERS {
            let why = TurnedAway::MembersWaiting(waiting.len());
            return Err((arrived, why));
        }
        waiting.push(arrived);
        self.members_ready.notify_all();
        Ok(())
    }

    /// Waits until members `ranks` of `group` have linked to this worker (or session
    /// `id` ends, or `deadline` passes); takes their links, by rank.
    pub(crate) fn wait_members(
        &self,
        id: u64,
        group: u64,
        ranks: std::ops::Range<usize>,
        deadline: Instant,
    ) -> Result<Vec<(usize, Arrived)>, NodeError> {
        let mut waiting = self.arrived();
        loop {
            let here = |rank: usize| waiting.iter().any(|a| a.group == group && a.rank as usize == rank);
            if ranks.clone().all(here) {
                let mut taken = Vec::new();
                for rank in ranks {
                    let at = waiting
                        .iter()
                        .position(|a| a.group == group && a.rank as usize == rank)
                        .expect("checked above");
                    let mut arrived = waiting.swap_remove(at);
                    self.attach(id, arrived.closer.take());
                    taken.push((rank, arrived));
                }
                return Ok(taken);
            }
            if self.is_aborted(id) {
                return Err(NodeError::Request(
                    "the session ended while waiting for the other members of its tensor-parallel group".into(),
                ));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing: Vec<String> = ranks.filter(|&r| !here(r)).map(|r| r.to_string()).collect();
                return Err(NodeError::Request(format!(
                    "members {} of this worker's tensor-parallel group did not link to it in time",
                    missing.join(", ")
                )));
            }
            waiting = self
                .members_ready
                .wait_timeout(waiting, left.min(Duration::from_millis(200)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A member's links to the rest of its group.
pub(crate) struct Mesh {
    /// This worker's rank.
    pub rank: usize,
    /// Members in the group.
    pub size: usize,
    /// Every other member, by rank.
    pub peers: Vec<Arc<Peer>>,
    /// The worker's connection slots of the links the others dialed, held while the
    /// links are used.
    _slots: Vec<ConnSlot>,
}

/// Links this worker (session `id`) with the rest of its group.
pub(crate) fn form_mesh(shared: &Shared, id: u64, place: &TpPlace) -> Result<Mesh, NodeError> {
    let (rank, size) = (place.rank as usize, place.members.len());
    // The others get their plans within milliseconds of this one (the head sends every
    // plan before it streams tensors): they have as long as a handshake.
    let deadline = Instant::now() + shared.config.handshake_timeout;
    let token = shared.config.token.as_deref().map(str::as_bytes);
    let mut peers = Vec::with_capacity(size - 1);
    for (lower, addr) in place.members[..rank].iter().enumerate() {
        let going_on = || !shared.is_aborted(id);
        let link = dial_group_member(addr, place.group, rank, token, &shared.config.link, deadline, &going_on)
            .map_err(|e| {
                NodeError::Request(format!(
                    "cannot link to member {lower} of the tensor-parallel group at {addr}: {e}"
                ))
            })?;
        shared.attach(id, link.closer().ok());
        peers.push(Peer::from_link(lower, link)?);
    }
    let mut slots = Vec::new();
    for (higher, arrived) in shared.wait_members(id, place.group, rank + 1..size, deadline)? {
        peers.push(Peer::from_link(higher, arrived.link)?);
        slots.push(arrived.slot);
    }
    tracing::info!(rank, size, group = place.group, "linked with the tensor-parallel group");
    Ok(Mesh {
        rank,
        size,
        peers,
        _slots: slots,
    })
}

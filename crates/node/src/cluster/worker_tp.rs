//! A worker's links to the other members of the tensor-parallel group the head placed
//! it in ([`baton_proto::TpPlace`]): a full mesh over the workers' own listeners. Member
//! `r` dials every member below it (as [`baton_proto::Role::Member`], introducing itself
//! with `JoinGroup`) and takes the links of every member above it, which the listener
//! keeps for the session (`Shared::wait_members`). Every link is authenticated and
//! sealed like any other, and ending the session (its head's heartbeat stopped) closes
//! them all, so no member waits on a dead group.

use std::sync::Arc;
use std::time::Instant;

use baton_proto::TpPlace;

use super::worker_server::{ConnSlot, Shared};
use crate::tp_net::{dial_group_member, Peer};
use crate::NodeError;

/// A member's links to the rest of its group.
pub(super) struct Mesh {
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
pub(super) fn form_mesh(shared: &Shared, id: u64, place: &TpPlace) -> Result<Mesh, NodeError> {
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
        shared.attach(link.closer().ok());
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

//! What can go wrong starting a worker (for the program that starts it), and why a
//! worker turns a peer's link away (for the peer).

use baton_net::{Link, NetError};
use baton_proto::auth::TokenError;
use baton_proto::RefusalCode;
use baton_stage::gate::refuse;
use baton_stage::NodeError;

/// Why a worker could not start ([`Worker::bind`](crate::Worker::bind),
/// [`Worker::on`](crate::Worker::on)).
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The listening socket could not be bound.
    #[error(transparent)]
    Bind(NetError),
    /// The cluster token cannot be used (empty, too short).
    #[error(transparent)]
    Token(#[from] TokenError),
    /// The models directory cannot be used (not creatable, a link, unreadable).
    #[error(transparent)]
    Models(NodeError),
}

/// Why this worker turned a link away after its handshake: the peer is told the text in
/// a `Refused` with [`TurnedAway::code`], and the connection's log line says it too.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum TurnedAway {
    /// A head connected while the worker serves the most heads it serves at once.
    #[error(
        "this worker serves {} heads already, the most it serves at once",
        crate::server::MAX_SESSIONS
    )]
    SessionsFull,
    /// A ring link named a session that does not run here.
    #[error("no session {0} runs on this worker")]
    NoSession(u64),
    /// A member of a tensor-parallel group linked a second time.
    #[error("member {0} of this group is linked already")]
    MemberLinked(u32),
    /// More member links wait than a group has members.
    #[error("{0} member links wait already, the most a group has")]
    MembersWaiting(usize),
}

impl TurnedAway {
    /// The refusal code the peer is told.
    pub(crate) fn code(&self) -> RefusalCode {
        match self {
            TurnedAway::SessionsFull => RefusalCode::Busy,
            TurnedAway::NoSession(_) | TurnedAway::MemberLinked(_) | TurnedAway::MembersWaiting(_) => {
                RefusalCode::BadRequest
            }
        }
    }

    /// Tells the peer on `link` why, and returns the error that ends its connection.
    pub(crate) fn refuse(self, link: &mut dyn Link) -> NodeError {
        let reason = self.to_string();
        refuse(link, self.code(), reason.clone());
        NodeError::Request(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_worker_says_busy_so_heads_retry_and_a_stray_link_is_a_bad_request() {
        assert_eq!(TurnedAway::SessionsFull.code(), RefusalCode::Busy);
        assert_eq!(
            TurnedAway::SessionsFull.to_string(),
            "this worker serves 8 heads already, the most it serves at once"
        );
        for stray in [
            TurnedAway::NoSession(7),
            TurnedAway::MemberLinked(1),
            TurnedAway::MembersWaiting(4),
        ] {
            assert_eq!(stray.code(), RefusalCode::BadRequest, "{stray}");
        }
    }
}

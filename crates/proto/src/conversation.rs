//! The conversations a link carries, each a type with exactly the messages that may
//! cross it. [`Message`] is the wire's union of every kind (the codec encodes and
//! decodes it); a receiver turns each frame into its link's conversation with
//! `TryFrom<Message>`, so a frame of another conversation is one typed error
//! ([`WrongConversation`]) in one place, and a receiver's `match` names only what may
//! arrive. A kind may belong to several conversations (`Refused` can end most of them;
//! member 0 drives a group with the ring's own `Forward`, `TruncateSeq`, `EndSeq`):
//! its number and encoding are the same whichever link it crosses.

use crate::{Capabilities, Fault, Forward, LoadPlan, Message, ModelRef, RefusalCode, Role, SampledToken};
use crate::{StartSeq, Stats, StepId, TensorEntry};

/// A frame of another conversation than the link carries: the peer broke the protocol.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{} does not belong on a {conversation} link", message.kind())]
pub struct WrongConversation {
    /// The conversation the link carries.
    pub conversation: &'static str,
    /// What arrived instead.
    pub message: Message,
}

/// One conversation: the messages one kind of link carries.
pub trait Conversation: TryFrom<Message, Error = WrongConversation> + Into<Message> {
    /// Its name, for errors and the protocol's tables (`ring`, `control`, …).
    const NAME: &'static str;
    /// The names of the message kinds that may cross its links.
    const KINDS: &'static [&'static str];
    /// The message's name, for logs and errors.
    fn kind(&self) -> &'static str;
}

/// Declares a conversation: the enum, its conversions to and from [`Message`] (each
/// variant has the wire message's name and fields), and its [`Conversation`] impl.
/// A tuple variant names its binding (`Forward(forward: Forward)`).
macro_rules! conversation {
    (
        $(#[$meta:meta])*
        $conv:ident = $label:literal {
            $(
                $(#[$vmeta:meta])*
                $variant:ident
                $( { $( $(#[$fmeta:meta])* $field:ident : $fty:ty ),* $(,)? } )?
                $( ( $bind:ident : $inner:ty ) )?
            ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq)]
        pub enum $conv {
            $(
                $(#[$vmeta])*
                $variant $( { $( $(#[$fmeta])* $field: $fty ),* } )? $( ($inner) )?,
            )*
        }

        impl From<$conv> for Message {
            fn from(msg: $conv) -> Message {
                match msg {
                    $(
                        $conv::$variant $( { $($field),* } )? $( ($bind) )? =>
                            Message::$variant $( { $($field),* } )? $( ($bind) )?,
                    )*
                }
            }
        }

        impl TryFrom<Message> for $conv {
            type Error = WrongConversation;

            fn try_from(msg: Message) -> Result<$conv, WrongConversation> {
                match msg {
                    $(
                        Message::$variant $( { $($field),* } )? $( ($bind) )? =>
                            Ok($conv::$variant $( { $($field),* } )? $( ($bind) )?),
                    )*
                    message => Err(WrongConversation { conversation: $label, message }),
                }
            }
        }

        impl Conversation for $conv {
            const NAME: &'static str = $label;
            const KINDS: &'static [&'static str] = &[$(stringify!($variant)),*];

            fn kind(&self) -> &'static str {
                match self {
                    $( $conv::$variant { .. } => stringify!($variant), )*
                }
            }
        }
    };
}

conversation! {
    /// The first frames on every connection, before it is told what it carries (see
    /// [`handshake`](crate::handshake)).
    Handshake = "handshake" {
        /// Opens a connection: protocol version, role, and a fresh random challenge.
        Hello { version: u32, role: Role, nonce: [u8; 32] },
        /// Proof of the cluster secret: HMAC over the peer's challenge.
        Auth { proof: [u8; 32] },
        /// The peer refuses the connection and says why (then closes it).
        Refused { code: RefusalCode, reason: String },
    }
}

conversation! {
    /// A head's session with a worker ([`Role::Head`]), until the worker's stage runs:
    /// describe, probe, plan, stream, loaded. After `Loaded` the same link carries the
    /// [`Ring`] (the first stage's input, or the last stage's answers).
    Control = "control" {
        /// Head → worker: describe yourself for this model.
        Describe { model: ModelRef },
        /// Worker → head.
        Capabilities(caps: Capabilities),
        /// Head → worker, between `Describe` and `LoadPlan`: filler the head times;
        /// the worker answers with an empty `Probe`.
        Probe { data: Vec<u8> },
        /// Head → worker: load this.
        LoadPlan(plan: Box<LoadPlan>),
        /// Head → worker (streaming): the file's header and tensor index, and the tensors
        /// that follow; the worker's answer names those it will not fetch elsewhere.
        StreamStart { header: Vec<u8>, tensors: Vec<TensorEntry> },
        /// Head → worker (streaming): bytes of one tensor of `StreamStart`.
        TensorChunk { index: u32, offset: u64, data: Vec<u8> },
        /// Head → worker: fetch these tensors from the worker at `peer`.
        FetchFrom { peer: String, tensors: Vec<u32> },
        /// Worker → head: the stage is loaded and its ring links are up.
        Loaded { resident: u64, received: u64 },
        /// Head → worker: the plan leaves this worker out.
        Shutdown,
        /// Worker → head: the worker refuses the head or its plan (busy, load failed).
        Refused { code: RefusalCode, reason: String },
        /// Head → worker: a proof of a token this worker does not have (it refuses it).
        Auth { proof: [u8; 32] },
    }
}

conversation! {
    /// A worker fetching a stage's tensors from another worker that holds the file
    /// ([`Role::Fetch`]): it asks with `StreamStart`, `TensorChunk`s answer.
    Fetch = "fetch" {
        /// The asker → the holder: the model's header and the tensors wanted.
        StreamStart { header: Vec<u8>, tensors: Vec<TensorEntry> },
        /// The holder → the asker: bytes of one tensor.
        TensorChunk { index: u32, offset: u64, data: Vec<u8> },
        /// The holder refuses (it lacks the file, or it is another file).
        Refused { code: RefusalCode, reason: String },
    }
}

conversation! {
    /// The head watching a worker on a connection of its own ([`Role::Heartbeat`]).
    Heartbeat = "heartbeat" {
        /// Head → worker: are you there? (see [`Message::Ping`]).
        Ping { timeout_ms: u32, session: u64 },
        /// Worker → head: yes.
        Pong,
        /// Worker → head: it leaves the cluster, or the heartbeat is malformed.
        Refused { code: RefusalCode, reason: String },
        /// Head → worker: a proof of a token this worker does not have (it refuses it).
        Auth { proof: [u8; 32] },
    }
}

conversation! {
    /// The ring ([`Role::Ring`] links, and the head's links to its first and last
    /// stages): head → first stage → … → last stage → head.
    Ring = "ring" {
        /// The first frame on a [`Role::Ring`] link: the session it joins.
        JoinRing { session: u64 },
        /// Start (or restart) a sequence.
        StartSeq(start: StartSeq),
        /// Keep only the first `len` tokens of `seq` on every stage.
        TruncateSeq { seq: u32, len: u32 },
        /// Keep a copy of `seq`'s recurrent states after its first `len` tokens.
        Checkpoint { seq: u32, len: u32 },
        /// Forget `seq` on every stage.
        EndSeq { seq: u32 },
        /// A batch to compute.
        Forward(forward: Forward),
        /// The last stage's answer to a `Forward`: one token per sampled row.
        Sampled { step: StepId, tokens: Vec<SampledToken> },
        /// The last stage's answer to a `Forward` that ends a pooled sequence.
        Pooled { step: StepId, seq: u32, values: Vec<f32> },
        /// The last stage's answer to a control message.
        Done,
        /// A stage failed to handle a message (see [`Message::Error`]).
        Error { first_layer: u32, fault: Fault, message: String },
        /// Each stage appends its figures.
        Stats(stats: Stats),
        /// Stop every stage's loop.
        Shutdown,
    }
}

conversation! {
    /// The links between the members of a tensor-parallel group ([`Role::Member`], or
    /// [`Role::Ring`] between `baton tp-member`s): their exchanges, and member 0
    /// driving the others with the ring's own messages.
    Group = "group" {
        /// The first frame on a [`Role::Member`] link: the dialer's group and rank.
        JoinGroup { group: u64, rank: u32 },
        /// A member's slice of collective number `sum` (`sum` 0: a `baton tp-member`'s
        /// introduction, `[rank]`).
        Partial { sum: u64, values: Vec<f32> },
        /// Member 0 → a member: a batch, answered with its share of the logits.
        Forward(forward: Forward),
        /// Member 0 → a member of a last stage: a batch, answered with each row's best.
        ForwardBest(forward: Forward),
        /// A member → member 0: its answer to step `step`.
        Share { step: u64, values: Vec<f32> },
        /// Member 0 → a member: keep only the first `len` tokens of `seq`.
        TruncateSeq { seq: u32, len: u32 },
        /// Member 0 → a member: forget `seq`.
        EndSeq { seq: u32 },
        /// A member → member 0: a step that computed no logits.
        Done,
        /// A member failed a step, or aborted an exchange.
        Error { first_layer: u32, fault: Fault, message: String },
        /// Member 0 → a member: the group is done.
        Shutdown,
    }
}

impl From<StartSeq> for Ring {
    fn from(start: StartSeq) -> Ring {
        Ring::StartSeq(start)
    }
}

/// Every conversation's name and kinds, in the order the protocol's table lists them.
#[cfg(test)]
pub(crate) const CONVERSATIONS: [(&str, &[&str]); 6] = [
    (Handshake::NAME, Handshake::KINDS),
    (Control::NAME, Control::KINDS),
    (Fetch::NAME, Fetch::KINDS),
    (Heartbeat::NAME, Heartbeat::KINDS),
    (Ring::NAME, Ring::KINDS),
    (Group::NAME, Group::KINDS),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::tests::samples;

    /// Every sample of a kind a conversation lists converts into it and back to the
    /// same bytes; every other sample is refused, and the refusal hands it back.
    fn round_trips<C: Conversation + std::fmt::Debug>() {
        // Bytes, not values: a sample's log-probability may be NaN.
        let bytes = |msg: &Message| {
            let mut out = Vec::new();
            crate::encode(msg, &mut out);
            out
        };
        for msg in samples() {
            match C::try_from(msg.clone()) {
                Ok(conv) => {
                    assert!(C::KINDS.contains(&msg.kind()), "{} took {msg:?}", C::NAME);
                    assert_eq!(conv.kind(), msg.kind());
                    assert_eq!(bytes(&conv.into()), bytes(&msg));
                }
                Err(wrong) => {
                    assert!(!C::KINDS.contains(&msg.kind()), "{} refused {msg:?}", C::NAME);
                    assert_eq!(wrong.conversation, C::NAME);
                    assert_eq!(bytes(&wrong.message), bytes(&msg));
                }
            }
        }
    }

    #[test]
    fn each_conversation_takes_exactly_its_kinds() {
        round_trips::<Handshake>();
        round_trips::<Control>();
        round_trips::<Fetch>();
        round_trips::<Heartbeat>();
        round_trips::<Ring>();
        round_trips::<Group>();
    }

    #[test]
    fn every_kind_belongs_to_a_conversation() {
        for name in crate::codec::KIND_NAMES {
            assert!(
                CONVERSATIONS.iter().any(|(_, kinds)| kinds.contains(&name)),
                "{name} crosses no link"
            );
        }
    }

    #[test]
    fn a_wrong_conversation_says_what_arrived_and_where() {
        let wrong = Ring::try_from(Message::Pong).unwrap_err();
        assert_eq!(wrong.to_string(), "Pong does not belong on a ring link");
    }
}

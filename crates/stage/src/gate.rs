//! The door of a listening node (`baton worker`, `baton tp-member`): which connections
//! get a handshake slot ([`Admission`], per source and in all, with probation), an
//! absolute deadline for the whole handshake, a small frame limit until the peer has
//! authenticated, and an authenticated slot for what it serves afterwards. A bad
//! connection costs its own thread and slot, never the listener.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use baton_net::{server_handshake_admitting, Incoming, Link, LinkCloser, LinkOptions, NetError};
use baton_proto::{Message, RefusalCode, Role, PROTOCOL_VERSION};

pub use crate::admission::TooManyConnections;
use crate::admission::{Accepted, Admission, ConnId, Limits};
use crate::NodeError;

/// Why [`Gate::accept`] turned a connection away at once (for the log).
#[derive(Debug, thiserror::Error)]
pub enum Dropped {
    /// The connection could not be given a handle that closes it.
    #[error("dropping connection: {0}")]
    Link(#[source] NetError),
    /// Too many connections wait on probation already (the text says which cap).
    #[error("dropping connection: {0}")]
    Crowded(String),
}

/// Largest frame a peer may send before it has authenticated: handshake frames are
/// tiny, and a stranger must not make the node allocate `max_frame` bytes.
pub const HANDSHAKE_MAX_FRAME: usize = 64 << 10;

/// How long a connection that found every handshake slot taken has to send its `Hello`
/// (and finish TLS first, with TLS) to take one (see `admission.rs`). Nodes send theirs
/// at once; a stranger that dawdles is dropped instead of displacing anyone.
const PROBATION_GRACE: Duration = Duration::from_millis(500);

/// Connections waiting on probation at once; more are closed at once.
const MAX_PROBATION: usize = 16;

/// What a gate admits, and how.
#[derive(Clone, Debug)]
pub struct GateConfig {
    /// Cluster secret; `None` accepts any peer that announces itself.
    pub token: Option<String>,
    /// Socket settings once authenticated (`max_frame` included).
    pub link: LinkOptions,
    /// Longest a peer may take for the whole handshake, TLS included.
    pub handshake_timeout: Duration,
    /// Most connections in their handshake at once, and most authenticated ones.
    pub max_connections: usize,
    /// Most connections in their handshake at once from one source.
    pub per_source: usize,
}

/// A listener's admission state, shared by its connections' threads.
pub struct Gate {
    pub config: GateConfig,
    admission: Mutex<Admission<LinkCloser>>,
}

/// A connection let in to its handshake ([`Gate::accept`]); its slot is freed when
/// dropped (the handshake failed, the thread panicked) or moved on to an
/// authenticated slot.
pub struct Admitted {
    gate: Arc<Gate>,
    id: ConnId,
    /// Why it holds no handshake slot yet, if it is on probation.
    probation: Option<String>,
    incoming: Option<Incoming>,
}

/// An authenticated connection's slot; freed when dropped, whatever ends the
/// connection (a panic included).
pub struct ConnSlot {
    gate: Arc<Gate>,
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.gate.admission().end_authenticated();
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.gate.admission().end_handshake(self.id);
    }
}

impl Gate {
    /// A gate with nobody in it.
    pub fn new(config: GateConfig) -> Arc<Gate> {
        let limits = Limits {
            max_handshakes: config.max_connections,
            per_source: config.per_source.max(1),
            max_authenticated: config.max_connections,
            max_probation: MAX_PROBATION,
        };
        Arc::new(Gate {
            config,
            admission: Mutex::new(Admission::new(limits)),
        })
    }

    fn admission(&self) -> MutexGuard<'_, Admission<LinkCloser>> {
        self.admission.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A connection just accepted: let in to its handshake (maybe on probation), or
    /// turned away with the reason (to log).
    pub fn accept(self: &Arc<Self>, incoming: Incoming) -> Result<Admitted, Dropped> {
        let closer = incoming.closer().map_err(Dropped::Link)?;
        let accepted = self.admission().accept(incoming.source(), closer, Instant::now());
        let (id, probation) = match accepted {
            Accepted::Serve(id) => (id, None),
            Accepted::Probation(id, why) => (id, Some(why)),
            Accepted::Drop(why) => return Err(Dropped::Crowded(why)),
        };
        Ok(Admitted {
            gate: self.clone(),
            id,
            probation,
            incoming: Some(incoming),
        })
    }
}

impl Admitted {
    /// Where the peer reached this node (see [`Incoming::local_addr`]).
    pub fn local_addr(&self) -> &str {
        self.incoming.as_ref().map_or("", Incoming::local_addr)
    }

    /// Runs the connection's handshake under the gate's deadline; returns the link
    /// (deadline cleared, full frame size, reads still timed out after the handshake
    /// timeout: the caller sets its own once it knows the role),
    /// the role the peer announced and its authenticated slot. A peer that is too slow,
    /// sends something else than a handshake, fails the token or finds no slot free
    /// (told why) is an error.
    pub fn handshake(mut self) -> Result<(Box<dyn Link>, Role, ConnSlot), NodeError> {
        let gate = self.gate.clone();
        let config = &gate.config;
        let incoming = self.incoming.take().expect("taken once");
        let started = Instant::now();
        let deadline = started + config.handshake_timeout;
        let first_by = match self.probation {
            Some(_) => deadline.min(started + PROBATION_GRACE),
            None => deadline,
        };
        let mut opts = config.link.clone();
        opts.read_timeout = Some(config.handshake_timeout);
        opts.max_frame = opts.max_frame.min(HANDSHAKE_MAX_FRAME);
        let first = incoming.into_link_by(&opts, first_by).and_then(|mut link| {
            let first = link.recv()?;
            Ok((link, first))
        });
        let (mut link, first) = match (first, &self.probation) {
            (Ok(read), None) => read,
            (Ok((link, first)), Some(why)) => {
                if !matches!(first, Message::Hello { version, .. } if version == PROTOCOL_VERSION) {
                    return Err(NodeError::Request(format!(
                        "{why}, and it sent {} where a Hello was expected",
                        first.kind()
                    )));
                }
                if let Some((evicted, what)) = gate.admission().hello(self.id) {
                    evicted.close();
                    tracing::info!(peer = link.peer(), "closed {what} to make room for this connection");
                }
                (link, first)
            }
            (Err(e), None) => return Err(e.into()),
            (Err(e), Some(why)) => {
                return Err(NodeError::Request(format!(
                    "{why}; it sent no Hello within {:.1} s ({e})",
                    PROBATION_GRACE.as_secs_f32()
                )))
            }
        };
        link.set_deadline(Some(deadline))?;
        let token = config.token.as_deref().map(str::as_bytes);
        let (role, slot) = server_handshake_admitting(link.as_mut(), token, first, |_| self.authenticated())?;
        link.set_deadline(None)?;
        link.set_max_frame(config.link.max_frame);
        Ok((link, role, slot))
    }

    /// The connection has authenticated: it takes an authenticated slot, or is told why
    /// not. Its handshake slot is freed either way (when `self` drops).
    fn authenticated(&self) -> Result<ConnSlot, TooManyConnections> {
        self.gate.admission().authenticated(self.id)?;
        Ok(ConnSlot {
            gate: self.gate.clone(),
        })
    }
}

/// Tells the peer why it is refused, and closes so that it can read it.
pub fn refuse(link: &mut dyn Link, code: RefusalCode, reason: String) {
    if link.send(Message::Refused { code, reason }).is_ok() {
        link.close_gently();
    }
}

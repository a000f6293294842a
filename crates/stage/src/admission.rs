//! Which connections a worker serves, as a pure function of what it holds and when
//! (no sockets: the worker calls in and acts on the answer; tests drive it with tables).
//!
//! Two pools, so that strangers cannot starve the cluster's own nodes (issue 16: 70
//! connections that each sent a byte every 5 s locked every head out):
//! - **In their handshake**: at most `max_handshakes` at once, and at most `per_source`
//!   from one source (an IPv4 address, an IPv6 /64, a Unix socket). Each also runs under
//!   an absolute deadline (the worker's `--handshake-timeout`), so a slot is never held
//!   for long. A connection that finds either cap full is put *on probation*: it has a
//!   short grace to send a `Hello`; if it does, it takes the slot of the oldest
//!   handshake of the source that holds the most (its own source when that one is full),
//!   which is closed; if not, it is dropped. So a head gets in by sending its `Hello` at
//!   once, as heads do, while connections that dawdle make room.
//! - **Authenticated**: at most `max_authenticated` (`--max-connections`). Only a
//!   connection that has proved the token (or, without a token, announced itself) takes
//!   one; one that finds none free is told why in a `Busy` refusal, never just reset.

use std::collections::BTreeMap;
use std::time::Instant;

/// The worker's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections in their handshake at once, from all sources.
    pub max_handshakes: usize,
    /// Connections in their handshake at once from one source.
    pub per_source: usize,
    /// Authenticated connections at once (`--max-connections`).
    pub max_authenticated: usize,
    /// Connections on probation at once; more are dropped at once.
    pub max_probation: usize,
}

/// A connection's number, given when it is accepted.
pub type ConnId = u64;

/// What to do with a connection just accepted.
#[derive(Debug, PartialEq, Eq)]
pub enum Accepted {
    /// Serve it: its handshake has a slot.
    Serve(ConnId),
    /// Every slot it could take is held: it may take one by sending its `Hello` within
    /// the grace period ([`Admission::hello`]); the reason says which cap is full.
    Probation(ConnId, String),
    /// Drop it at once (too many on probation already).
    Drop(String),
}

/// Why a connection that authenticated finds no authenticated slot: the worker serves
/// `serving` already, the most `--max-connections` allows. The peer is told this text.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("too many connections: this worker serves {serving} already, the most it allows (--max-connections)")]
pub struct TooManyConnections {
    pub serving: usize,
}

/// One connection in its handshake.
#[derive(Debug)]
struct Handshake<C> {
    source: String,
    started: Instant,
    /// Closes the connection (another one took its slot).
    closer: C,
    /// On probation: holds no slot yet.
    probation: bool,
}

/// The two pools and who is in them; `C` closes a connection (a `LinkCloser` in the
/// worker, anything in tests).
#[derive(Debug)]
pub struct Admission<C> {
    limits: Limits,
    next: ConnId,
    handshakes: BTreeMap<ConnId, Handshake<C>>,
    authenticated: usize,
}

impl<C> Admission<C> {
    /// Nobody connected yet.
    pub fn new(limits: Limits) -> Admission<C> {
        Admission {
            limits,
            next: 0,
            handshakes: BTreeMap::new(),
            authenticated: 0,
        }
    }

    /// Handshakes holding a slot: all of them, and those from `source`.
    fn counts(&self, source: &str) -> (usize, usize) {
        let held = self.handshakes.values().filter(|h| !h.probation);
        let (mut total, mut from_source) = (0, 0);
        for h in held {
            total += 1;
            from_source += usize::from(h.source == source);
        }
        (total, from_source)
    }

    /// A connection from `source` was accepted at `now`.
    pub fn accept(&mut self, source: &str, closer: C, now: Instant) -> Accepted {
        let (total, from_source) = self.counts(source);
        let full = if from_source >= self.limits.per_source {
            Some(format!(
                "{from_source} connections from {source} are in their handshake, the most allowed from one source"
            ))
        } else if total >= self.limits.max_handshakes {
            Some(format!(
                "{total} connections are in their handshake, the most allowed (--max-connections)"
            ))
        } else {
            None
        };
        let on_probation = self.handshakes.values().filter(|h| h.probation).count();
        if full.is_some() && on_probation >= self.limits.max_probation {
            let why = full.unwrap_or_default();
            return Accepted::Drop(format!("{why}, and {on_probation} more are waiting to take a slot"));
        }
        self.next += 1;
        let id = self.next;
        self.handshakes.insert(
            id,
            Handshake {
                source: source.to_string(),
                started: now,
                closer,
                probation: full.is_some(),
            },
        );
        match full {
            None => Accepted::Serve(id),
            Some(why) => Accepted::Probation(id, why),
        }
    }

    /// Connection `id`, on probation, sent its `Hello` in time: it takes a slot. Returns
    /// the connection it takes the slot from (to be closed, with a description for the
    /// log), if the slots are still full.
    pub fn hello(&mut self, id: ConnId) -> Option<(C, String)> {
        let source = match self.handshakes.get(&id) {
            Some(h) if h.probation => h.source.clone(),
            _ => return None,
        };
        let (total, from_source) = self.counts(&source);
        let victim_source = if from_source >= self.limits.per_source {
            Some(source.clone())
        } else if total >= self.limits.max_handshakes {
            self.busiest_source()
        } else {
            None
        };
        let evicted = victim_source.and_then(|victim| {
            let oldest = self
                .handshakes
                .iter()
                .filter(|(_, h)| !h.probation && h.source == victim)
                .min_by_key(|(other, h)| (h.started, **other))
                .map(|(other, _)| *other)?;
            let h = self.handshakes.remove(&oldest)?;
            Some((h.closer, format!("the oldest handshake from {}", h.source)))
        });
        if let Some(h) = self.handshakes.get_mut(&id) {
            h.probation = false;
        }
        evicted
    }

    /// The source holding the most handshake slots (the first by name among equals).
    fn busiest_source(&self) -> Option<String> {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for h in self.handshakes.values().filter(|h| !h.probation) {
            *counts.entry(h.source.as_str()).or_default() += 1;
        }
        let most = counts.values().copied().max()?;
        counts.into_iter().find(|&(_, n)| n == most).map(|(s, _)| s.to_string())
    }

    /// Connection `id` authenticated: it leaves the handshake pool and takes an
    /// authenticated slot, or is told why not.
    pub fn authenticated(&mut self, id: ConnId) -> Result<(), TooManyConnections> {
        self.handshakes.remove(&id);
        if self.authenticated >= self.limits.max_authenticated {
            return Err(TooManyConnections {
                serving: self.authenticated,
            });
        }
        self.authenticated += 1;
        Ok(())
    }

    /// Connection `id` ended during its handshake (or was evicted): its slot is free.
    pub fn end_handshake(&mut self, id: ConnId) {
        self.handshakes.remove(&id);
    }

    /// An authenticated connection ended.
    pub fn end_authenticated(&mut self) {
        self.authenticated = self.authenticated.saturating_sub(1);
    }

    /// Connections in their handshake holding a slot, on probation, and authenticated.
    #[cfg(test)]
    pub fn load(&self) -> (usize, usize, usize) {
        let probation = self.handshakes.values().filter(|h| h.probation).count();
        (self.handshakes.len() - probation, probation, self.authenticated)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const LIMITS: Limits = Limits {
        max_handshakes: 4,
        per_source: 2,
        max_authenticated: 2,
        max_probation: 2,
    };

    /// Steps of a table: what happens, and what the admission must answer.
    enum Step {
        /// A connection from the source, named by the test, at second `t`.
        Accept(&'static str, &'static str, u64),
        Hello(&'static str),
        Auth(&'static str),
        End(&'static str),
    }
    use Step::*;

    /// Runs `steps`; returns one line per step: what was answered and what was closed.
    fn run(steps: &[Step]) -> Vec<String> {
        let start = Instant::now();
        let mut admission: Admission<&'static str> = Admission::new(LIMITS);
        let mut ids: BTreeMap<&str, ConnId> = BTreeMap::new();
        let mut out = Vec::new();
        for step in steps {
            out.push(match *step {
                Accept(name, source, t) => match admission.accept(source, name, start + Duration::from_secs(t)) {
                    Accepted::Serve(id) => {
                        ids.insert(name, id);
                        format!("{name}: serve")
                    }
                    Accepted::Probation(id, _) => {
                        ids.insert(name, id);
                        format!("{name}: probation")
                    }
                    Accepted::Drop(_) => format!("{name}: drop"),
                },
                Hello(name) => match admission.hello(ids[name]) {
                    Some((closed, _)) => format!("{name}: in, {closed} closed"),
                    None => format!("{name}: in"),
                },
                Auth(name) => match admission.authenticated(ids[name]) {
                    Ok(()) => format!("{name}: authenticated"),
                    Err(_) => format!("{name}: refused"),
                },
                End(name) => {
                    admission.end_handshake(ids[name]);
                    format!("{name}: ended")
                }
            });
        }
        out
    }

    #[test]
    fn one_source_gets_its_share_and_a_prompt_hello_displaces_its_oldest() {
        let steps = [
            Accept("a1", "10.0.0.9", 0),
            Accept("a2", "10.0.0.9", 1),
            // The source's share is full: a third waits on probation, and its Hello
            // closes the oldest of the source (a1), not another source's.
            Accept("b", "10.0.0.7", 2),
            Accept("a3", "10.0.0.9", 3),
            Hello("a3"),
            Accept("a4", "10.0.0.9", 4),
            Hello("a4"),
        ];
        assert_eq!(
            run(&steps),
            [
                "a1: serve",
                "a2: serve",
                "b: serve",
                "a3: probation",
                "a3: in, a1 closed",
                "a4: probation",
                "a4: in, a2 closed",
            ]
        );
    }

    #[test]
    fn a_full_worker_makes_room_from_the_busiest_source_and_drops_what_cannot_wait() {
        let steps = [
            Accept("a1", "A", 0),
            Accept("a2", "A", 1),
            Accept("b1", "B", 2),
            Accept("c1", "C", 3),
            // Four handshakes, the most: the head from D displaces A's oldest.
            Accept("head", "D", 4),
            Hello("head"),
            // Two more wait on probation; a third finds no room even to wait.
            Accept("x", "E", 5),
            Accept("y", "F", 5),
            Accept("z", "G", 5),
            // A slot freed meanwhile: a Hello takes it without closing anyone.
            End("c1"),
            Hello("x"),
            // Probationers that never say Hello just end.
            End("y"),
            Accept("w", "H", 6),
        ];
        assert_eq!(
            run(&steps),
            [
                "a1: serve",
                "a2: serve",
                "b1: serve",
                "c1: serve",
                "head: probation",
                "head: in, a1 closed",
                "x: probation",
                "y: probation",
                "z: drop",
                "c1: ended",
                "x: in",
                "y: ended",
                "w: probation",
            ]
        );
    }

    #[test]
    fn only_authenticated_connections_count_against_max_connections() {
        let steps = [
            Accept("h1", "A", 0),
            Auth("h1"),
            Accept("h2", "A", 0),
            Auth("h2"),
            // Two authenticated, the most: a third proves the token and is refused
            // (told why), while handshakes still come and go.
            Accept("s1", "B", 1),
            Accept("s2", "B", 1),
            Accept("h3", "A", 2),
            Auth("h3"),
            Accept("h4", "A", 3),
        ];
        assert_eq!(
            run(&steps),
            [
                "h1: serve",
                "h1: authenticated",
                "h2: serve",
                "h2: authenticated",
                "s1: serve",
                "s2: serve",
                "h3: serve",
                "h3: refused",
                "h4: serve",
            ]
        );
        let mut admission: Admission<()> = Admission::new(LIMITS);
        let Accepted::Serve(id) = admission.accept("A", (), Instant::now()) else {
            panic!()
        };
        admission.authenticated(id).unwrap();
        assert_eq!(admission.load(), (0, 0, 1));
        admission.end_authenticated();
        assert_eq!(admission.load(), (0, 0, 0));
        let Accepted::Serve(id) = admission.accept("A", (), Instant::now()) else {
            panic!()
        };
        let Accepted::Serve(_) = admission.accept("A", (), Instant::now()) else {
            panic!()
        };
        let Accepted::Probation(_, why) = admission.accept("A", (), Instant::now()) else {
            panic!()
        };
        assert_eq!(
            why,
            "2 connections from A are in their handshake, the most allowed from one source"
        );
        admission.end_handshake(id);
        assert_eq!(admission.load(), (1, 1, 0));
    }
}

//! In-process links: channels between stages (or a head and a stage) in one process.
//! Messages move as values, never as bytes, so these links count no bytes and have no
//! frame limit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_proto::auth::FrameKeys;

use baton_proto::Message;

use crate::framed::{Counters, LinkCloser};
use crate::{Halves, Link, NetError, Rx, Tx};

/// What travels on an in-process channel.
enum Item {
    Message(Message),
    /// The link was closed: wakes a reader blocked on it.
    Close,
}

/// In-process sending half: a channel to a stage in the same process.
pub struct LocalTx {
    inner: mpsc::Sender<Item>,
    peer: String,
    closed: Arc<AtomicBool>,
    counters: Arc<Counters>,
}

/// In-process receiving half.
pub struct LocalRx {
    inner: mpsc::Receiver<Item>,
    peer: String,
    closed: Arc<AtomicBool>,
    timeout: Option<Duration>,
    /// No receive waits past this, when set.
    deadline: Option<Instant>,
    counters: Arc<Counters>,
}

/// A one-way in-process link; `peer` names the receiving end in errors.
pub fn local_link(peer: &str) -> (LocalTx, LocalRx) {
    let (tx, rx) = mpsc::channel();
    let closed = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    (
        LocalTx {
            inner: tx,
            peer: peer.to_string(),
            closed: closed.clone(),
            counters: counters.clone(),
        },
        LocalRx {
            inner: rx,
            peer: peer.to_string(),
            closed,
            timeout: None,
            deadline: None,
            counters,
        },
    )
}

impl Tx for LocalTx {
    fn send(&mut self, msg: Message) -> Result<(), NetError> {
        let closed = || NetError::Closed {
            peer: self.peer.clone(),
        };
        if self.closed.load(Ordering::SeqCst) {
            return Err(closed());
        }
        self.inner.send(Item::Message(msg)).map_err(|_| closed())
    }

    fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }
}

impl Rx for LocalRx {
    fn recv(&mut self) -> Result<Message, NetError> {
        let closed = || NetError::Closed {
            peer: self.peer.clone(),
        };
        if self.closed.load(Ordering::SeqCst) {
            return Err(closed());
        }
        let left = self.deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let wait = match (self.timeout, left) {
            (Some(t), Some(l)) => Some(t.min(l)),
            (t, l) => t.or(l),
        };
        let item = match wait {
            None => self.inner.recv().map_err(|_| closed())?,
            Some(timeout) => self.inner.recv_timeout(timeout).map_err(|e| match e {
                mpsc::RecvTimeoutError::Timeout => NetError::Timeout {
                    peer: self.peer.clone(),
                },
                mpsc::RecvTimeoutError::Disconnected => closed(),
            })?,
        };
        match item {
            Item::Message(msg) => Ok(msg),
            Item::Close => Err(closed()),
        }
    }

    fn peer(&self) -> &str {
        &self.peer
    }

    fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }
}

/// One end of a two-way in-process link (see [`local_pair`]).
pub struct LocalLink {
    tx: LocalTx,
    rx: LocalRx,
    /// This end's own inbox, so that closing wakes this end's reader too.
    wake: mpsc::Sender<Item>,
}

/// Two connected ends of an in-process link: `(a, b)`, where `a` reaches the peer named
/// `b_name` and `b` the one named `a_name`. Closing either end closes both ways.
pub fn local_pair(a_name: &str, b_name: &str) -> (LocalLink, LocalLink) {
    let (to_b, b_inbox) = mpsc::channel();
    let (to_a, a_inbox) = mpsc::channel();
    let closed = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    let end = |to_peer: &mpsc::Sender<Item>, inbox, own: &mpsc::Sender<Item>, peer: &str| LocalLink {
        tx: LocalTx {
            inner: to_peer.clone(),
            peer: peer.to_string(),
            closed: closed.clone(),
            counters: counters.clone(),
        },
        rx: LocalRx {
            inner: inbox,
            peer: peer.to_string(),
            closed: closed.clone(),
            timeout: None,
            deadline: None,
            counters: counters.clone(),
        },
        wake: own.clone(),
    };
    let a = end(&to_b, a_inbox, &to_a, b_name);
    let b = end(&to_a, b_inbox, &to_b, a_name);
    (a, b)
}

impl Link for LocalLink {
    fn send(&mut self, msg: Message) -> Result<(), NetError> {
        self.tx.send(msg)
    }

    fn recv(&mut self) -> Result<Message, NetError> {
        self.rx.recv()
    }

    fn peer(&self) -> &str {
        &self.tx.peer
    }

    fn set_read_timeout(&mut self, timeout: Option<Duration>) -> Result<(), NetError> {
        self.rx.timeout = timeout;
        Ok(())
    }

    fn set_deadline(&mut self, deadline: Option<Instant>) -> Result<(), NetError> {
        self.rx.deadline = deadline;
        Ok(())
    }

    fn authenticate_frames(&mut self, _keys: FrameKeys) {
        // Values in a channel of this process: nothing can change them on the way.
    }

    fn set_max_frame(&mut self, _max_frame: usize) {
        // Messages never become frames here.
    }

    fn counters(&self) -> Arc<Counters> {
        self.tx.counters.clone()
    }

    fn closer(&self) -> Result<LinkCloser, NetError> {
        let closed = self.tx.closed.clone();
        let (to_peer, to_self) = (self.tx.inner.clone(), self.wake.clone());
        Ok(LinkCloser::new(move || {
            closed.store(true, Ordering::SeqCst);
            let _ = to_peer.send(Item::Close);
            let _ = to_self.send(Item::Close);
        }))
    }

    fn close_gently(&mut self) {
        // What was sent stays queued for the peer after this end is gone.
    }

    fn split(self: Box<Self>) -> Result<Halves, NetError> {
        Ok((Box::new(self.tx), Box::new(self.rx)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_link_delivers_in_order_and_reports_a_closed_peer() {
        let (mut tx, mut rx) = local_link("stage 1");
        tx.send(Message::Done).unwrap();
        tx.send(Message::Shutdown).unwrap();
        assert_eq!(rx.recv().unwrap(), Message::Done);
        assert_eq!(rx.recv().unwrap(), Message::Shutdown);
        drop(rx);
        let err = tx.send(Message::Done).unwrap_err().to_string();
        assert_eq!(err, "link to stage 1 is closed");
    }

    #[test]
    fn a_local_pair_talks_both_ways_times_out_and_closes_from_another_thread() {
        let (mut head, mut worker) = local_pair("head", "worker");
        assert_eq!(head.peer(), "worker");
        assert_eq!(worker.peer(), "head");
        head.send(Message::Pong).unwrap();
        assert_eq!(worker.recv().unwrap(), Message::Pong);
        worker.send(Message::Done).unwrap();
        assert_eq!(head.recv().unwrap(), Message::Done);

        worker.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        assert!(matches!(worker.recv(), Err(NetError::Timeout { .. })));

        // A reader blocked on either end wakes up when the link is closed.
        worker.set_read_timeout(None).unwrap();
        let closer = head.closer().unwrap();
        let (_, mut worker_rx) = Box::new(worker).split().unwrap();
        let worker_thread = std::thread::spawn(move || worker_rx.recv());
        let head_thread = std::thread::spawn(move || head.recv());
        std::thread::sleep(Duration::from_millis(50));
        closer.close();
        let (worker_got, head_got) = (worker_thread.join().unwrap(), head_thread.join().unwrap());
        assert!(matches!(worker_got, Err(NetError::Closed { .. })), "{worker_got:?}");
        assert!(matches!(head_got, Err(NetError::Closed { .. })), "{head_got:?}");
    }
}

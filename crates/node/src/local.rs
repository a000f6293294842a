//! A whole ring in one process: every stage on its own thread, joined by in-process
//! links. The same worker loop will run behind TCP links in separate processes.

use std::ops::Range;
use std::sync::Arc;
use std::thread::JoinHandle;

use baton_model::{ModelFile, Stage, StageConfig, StageSpan};
use baton_net::local_link;

use crate::head::{Head, RingEnds};
use crate::worker::{run, StageWorker};
use crate::NodeError;

/// A running in-process ring and the head that drives it.
pub struct LocalRing {
    /// The head end of the ring, until [`take_ends`](Self::take_ends) gives it away.
    head: Option<Head>,
    threads: Vec<JoinHandle<()>>,
    ranges: Vec<Range<usize>>,
}

impl LocalRing {
    /// Loads one stage per range of `ranges` (in parallel) and starts the ring. Each
    /// stage maps the file on its own, as it would on its own machine, so its resident
    /// memory is its own.
    pub fn start(file: Arc<ModelFile>, ranges: &[Range<usize>], config: &StageConfig) -> Result<LocalRing, NodeError> {
        LocalRing::start_tp(file, ranges, config, 1)
    }

    /// [`start`](Self::start) with every stage a tensor-parallel group of `tp` members
    /// (threads of `config.n_threads` each; see [`Stage::load_tp`]).
    pub fn start_tp(
        file: Arc<ModelFile>,
        ranges: &[Range<usize>],
        config: &StageConfig,
        tp: usize,
    ) -> Result<LocalRing, NodeError> {
        let n = ranges.len();
        let stages: Vec<Stage> = std::thread::scope(|scope| {
            let loads: Vec<_> = ranges
                .iter()
                .enumerate()
                .map(|(i, range)| {
                    let span = StageSpan {
                        layers: range.clone(),
                        first: i == 0,
                        last: i + 1 == n,
                    };
                    let path = file.path().to_path_buf();
                    scope.spawn(move || Stage::load_tp(ModelFile::open(&path)?, span, config, tp))
                })
                .collect();
            loads
                .into_iter()
                .map(|h| h.join().expect("stage loader panicked"))
                .collect::<Result<_, _>>()
        })?;
        LocalRing::from_stages(stages, ranges)
    }

    /// A ring over stages already loaded (one per range of `ranges`, in order).
    pub fn from_stages(stages: Vec<Stage>, ranges: &[Range<usize>]) -> Result<LocalRing, NodeError> {
        let n = stages.len();

        // Links: head → s0 → s1 → … → s(n-1) → head.
        let (head_tx, mut prev_rx) = local_link("stage 0");
        let mut threads = Vec::new();
        for (i, stage) in stages.into_iter().enumerate() {
            let peer = if i + 1 == n {
                "head".to_string()
            } else {
                format!("stage {}", i + 1)
            };
            let (tx, next_rx) = local_link(&peer);
            let rx = std::mem::replace(&mut prev_rx, next_rx);
            let worker = StageWorker::new(stage);
            let thread = std::thread::Builder::new()
                .name(format!("stage-{i}"))
                .spawn(move || {
                    if let Err(e) = run(worker, rx, tx) {
                        tracing::debug!(stage = i, error = %e, "stage loop ended");
                    }
                })
                .map_err(|e| NodeError::Protocol(format!("cannot start stage thread: {e}")))?;
            threads.push(thread);
        }
        Ok(LocalRing {
            head: Some(Head::new(RingEnds {
                tx: Box::new(head_tx),
                rx: Box::new(prev_rx),
            })),
            threads,
            ranges: ranges.to_vec(),
        })
    }

    /// The layers of each stage, in ring order.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// Drives the ring one request at a time; `None` once its ends went to a driver of
    /// their own ([`take_ends`](Self::take_ends)).
    pub fn head(&mut self) -> Option<&mut Head> {
        self.head.as_mut()
    }

    /// Gives the ring's ends to another driver (the engine); the ring's stages stay up
    /// as long as this value lives.
    pub fn take_ends(&mut self) -> Option<RingEnds> {
        self.head.take().map(Head::into_ends)
    }
}

impl Drop for LocalRing {
    fn drop(&mut self) {
        if let Some(head) = self.head.as_mut() {
            let _ = head.shutdown();
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

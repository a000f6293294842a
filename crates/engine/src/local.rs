//! A whole ring in one process: every stage on its own thread, joined by in-process
//! links. The same worker loop will run behind TCP links in separate processes.

use std::ops::Range;
use std::sync::Arc;
use std::thread::JoinHandle;

use baton_ggml::Device;
use baton_model::{ModelError, ModelFile, Stage, StageConfig, StageGroup, StageSpan};
use baton_net::local_link;

use crate::head::{Head, RingEnds};
use baton_stage::NodeError;
use baton_stage::{run, StageWorker};

/// Makes one stage of a ring (a stage, or a tensor-parallel group led by member 0),
/// given its span, on the thread that will run it.
type Loader = Box<dyn FnOnce(StageSpan) -> Result<StageGroup, ModelError> + Send>;

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
        let on_cpu: Vec<(Range<usize>, Device)> = ranges.iter().map(|r| (r.clone(), Device::cpu())).collect();
        LocalRing::start_on(file, &on_cpu, config)
    }

    /// [`start`](Self::start) with each stage on its own device: `stages` pairs each
    /// range with the device that computes it. Hidden states pass from stage to stage
    /// in memory, whatever the devices.
    pub fn start_on(
        file: Arc<ModelFile>,
        stages: &[(Range<usize>, Device)],
        config: &StageConfig,
    ) -> Result<LocalRing, NodeError> {
        check_one_stage_per_accelerator(stages)?;
        let loaders = stages
            .iter()
            .map(|(_, device)| {
                // Each stage maps the file on its own, as on its own machine.
                let (path, config, device) = (file.path().to_path_buf(), config.clone(), *device);
                Box::new(move |span| {
                    let file = ModelFile::open(&path)?;
                    Stage::load_on(file, span, &config, device).map(StageGroup::from)
                }) as Loader
            })
            .collect();
        LocalRing::start_with(stages.iter().map(|(r, _)| r.clone()).collect(), loaders)
    }

    /// [`start`](Self::start) with every stage a tensor-parallel group of `tp` members
    /// on the CPU (threads of `config.n_threads` each; see [`StageGroup::load_tp`]).
    pub fn start_tp(
        file: Arc<ModelFile>,
        ranges: &[Range<usize>],
        config: &StageConfig,
        tp: usize,
    ) -> Result<LocalRing, NodeError> {
        let loaders = ranges
            .iter()
            .map(|_| {
                let (path, config) = (file.path().to_path_buf(), config.clone());
                Box::new(move |span| {
                    ModelFile::open(&path).and_then(|file| StageGroup::load_tp(file, span, &config, tp))
                }) as Loader
            })
            .collect();
        LocalRing::start_with(ranges.to_vec(), loaders)
    }

    /// A ring over stages already loaded on the CPU (one per range of `ranges`, in
    /// order, each loaded with the span its place in the ring gives it).
    pub fn from_stages(stages: Vec<StageGroup>, ranges: &[Range<usize>]) -> Result<LocalRing, NodeError> {
        if let Some(stage) = stages.iter().map(StageGroup::stage).find(|s| !s.device().is_cpu()) {
            return Err(NodeError::Model(ModelError::BadConfig(format!(
                "a ring of stages loaded elsewhere takes CPU stages only; one is on {:?}",
                stage.device()
            ))));
        }
        let loaders = stages
            .into_iter()
            .map(|stage| Box::new(move |_| Ok(stage)) as Loader)
            .collect();
        LocalRing::start_with(ranges.to_vec(), loaders)
    }

    /// Starts one thread per range, which loads its stage with its loader (given the
    /// stage's span) and runs it.
    fn start_with(ranges: Vec<Range<usize>>, loaders: Vec<Loader>) -> Result<LocalRing, NodeError> {
        let n = ranges.len();
        if loaders.len() != n {
            return Err(NodeError::Protocol(format!(
                "{} stages for {n} layer ranges",
                loaders.len()
            )));
        }
        // Each stage is loaded, run and dropped on its own thread, so a device's
        // backend is only ever used by the thread that made it.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        // Links: head → s0 → s1 → … → s(n-1) → head.
        let (head_tx, mut prev_rx) = local_link("stage 0");
        let mut threads = Vec::new();
        for (i, (range, load)) in ranges.iter().zip(loaders).enumerate() {
            let peer = if i + 1 == n {
                "head".to_string()
            } else {
                format!("stage {}", i + 1)
            };
            let (tx, next_rx) = local_link(&peer);
            let rx = std::mem::replace(&mut prev_rx, next_rx);
            let span = StageSpan {
                layers: range.clone(),
                first: i == 0,
                last: i + 1 == n,
            };
            let ready = ready_tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("stage-{i}"))
                .spawn(move || {
                    let stage = match load(span) {
                        Ok(stage) => stage,
                        Err(e) => {
                            let _ = ready.send(Err(NodeError::from(e)));
                            return;
                        }
                    };
                    let _ = ready.send(Ok(()));
                    if let Err(e) = run(StageWorker::new(stage), rx, tx) {
                        tracing::debug!(stage = i, error = %e, "stage loop ended");
                    }
                })
                .map_err(|e| NodeError::Protocol(format!("cannot start stage thread: {e}")))?;
            threads.push(thread);
        }
        drop(ready_tx);
        let mut failed = None;
        for _ in 0..n {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    failed.get_or_insert(e);
                }
                Err(_) => {
                    failed.get_or_insert(NodeError::Protocol("a stage thread ended while loading".into()));
                }
            }
        }
        if let Some(e) = failed {
            // Closing the head's ends stops the stages that loaded, one after another.
            drop((head_tx, prev_rx));
            for thread in threads {
                let _ = thread.join();
            }
            return Err(e);
        }
        Ok(LocalRing {
            head: Some(Head::new(RingEnds {
                tx: Box::new(head_tx),
                rx: Box::new(prev_rx),
            })),
            threads,
            ranges,
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

/// A device other than the CPU computes one stage per process: each stage runs on a
/// thread of its own, stages compute at once when the pipe is full, and ggml's Vulkan
/// backend is not safe with two threads computing on one device at once
/// (ggml-org/ggml#1087, ggml-org/llama.cpp#11371). Splitting layers on one device gains
/// nothing anyway: give it one larger range.
fn check_one_stage_per_accelerator(stages: &[(Range<usize>, Device)]) -> Result<(), NodeError> {
    for (i, (_, device)) in stages.iter().enumerate() {
        if !device.is_cpu() && stages[..i].iter().any(|(_, d)| d == device) {
            return Err(NodeError::Model(baton_model::ModelError::BadConfig(format!(
                "{device:?} is given more than one stage; a device other than the CPU computes one \
                 stage per process (give it one larger layer range)"
            ))));
        }
    }
    Ok(())
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

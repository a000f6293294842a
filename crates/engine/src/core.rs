//! The engine's decisions, with no I/O: which requests run, what goes into the ring
//! next, what each reply means, when the ring counts as lost, and how running requests
//! are rebuilt on a new one. Time comes in as an argument; what goes into the ring comes
//! out as [`Action`]s, and everything else it has to say (a request's tokens and end,
//! counters, health, the stages' figures) as [`Output`]s: the core touches no channel,
//! counter or lock, so tests drive it step by step and read what it said (see the tests
//! below). `super::shell` connects it to the ring's links, the clock and the recovery
//! thread, and delivers its outputs.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use baton_net::Counters as LinkCounters;
use baton_proto::{Conversation, Ring, SampledToken, StartSeq, Stats};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use super::batch::{next_batch, BatchRules, Member};
use super::draft::{DraftMode, DraftPolicy, Drafters};
use super::slots::{choose_slot, choose_slot_to_pool, runs_prefix, Active, Slot};
use super::text::Piece;
use super::types::{
    Better, EngineConfig, Event, Failure, Figure, Finish, FinishReason, FormError, Health, Job, Output, PrefixReuse,
    StageStats, StatsError, TokenOut, Vocab,
};

/// A message in the ring, waiting for its reply.
pub(crate) enum Pending {
    Control,
    Stats(oneshot::Sender<Result<StageStats, StatsError>>),
    /// A micro-batch, the sequences in it, and its rows when it is a decode step (every
    /// row sampled; timed for the draft policy).
    Step {
        members: Vec<Member>,
        decode_rows: Option<usize>,
    },
    Shutdown,
}

/// What the core asks its shell to do.
#[derive(Debug, PartialEq)]
pub(crate) enum Action {
    /// Send this into the ring (the reply is already expected).
    Send(Ring),
    /// The ring is gone: close it and have the ring source form a new one, reporting
    /// losses as ring number `gen`.
    FormRing { gen: u64 },
}

/// The counters of the head's own two ends of the ring: what the head measures of the
/// links into the first stage and back from the last.
#[derive(Clone, Default)]
pub(crate) struct EndCounters {
    pub into_first: Arc<LinkCounters>,
    pub from_last: Arc<LinkCounters>,
}

/// A ring being formed again.
struct Recovery {
    since: Instant,
    reason: String,
    /// Running requests were already failed (no capacity, or out of time).
    gave_up: bool,
}

/// The engine's state.
pub(crate) struct Core {
    config: EngineConfig,
    vocab: Arc<dyn Vocab>,
    /// What the shell delivers beside the ring (see [`Output`]).
    outputs: Vec<Output>,
    /// Whether a ring is installed (messages can be sent).
    connected: bool,
    /// The current ring's ends, as the head measures them.
    ends: EndCounters,
    /// Number of the current ring (or of the one being formed); replies and losses of
    /// older rings are stale.
    gen: u64,
    /// A lost ring is formed again (else every request fails with it).
    supervised: bool,
    recovery: Option<Recovery>,
    slots: Vec<Slot>,
    queue: VecDeque<Box<Job>>,
    /// Messages in the ring, oldest first, with when they were sent.
    pending: VecDeque<(Instant, Pending)>,
    steps_in_flight: usize,
    /// The last micro-batch carried decode rows (the next goes to a waiting prompt).
    last_decoded: bool,
    next_step: u64,
    next_epoch: u64,
    stopping: bool,
    outbox: Vec<Action>,
    /// Where drafted tokens come from, and how many pay.
    drafters: Drafters,
    policy: DraftPolicy,
}

impl Core {
    pub fn new(config: EngineConfig, vocab: Arc<dyn Vocab>, supervised: bool, drafters: Drafters) -> Core {
        Core {
            drafters,
            policy: DraftPolicy::default(),
            slots: (0..config.n_slots).map(|_| Slot::empty()).collect(),
            config,
            vocab,
            outputs: Vec::new(),
            connected: false,
            ends: EndCounters::default(),
            gen: 0,
            supervised,
            recovery: None,
            queue: VecDeque::new(),
            pending: VecDeque::new(),
            steps_in_flight: 0,
            last_decoded: false,
            next_step: 0,
            next_epoch: 1,
            stopping: false,
            outbox: Vec::new(),
        }
    }

    /// What to do with the ring now, in order (taken: the next call starts empty).
    pub fn actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.outbox)
    }

    /// What to deliver beside the ring, in order (taken: the next call starts empty).
    pub fn outputs(&mut self) -> Vec<Output> {
        std::mem::take(&mut self.outputs)
    }

    /// The current ring's number.
    pub fn gen(&self) -> u64 {
        self.gen
    }

    /// Whether a ring is installed.
    pub fn connected(&self) -> bool {
        self.connected
    }

    /// Whether the engine is stopping (only the ring's `Shutdown` is awaited).
    pub fn stopping(&self) -> bool {
        self.stopping
    }

    fn set_health(&mut self, health: Health) {
        self.outputs.push(Output::Health(health));
    }

    fn count(&mut self, figure: Figure, by: i64) {
        self.outputs.push(Output::Count(figure, by));
    }

    fn tell(&mut self, client: UnboundedSender<Event>, event: Event) {
        self.outputs.push(Output::Tell(client, event));
    }

    /// A request to queue.
    pub fn submit(&mut self, job: Box<Job>) {
        self.queue.push_back(job);
    }

    /// Someone asks every stage for its figures.
    pub fn stats(&mut self, reply: oneshot::Sender<Result<StageStats, StatsError>>, now: Instant) {
        if !self.connected {
            self.outputs.push(Output::Stats(reply, Err(StatsError::Forming)));
            return;
        }
        self.send(Ring::Stats(Stats::default()), Pending::Stats(reply), now);
    }

    /// A ring was formed over `n_stages` stages (0: unknown, keep the configured
    /// number), with `ends` measuring the head's ends of it: it takes the place of the
    /// lost one, and every running request is rebuilt on it.
    pub fn installed(&mut self, n_stages: usize, health: Health, ends: EndCounters, now: Instant) {
        self.connected = true;
        self.ends = ends;
        self.pending.clear();
        self.steps_in_flight = 0;
        self.last_decoded = false;
        if n_stages > 0 {
            self.config.n_stages = n_stages;
        }
        let rebuilding = self.recovery.is_some();
        if let Some(recovery) = self.recovery.take() {
            self.count(Figure::RingsFormed, 1);
            tracing::info!(
                secs = recovery.since.elapsed().as_secs_f32(),
                "formed a new ring after: {}",
                recovery.reason
            );
        }
        self.set_health(health);
        if rebuilding {
            self.rebuild(now);
        }
    }

    /// Starts every running sequence again on the new ring, to be sent again batch for
    /// batch; slots' cached prefixes are gone with the old stages.
    fn rebuild(&mut self, now: Instant) {
        for seq in 0..self.slots.len() {
            let slot = &mut self.slots[seq];
            slot.forget();
            let Some(active) = slot.active.as_mut() else { continue };
            let repeated = active.restart();
            self.outputs.push(Output::Count(Figure::Replayed, repeated as i64));
            let start = StartSeq::new(seq as u32, active.job.params.clone(), active.tokens.clone())
                .with_logprobs(active.job.logprobs, active.job.top_logprobs)
                .with_drawn(active.generated as u32)
                .with_grammar(active.job.grammar.clone())
                .with_pooling(active.job.pooling)
                .with_budget(active.job.budget.clone());
            self.send(start.into(), Pending::Control, now);
        }
    }

    /// A reply from ring `gen`.
    pub fn reply(&mut self, gen: u64, reply: Ring, now: Instant) {
        if gen != self.gen {
            return;
        }
        let Some((sent, pending)) = self.pending.pop_front() else {
            self.fail_all(&format!("the last stage sent {} that nothing asked for", reply.kind()));
            return;
        };
        match (pending, reply) {
            (Pending::Control, Ring::Done) | (Pending::Shutdown, _) => {}
            (
                Pending::Control,
                Ring::Error {
                    first_layer, message, ..
                },
            ) => {
                tracing::warn!(first_layer, "a control message failed: {message}");
            }
            (Pending::Stats(answer), Ring::Stats(mut ring)) => {
                // The last stage's link is the head's control link to that worker: the
                // worker was dialed and measured nothing; the head measured it, and its
                // heartbeat keeps the figure current.
                if let Some(last) = ring.link_rtt_us.last_mut().filter(|rtt| **rtt == 0) {
                    *last = self.ends.from_last.round_trip_us();
                }
                let stats = StageStats {
                    ring,
                    head_link_rtt_us: self.ends.into_first.round_trip_us(),
                };
                self.outputs.push(Output::Stats(answer, Ok(stats)));
            }
            (
                Pending::Stats(answer),
                Ring::Error {
                    first_layer,
                    fault,
                    message,
                },
            ) => {
                let error = StatsError::Stage {
                    first_layer,
                    fault,
                    message,
                };
                self.outputs.push(Output::Stats(answer, Err(error)));
            }
            (Pending::Step { members, decode_rows }, Ring::Sampled { tokens, .. }) => {
                self.steps_in_flight -= 1;
                self.count(Figure::RoundTripUs, now.duration_since(sent).as_micros() as i64);
                if let Some(rows) = decode_rows {
                    self.policy.record_step(rows, now.duration_since(sent).as_secs_f64());
                }
                for member in members.into_iter().filter(|m| m.sampled) {
                    let got: Vec<&SampledToken> = tokens.iter().filter(|t| t.seq as usize == member.seq).collect();
                    let n_vocab = self.vocab.n_vocab();
                    if let Some(bad) = got.iter().find(|t| t.token as usize >= n_vocab) {
                        // llama.cpp's detokenizer throws across the C boundary on such an id.
                        let why = format!(
                            "the last stage sampled token {} outside the vocabulary of {n_vocab}",
                            bad.token
                        );
                        self.fail_seq(member.seq, member.epoch, Failure::server(why), now);
                        continue;
                    }
                    if got.is_empty() || got.len() > member.drafted + 1 {
                        let why = format!(
                            "the last stage sampled {} tokens for the sequence, expected 1 to {}",
                            got.len(),
                            member.drafted + 1
                        );
                        self.fail_seq(member.seq, member.epoch, Failure::server(why), now);
                        continue;
                    }
                    self.on_tokens(member, &got, now);
                }
            }
            (Pending::Step { members, .. }, Ring::Pooled { seq, values, .. }) => {
                self.steps_in_flight -= 1;
                self.count(Figure::RoundTripUs, now.duration_since(sent).as_micros() as i64);
                self.on_pooled(members, seq, values, now);
            }
            (
                Pending::Step { members, .. },
                Ring::Error {
                    first_layer,
                    fault,
                    message,
                },
            ) => {
                self.steps_in_flight -= 1;
                let failure = Failure::from_stage(fault, first_layer, &message);
                for member in members {
                    self.fail_seq(member.seq, member.epoch, failure.clone(), now);
                }
            }
            (_, other) => self.fail_all(&format!("the ring answered out of order with {}", other.kind())),
        }
    }

    /// Ring `gen` broke (a link failed, a node stopped answering).
    pub fn lost(&mut self, gen: u64, reason: &str, now: Instant) {
        if gen == self.gen && !self.stopping {
            self.count(Figure::WorkersLost, 1);
            self.lose_ring(reason, now);
        }
    }

    /// The current ring is gone. Supervised, the shell forms the next one while
    /// requests wait; otherwise every request fails.
    fn lose_ring(&mut self, reason: &str, now: Instant) {
        self.connected = false;
        if self.stopping {
            self.outbox.clear();
            return;
        }
        // What the old ring still says is stale from now on.
        self.gen += 1;
        for (_, pending) in self.pending.drain(..) {
            if let Pending::Stats(reply) = pending {
                self.outputs
                    .push(Output::Stats(reply, Err(StatsError::Lost(reason.to_string()))));
            }
        }
        self.steps_in_flight = 0;
        // Messages not yet handed to the old ring are dropped with it.
        self.outbox.retain(|a| !matches!(a, Action::Send(_)));
        if !self.supervised {
            self.fail_all(reason);
            self.set_health(Health::Failed {
                reason: reason.to_string(),
            });
            return;
        }
        tracing::warn!("{reason}: forming a new ring");
        self.set_health(Health::Recovering {
            reason: reason.to_string(),
        });
        if self.recovery.is_none() {
            self.recovery = Some(Recovery {
                since: now,
                reason: reason.to_string(),
                gave_up: false,
            });
        }
        self.outbox.push(Action::FormRing { gen: self.gen });
    }

    /// The ring source could not form a ring yet (it keeps trying).
    pub fn form_failed(&mut self, error: FormError) {
        match error {
            FormError::Capacity(reason) => {
                self.set_health(Health::Waiting { reason: reason.clone() });
                if let Some(recovery) = self.recovery.as_mut() {
                    if !recovery.gave_up {
                        recovery.gave_up = true;
                        let message = format!("{}, and {reason}", recovery.reason);
                        self.fail_requests(&message);
                    }
                }
            }
            FormError::Retry(reason) => {
                if let Some(recovery) = self.recovery.as_ref() {
                    let reason = format!("{}; forming a new ring failed: {reason}", recovery.reason);
                    self.set_health(Health::Recovering { reason });
                }
            }
        }
    }

    /// The engine is stopping: the ring is shut down, if there is one (wait for its
    /// `Shutdown` to come back while [`connected`](Self::connected)).
    pub fn shutdown(&mut self, now: Instant) {
        self.stopping = true;
        self.send(Ring::Shutdown, Pending::Shutdown, now);
    }

    /// Everything that depends on time or on what the last event changed: deadlines,
    /// clients that went away, moving back to a better ring, admission, and filling the
    /// ring with micro-batches. `better`: a better ring may be formed.
    pub fn poll(&mut self, now: Instant, better: Option<Better>) {
        if self.stopping {
            return;
        }
        self.check_recovery_time(now);
        self.check_step_time(now);
        self.drop_abandoned(now);
        if !self.connected {
            return;
        }
        match better {
            Some(Better::Returned) if self.idle() => {
                self.count(Figure::WorkersReturned, 1);
                self.lose_ring("a lost worker is back: moving to the better plan", now);
                return;
            }
            Some(Better::Joined) => {
                self.count(Figure::WorkersJoined, 1);
                self.lose_ring("a worker joined: forming a ring with it", now);
                return;
            }
            _ => {}
        }
        self.admit(now);
        self.schedule(now);
    }

    fn idle(&self) -> bool {
        self.slots.iter().all(|s| s.active.is_none()) && self.queue.is_empty() && self.pending.is_empty()
    }

    /// Running and queued requests fail once recovery has taken longer than allowed.
    fn check_recovery_time(&mut self, now: Instant) {
        let Some(recovery) = self.recovery.as_mut() else { return };
        if recovery.gave_up || now.duration_since(recovery.since) < self.config.recovery_timeout {
            return;
        }
        recovery.gave_up = true;
        let reason = format!(
            "{}, and no new ring could be formed within {} s",
            recovery.reason,
            self.config.recovery_timeout.as_secs_f32()
        );
        self.set_health(Health::Waiting { reason: reason.clone() });
        self.fail_requests(&reason);
    }

    /// A ring whose oldest message has gone unanswered for `step_timeout` is stuck
    /// somewhere a heartbeat cannot see (a stage wedged in its computation).
    fn check_step_time(&mut self, now: Instant) {
        let Some((sent, _)) = self.pending.front() else { return };
        if self.connected && now.duration_since(*sent) > self.config.step_timeout {
            let secs = self.config.step_timeout.as_secs_f32();
            self.lose_ring(&format!("the ring did not answer a step within {secs} s"), now);
        }
    }

    /// Remembers that `msg` goes into the ring and what its reply will answer.
    fn send(&mut self, msg: Ring, pending: Pending, now: Instant) {
        if !self.connected {
            if let Pending::Stats(reply) = pending {
                self.outputs.push(Output::Stats(reply, Err(StatsError::Forming)));
            }
            return;
        }
        self.pending.push_back((now, pending));
        self.outbox.push(Action::Send(msg));
    }

    /// The shell could not hand a message to the first stage.
    pub fn send_failed(&mut self, error: &str, now: Instant) {
        self.lose_ring(&format!("cannot reach the first stage: {error}"), now);
    }

    /// Every running and waiting request fails with `reason`; slots forget their cache.
    fn fail_requests(&mut self, reason: &str) {
        tracing::error!("{reason}");
        let mut failed = Vec::new();
        for slot in &mut self.slots {
            if let Some(active) = slot.active.take() {
                failed.push(active.job.events.clone());
            }
            slot.forget();
        }
        let running = failed.len() as i64;
        failed.extend(self.queue.drain(..).map(|job| job.events.clone()));
        let waiting = failed.len() as i64 - running;
        for client in failed {
            self.tell(client, Event::Failed(Failure::server(reason)));
            self.count(Figure::Failed, 1);
        }
        self.count(Figure::Active, -running);
        self.count(Figure::Queued, -waiting);
    }

    /// The ring is gone for good: every request fails, and so will every new one.
    fn fail_all(&mut self, reason: &str) {
        self.fail_requests(reason);
        for (_, pending) in self.pending.drain(..) {
            if let Pending::Stats(reply) = pending {
                self.outputs
                    .push(Output::Stats(reply, Err(StatsError::Lost(reason.to_string()))));
            }
        }
    }

    /// Requests whose client went away: queued ones are dropped, running ones ended on
    /// every stage (the `EndSeq` follows their steps in flight, so it lands after them).
    fn drop_abandoned(&mut self, now: Instant) {
        let before = self.queue.len();
        self.queue.retain(|job| !job.events.is_closed());
        let dropped = before - self.queue.len();
        if dropped > 0 {
            self.count(Figure::Queued, -(dropped as i64));
            self.count(Figure::Cancelled, dropped as i64);
        }
        for seq in 0..self.slots.len() {
            if self.slots[seq]
                .active
                .as_ref()
                .is_some_and(|a| a.job.events.is_closed())
            {
                self.cancel(seq, now);
            }
        }
    }

    fn cancel(&mut self, seq: usize, now: Instant) {
        let slot = &mut self.slots[seq];
        let Some(active) = slot.active.take() else { return };
        slot.forget();
        self.count(Figure::Active, -1);
        self.count(Figure::Cancelled, 1);
        active
            .span
            .in_scope(|| tracing::debug!("the client went away: ending the sequence on every stage"));
        self.drafters.forget(seq as u32);
        self.send(Ring::EndSeq { seq: seq as u32 }, Pending::Control, now);
    }

    /// Gives free slots to waiting requests, preferring the slot whose cache the prompt
    /// can reuse most of.
    fn admit(&mut self, now: Instant) {
        let chunk = self.config.chunk.max(1);
        while self.connected {
            let Some(job) = self.queue.front() else { break };
            let chosen = match job.pooling {
                Some(_) => choose_slot_to_pool(&self.slots),
                None => choose_slot(&self.slots, &job.prompt, chunk, self.config.prefix_reuse),
            };
            let Some(seq) = chosen else {
                break;
            };
            let job = self.queue.pop_front().expect("the queue is not empty");
            self.count(Figure::Queued, -1);
            self.count(Figure::Active, 1);
            let slot = &mut self.slots[seq];
            // A pooled prompt needs every row's output: nothing cached is reused.
            let n_reused = match job.pooling {
                Some(_) => 0,
                None => slot.reusable(&job.prompt, chunk, self.config.prefix_reuse),
            };
            self.outputs.push(Output::Count(Figure::PromptReused, n_reused as i64));
            self.outputs.push(Output::Count(
                Figure::PromptComputed,
                (job.prompt.len() - n_reused) as i64,
            ));
            let start = StartSeq::new(seq as u32, job.params.clone(), job.prompt.clone())
                .keeping(n_reused as u32)
                .with_logprobs(job.logprobs, job.top_logprobs)
                .with_grammar(job.grammar.clone())
                .with_pooling(job.pooling)
                .with_budget(job.budget.clone());
            let epoch = self.next_epoch;
            self.next_epoch += 1;
            slot.last_used = epoch;
            slot.cached.clear();
            let runs = runs_prefix(&std::mem::take(&mut slot.cached_runs), n_reused);
            let prior = self.policy.prior(job.draft.mode);
            let mut active = Active::new(job, epoch, n_reused, runs, prior);
            // The stages drop the checkpoints past what the request keeps.
            active.checkpoints = std::mem::take(&mut slot.checkpoints);
            active.checkpoints.retain(|&at| at <= n_reused);
            active.span.in_scope(|| tracing::debug!(seq, "started in slot {seq}"));
            slot.active = Some(active);
            self.send(start.into(), Pending::Control, now);
        }
    }

    /// Fills the ring: up to one micro-batch per stage (plus one waiting at the first).
    fn schedule(&mut self, now: Instant) {
        let rules = BatchRules {
            chunk: self.config.chunk,
            n_stages: self.config.n_stages,
            max_decode_seqs: self.config.max_decode_seqs,
        };
        while self.connected && self.steps_in_flight <= self.config.n_stages {
            let step = self.next_step;
            let (drafters, policy, max_draft) = (&mut self.drafters, &self.policy, self.config.max_draft);
            let mut draft = |seq: usize, active: &Active| {
                let settings = active.draft;
                if settings.draft.mode == DraftMode::Off {
                    return Vec::new();
                }
                // Never past what the request may still generate.
                let room = active.job.max_tokens.saturating_sub(active.generated + 1);
                let max = settings.draft.max.min(room).min(max_draft);
                let k = if settings.draft.fixed {
                    max
                } else {
                    policy.choose(settings.acceptance, max)
                };
                if k == 0 {
                    return Vec::new();
                }
                drafters.draft(settings.draft.mode, seq as u32, &active.tokens, active.n_prompt, k)
            };
            let Some((forward, members)) = next_batch(&mut self.slots, rules, &mut self.last_decoded, step, &mut draft)
            else {
                break;
            };
            self.next_step += 1;
            self.steps_in_flight += 1;
            self.count(Figure::Steps, 1);
            let drafted: usize = members.iter().map(|m| m.drafted).sum();
            self.count(Figure::DraftTokens, drafted as i64);
            let rows = forward.positions.len();
            let decode_rows = (forward.sample_rows.len() == rows).then_some(rows);
            // Models with recurrent layers: the sequences whose whole prompt chunk this is.
            let checkpointed: Vec<usize> = match self.config.prefix_reuse {
                PrefixReuse::Checkpoints => members.iter().map(|m| m.seq).collect(),
                PrefixReuse::Anywhere | PrefixReuse::Recent(_) => Vec::new(),
            };
            self.send(Ring::Forward(forward), Pending::Step { members, decode_rows }, now);
            for seq in checkpointed {
                self.checkpoint_whole_chunk(seq, now);
            }
        }
    }

    /// After a whole prompt chunk of `seq` went into the ring, asks every stage to keep
    /// a copy of its recurrent states there: a later request whose prompt starts with
    /// the same chunks continues from it (see [`PrefixReuse::Checkpoints`]).
    fn checkpoint_whole_chunk(&mut self, seq: usize, now: Instant) {
        let chunk = self.config.chunk.max(1);
        let Some(active) = self.slots[seq].active.as_mut() else {
            return;
        };
        let whole = active.runs.last() == Some(&(chunk as u32));
        let at = active.n_sent;
        if !whole || at > active.n_prompt || at % chunk != 0 || active.checkpoints.contains(&at) {
            return;
        }
        active.checkpoints.push(at);
        if active.checkpoints.len() > baton_model::CHECKPOINTS {
            active.checkpoints.remove(0);
        }
        let msg = Ring::Checkpoint {
            seq: seq as u32,
            len: at as u32,
        };
        self.send(msg, Pending::Control, now);
    }

    fn current(&mut self, seq: usize, epoch: u64) -> Option<&mut Active> {
        self.slots.get_mut(seq)?.active.as_mut().filter(|a| a.epoch == epoch)
    }

    fn fail_seq(&mut self, seq: usize, epoch: u64, failure: Failure, now: Instant) {
        let Some(active) = self.current(seq, epoch) else { return };
        active
            .span
            .in_scope(|| tracing::debug!(cause = ?failure.cause, "failed: {}", failure.reason));
        let client = active.job.events.clone();
        self.tell(client, Event::Failed(failure));
        self.slots[seq].active = None;
        self.slots[seq].forget();
        self.drafters.forget(seq as u32);
        self.count(Figure::Active, -1);
        self.count(Figure::Failed, 1);
        self.send(Ring::EndSeq { seq: seq as u32 }, Pending::Control, now);
    }

    /// The last stage's embedding for the step's pooled sequence `seq`: the request
    /// finishes with it, and its cells are freed on every stage (nothing of it stays
    /// cached). An answer the step did not ask for fails what the step carried.
    fn on_pooled(&mut self, members: Vec<Member>, seq: u32, values: Vec<f32>, now: Instant) {
        let n_embd = self.config.n_embd;
        let asked = members.iter().find(|m| m.sampled && m.seq == seq as usize).copied();
        let pooled = asked.filter(|m| self.current(m.seq, m.epoch).is_some_and(|a| a.pooled()));
        let Some(member) = pooled.filter(|_| values.len() == n_embd) else {
            let why = format!(
                "the last stage pooled {} values for sequence {seq}, which the step did not ask of it                  (or not the model's {n_embd})",
                values.len()
            );
            for member in members {
                self.fail_seq(member.seq, member.epoch, Failure::server(why.clone()), now);
            }
            return;
        };
        let slot = &mut self.slots[member.seq];
        let Some(active) = slot.active.take() else { return };
        slot.forget();
        self.count(Figure::Active, -1);
        self.count(Figure::Finished, 1);
        active.span.in_scope(|| tracing::debug!("pooled"));
        let finish = Finish {
            reason: FinishReason::Stop,
            tail: String::new(),
            prompt_tokens: active.n_prompt,
            cached_tokens: 0,
            completion_tokens: 0,
            stop_string: None,
            embedding: Some(values),
        };
        self.tell(active.job.events, Event::Finished(finish));
        self.send(Ring::EndSeq { seq }, Pending::Control, now);
    }

    /// The tokens the last stage sampled for a member of a step: its token's sample
    /// and, when it carried a draft, one more for each drafted token kept.
    fn on_tokens(&mut self, member: Member, got: &[&SampledToken], now: Instant) {
        let (seq, epoch) = (member.seq, member.epoch);
        let Some(active) = self.current(seq, epoch) else { return };
        active.waiting = false;
        // The drafted rows whose tokens were kept hold valid cells; the rest do not.
        let accepted = got.len() - 1;
        active.n_sent += accepted;
        active.runs.extend(std::iter::repeat_n(1, accepted));
        let rejected = member.drafted - accepted;
        let len = active.n_sent;
        if member.drafted > 0 {
            active.draft.record(member.drafted, accepted);
            let mode = active.draft.draft.mode;
            self.policy.record_draft(mode, member.drafted, accepted);
            self.count(Figure::DraftAccepted, accepted as i64);
        }
        if rejected > 0 {
            // FIFO: every stage drops the rejected rows' cells before this sequence's
            // next step reaches it.
            self.send(
                Ring::TruncateSeq {
                    seq: seq as u32,
                    len: len as u32,
                },
                Pending::Control,
                now,
            );
        }
        for sampled in got {
            if !self.on_token(seq, epoch, sampled) {
                break;
            }
        }
    }

    /// One generated token; false when the request ended with it.
    fn on_token(&mut self, seq: usize, epoch: u64, sampled: &SampledToken) -> bool {
        let vocab = self.vocab.clone();
        let Some(active) = self.current(seq, epoch) else {
            return false;
        };
        if active.generated == 0 {
            active
                .span
                .in_scope(|| tracing::debug!(token = sampled.token, "first token"));
        }
        let end = if vocab.is_end_of_generation(sampled.token) {
            Some((FinishReason::Stop, active.text.finish()))
        } else {
            active.tokens.push(sampled.token);
            active.generated += 1;
            let bytes = if active.job.show.contains(&sampled.token) {
                vocab.special_bytes(sampled.token)
            } else {
                vocab.token_bytes(sampled.token)
            };
            let (text, stopped) = match active.text.push(&bytes) {
                Piece::Text(text) => (text, false),
                Piece::Stop(text) => (text, true),
            };
            let complete = !stopped && active.job.end.as_mut().is_some_and(|end| end.ends_after(&text));
            let out = TokenOut {
                id: sampled.token,
                text,
                logprob: sampled.logprob,
                top: sampled.top.clone(),
            };
            let end = if stopped {
                Some((FinishReason::Stop, String::new()))
            } else if complete {
                Some((FinishReason::Stop, active.text.finish()))
            } else if active.generated >= active.job.max_tokens {
                Some((FinishReason::Length, active.text.finish()))
            } else {
                None
            };
            let client = active.job.events.clone();
            self.tell(client, Event::Token(out));
            end
        };
        match end {
            Some((reason, tail)) => {
                self.finish(seq, reason, tail);
                false
            }
            None => true,
        }
    }

    fn finish(&mut self, seq: usize, reason: FinishReason, tail: String) {
        let slot = &mut self.slots[seq];
        let Some(mut active) = slot.active.take() else { return };
        // Everything sent is in every stage's cache; the last sampled token is not (nor
        // drafted tokens past an end).
        active.tokens.truncate(active.n_sent);
        slot.cached_runs = runs_prefix(&active.runs, active.tokens.len());
        slot.checkpoints = std::mem::take(&mut active.checkpoints);
        slot.cached = active.tokens;
        self.count(Figure::Active, -1);
        self.count(Figure::Finished, 1);
        self.count(Figure::Completion, active.generated as i64);
        active
            .span
            .in_scope(|| tracing::debug!(generated = active.generated, ?reason, "finished"));
        let finish = Finish {
            reason,
            tail,
            prompt_tokens: active.n_prompt,
            cached_tokens: active.n_reused,
            completion_tokens: active.generated,
            stop_string: active.text.matched().map(str::to_string),
            embedding: None,
        };
        self.tell(active.job.events, Event::Finished(finish));
    }
}

/// How long the shell may wait for the next event before polling the core again (for
/// its deadlines and for clients that went away).
pub(crate) const POLL_INTERVAL: Duration = Duration::from_millis(100);

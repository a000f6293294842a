//! The engine's core driven step by step, with a fake vocabulary and a clock made of
//! `Instant`s: what it sends, what requests see, and what a lost ring does to them.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton_proto::{Forward, Payload, Ring, SampledToken, StartSeq, Stats};
use baton_sample::SamplingParams;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::core::{Action, Core, EndCounters};
use super::draft::{Draft, Drafters};
use super::types::{
    Better, Counters, EndCheck, EngineConfig, Event, FinishReason, FormError, Health, Job, StatsError, Vocab,
};

/// Token 0 ends generation; token `t` reads `<t>`.
struct Tokens;

impl Vocab for Tokens {
    fn is_end_of_generation(&self, token: u32) -> bool {
        token == 0
    }

    fn token_bytes(&self, token: u32) -> Vec<u8> {
        // 900 and up: control tokens, which render as nothing unless shown.
        if token >= 900 {
            return Vec::new();
        }
        format!("<{token}>").into_bytes()
    }

    fn special_bytes(&self, token: u32) -> Vec<u8> {
        format!("[{token}]").into_bytes()
    }

    fn n_vocab(&self) -> usize {
        1000
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        n_slots: 2,
        slot_ctx: 64,
        chunk: 4,
        n_stages: 1,
        max_decode_seqs: 3,
        max_queue: 8,
        recovery_timeout: Duration::from_secs(30),
        step_timeout: Duration::from_secs(60),
        prefix_reuse: crate::PrefixReuse::Anywhere,
        max_draft: crate::draft::MAX_DRAFT,
        n_embd: 4,
    }
}

struct Harness {
    core: Core,
    counters: Arc<Counters>,
    health: Arc<Mutex<Health>>,
    now: Instant,
}

impl Harness {
    fn new(supervised: bool) -> Harness {
        Harness::with_config(config(), supervised)
    }

    fn with_config(config: EngineConfig, supervised: bool) -> Harness {
        let counters = Arc::new(Counters::default());
        let health = Arc::new(Mutex::new(Health::Serving {
            stages: vec![],
            lost: vec![],
        }));
        let mut core = Core::new(config, Arc::new(Tokens), supervised, Drafters { model: None });
        let now = Instant::now();
        core.installed(1, serving(), EndCounters::default(), now);
        Harness {
            core,
            counters,
            health,
            now,
        }
    }

    fn job(&mut self, prompt: &[u32], max_tokens: usize) -> UnboundedReceiver<Event> {
        let (events, receiver) = unbounded_channel();
        self.core.submit(Box::new(greedy_job(prompt, max_tokens, events)));
        receiver
    }

    /// Polls and returns the messages the core sends.
    fn poll(&mut self) -> Vec<Ring> {
        self.core.poll(self.now, None);
        sends(self.core.actions())
    }

    /// Answers `msg` as the ring would: control messages with `Done`, a forward with
    /// `tokens` for its sampled rows, in order.
    fn answer(&mut self, msg: &Ring, tokens: &[u32]) {
        let reply = match msg {
            Ring::Forward(f) => sampled(f, tokens),
            _ => Ring::Done,
        };
        let gen = self.core.gen();
        self.core.reply(gen, reply, self.now);
    }

    /// Polls and answers until nothing more is sent; sampled rows get `tokens` in turn
    /// (the last one repeated). Returns everything sent.
    fn poll_answering(&mut self, tokens: &[u32]) -> Vec<Ring> {
        let mut all = Vec::new();
        let mut next = 0;
        loop {
            let sent = self.poll();
            if sent.is_empty() {
                return all;
            }
            for msg in &sent {
                let sampled = matches!(msg, Ring::Forward(f) if !f.sample_rows.is_empty());
                let token = tokens[next.min(tokens.len() - 1)];
                next += usize::from(sampled);
                self.answer(msg, &[token]);
            }
            all.extend(sent);
        }
    }

    /// Like [`poll_answering`](Self::poll_answering), each sequence's sampled rows
    /// answered with `token(seq)`.
    fn poll_answering_with(&mut self, token: impl Fn(u32) -> u32) -> Vec<Ring> {
        let mut all = Vec::new();
        loop {
            let sent = self.poll();
            if sent.is_empty() {
                return all;
            }
            for msg in &sent {
                let reply = match msg {
                    Ring::Forward(f) => {
                        let tokens: Vec<u32> = f.sample_rows.iter().map(|&r| token(f.seq_ids[r as usize])).collect();
                        sampled(f, &tokens)
                    }
                    _ => Ring::Done,
                };
                let gen = self.core.gen();
                self.core.reply(gen, reply, self.now);
            }
            all.extend(sent);
        }
    }

    /// Delivers what the core told, as the shell does.
    fn deliver(&mut self) {
        for output in self.core.outputs() {
            output.deliver(&self.counters, &self.health);
        }
    }

    fn health(&mut self) -> Health {
        self.deliver();
        self.health.lock().unwrap().clone()
    }

    fn counters(&mut self) -> &Counters {
        self.deliver();
        &self.counters
    }

    /// The events the core told `receiver`'s client so far.
    fn events(&mut self, receiver: &mut UnboundedReceiver<Event>) -> Vec<Event> {
        self.deliver();
        std::iter::from_fn(|| receiver.try_recv().ok()).collect()
    }
}

/// A greedy request for `max_tokens` after `prompt`, with nothing else asked.
fn greedy_job(prompt: &[u32], max_tokens: usize, events: UnboundedSender<Event>) -> Job {
    Job {
        prompt: prompt.to_vec(),
        params: SamplingParams::greedy(),
        max_tokens,
        logprobs: false,
        top_logprobs: 0,
        stop: Vec::new(),
        draft: Draft::OFF,
        grammar: None,
        budget: None,
        show: Vec::new(),
        end: None,
        pooling: None,
        events,
    }
}

fn serving() -> Health {
    Health::Serving {
        stages: vec!["stage".into()],
        lost: vec![],
    }
}

fn sends(actions: Vec<Action>) -> Vec<Ring> {
    actions
        .into_iter()
        .filter_map(|a| match a {
            Action::Send(m) => Some(m),
            Action::FormRing { .. } => None,
        })
        .collect()
}

fn sampled(forward: &Forward, tokens: &[u32]) -> Ring {
    let tokens = forward
        .sample_rows
        .iter()
        .zip(tokens)
        .map(|(&row, &token)| SampledToken {
            seq: forward.seq_ids[row as usize],
            token,
            logprob: f32::NAN,
            top: vec![],
        })
        .collect();
    Ring::Sampled {
        step: forward.step,
        tokens,
    }
}

/// The sequence id of the first `StartSeq` in `sent`.
fn start_seq(sent: &[Ring]) -> u32 {
    sent.iter()
        .find_map(|m| match m {
            Ring::StartSeq(StartSeq { seq, .. }) => Some(*seq),
            _ => None,
        })
        .expect("a StartSeq was sent")
}

fn forward(msg: &Ring) -> &Forward {
    match msg {
        Ring::Forward(f) => f,
        other => panic!("expected a forward, got {other:?}"),
    }
}

fn tokens(forward: &Forward) -> &[u32] {
    match &forward.payload {
        Payload::Tokens(t) => t,
        other => panic!("expected tokens, got {other:?}"),
    }
}

fn texts(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Token(t) => Some(t.text.clone()),
            _ => None,
        })
        .collect()
}

/// A request's thinking budget reaches the last stage in its `StartSeq`.
#[test]
fn a_thinking_budget_travels_in_the_start_of_its_sequence() {
    let mut h = Harness::new(false);
    let (events, _rx) = unbounded_channel();
    let budget = baton_sample::ReasoningBudget {
        tokens: 3,
        start: vec![7],
        ends: vec![vec![8]],
        forced: vec![8],
        prefill: vec![7],
    };
    h.core.submit(Box::new(Job {
        budget: Some(budget.clone()),
        ..greedy_job(&[1, 2, 3], 4, events)
    }));
    let sent = h.poll();
    match &sent[0] {
        Ring::StartSeq(StartSeq { budget: Some(sent), .. }) => assert_eq!(**sent, budget),
        other => panic!("expected a StartSeq with the budget, got {other:?}"),
    }
}

#[test]
fn a_request_runs_from_its_prompt_chunks_to_its_length() {
    let mut h = Harness::new(false);
    let mut rx = h.job(&[1, 2, 3, 4, 5, 6], 3);
    let sent = h.poll();
    // StartSeq, then the prompt in chunks of 4 (up to one per stage plus one waiting).
    assert!(matches!(sent[0], Ring::StartSeq(StartSeq { keep: 0, .. })), "{sent:?}");
    assert_eq!(tokens(forward(&sent[1])), &[1, 2, 3, 4]);
    assert_eq!(tokens(forward(&sent[2])), &[5, 6]);
    assert_eq!(forward(&sent[2]).sample_rows, vec![1]);
    h.answer(&sent[0], &[]);
    h.answer(&sent[1], &[]);
    h.answer(&sent[2], &[7]);
    let mut generated = vec![7];
    for next in [8, 9] {
        let sent = h.poll();
        assert_eq!(sent.len(), 1, "one decode row: {sent:?}");
        assert_eq!(tokens(forward(&sent[0])), &[*generated.last().unwrap()]);
        h.answer(&sent[0], &[next]);
        generated.push(next);
    }
    let events = h.events(&mut rx);
    assert_eq!(texts(&events), vec!["<7>", "<8>", "<9>"]);
    match events.last() {
        Some(Event::Finished(f)) => {
            assert_eq!(f.reason, FinishReason::Length);
            assert_eq!((f.prompt_tokens, f.completion_tokens, f.cached_tokens), (6, 3, 0));
        }
        other => panic!("expected the end, got {other:?}"),
    }
    assert!(h.poll().is_empty(), "nothing left to send");
}

#[test]
fn control_tokens_a_job_shows_are_text_and_others_nothing() {
    let mut h = Harness::new(false);
    let (events_tx, mut rx) = unbounded_channel();
    h.core.submit(Box::new(Job {
        show: vec![901],
        ..greedy_job(&[1, 2], 3, events_tx)
    }));
    let sent = h.poll();
    h.answer(&sent[0], &[]);
    h.answer(&sent[1], &[901]);
    for next in [902, 7] {
        let sent = h.poll();
        h.answer(&sent[0], &[next]);
    }
    assert_eq!(texts(&h.events(&mut rx)), vec!["[901]", "", "<7>"]);
}

#[test]
fn the_end_token_stops_and_the_next_request_reuses_whole_chunks() {
    let mut h = Harness::new(false);
    let prompt: Vec<u32> = (1..=10).collect();
    let mut rx = h.job(&prompt, 10);
    let first_seq = start_seq(&h.poll_answering(&[0]));
    match h.events(&mut rx).last() {
        Some(Event::Finished(f)) => assert_eq!(f.reason, FinishReason::Stop),
        other => panic!("{other:?}"),
    }
    // The same prompt again: the two whole chunks of 4 are reused, [8, 9, 10] computed
    // as the fresh run's last chunk; the slot that held it is chosen.
    let _rx = h.job(&prompt, 10);
    let sent = h.poll();
    assert!(matches!(sent[0], Ring::StartSeq(StartSeq { keep: 8, .. })), "{sent:?}");
    assert_eq!(start_seq(&sent), first_seq, "the slot holding the prefix");
    assert_eq!(tokens(forward(&sent[1])), &[9, 10]);
    assert_eq!(forward(&sent[1]).positions, vec![8, 9]);
    assert_eq!(
        h.counters()
            .prompt_tokens_reused
            .load(std::sync::atomic::Ordering::Relaxed),
        8
    );
}

/// A model with recurrent layers: after each whole prompt chunk every stage is asked to
/// keep a checkpoint of its states there, and a later request reuses a prefix only up
/// to a checkpoint the stages still keep (the newest `CHECKPOINTS` of its slot's).
#[test]
fn recurrent_models_reuse_prefixes_at_the_checkpoints_their_stages_keep() {
    let config = EngineConfig {
        prefix_reuse: crate::PrefixReuse::Checkpoints,
        ..config()
    };
    let mut h = Harness::with_config(config, false);
    // Chunks of 4: 4 whole ones, then [17, 18].
    let prompt: Vec<u32> = (1..=18).collect();
    let _rx = h.job(&prompt, 10);
    let sent = h.poll_answering(&[0]);
    let mut checkpoints = Vec::new();
    for (i, msg) in sent.iter().enumerate() {
        if let Ring::Checkpoint { len, .. } = msg {
            // Right after the chunk it ends.
            assert_eq!(forward(&sent[i - 1]).positions.last(), Some(&(*len as i32 - 1)));
            checkpoints.push(*len);
        }
    }
    assert_eq!(checkpoints, vec![4, 8, 12, 16]);
    // The same prompt again: its last chunk starts at 16, a checkpoint.
    let _rx = h.job(&prompt, 10);
    let sent = h.poll_answering(&[0]);
    assert!(matches!(sent[0], Ring::StartSeq(StartSeq { keep: 16, .. })), "{sent:?}");
    assert!(
        !sent.iter().any(|m| matches!(m, Ring::Checkpoint { .. })),
        "nothing new to keep"
    );
    // Differing at token 10: a KV cache would give 8, a checkpoint too.
    let mut other = prompt.clone();
    other[9] = 99;
    let _rx = h.job(&other, 10);
    let sent = h.poll_answering(&[0]);
    assert!(matches!(sent[0], Ring::StartSeq(StartSeq { keep: 8, .. })), "{sent:?}");
    // Differing at token 6: 4 would do, but of 4, 8, 12 and 16 the stages kept the
    // newest three.
    let mut other = prompt.clone();
    other[5] = 99;
    let _rx = h.job(&other, 10);
    let sent = h.poll();
    assert!(matches!(sent[0], Ring::StartSeq(StartSeq { keep: 0, .. })), "{sent:?}");
}

#[test]
fn a_client_that_goes_away_is_ended_on_every_stage() {
    let mut h = Harness::new(false);
    let rx = h.job(&[1, 2], 10);
    let sent = h.poll();
    let seq = start_seq(&sent);
    for msg in &sent {
        h.answer(msg, &[5]);
    }
    drop(rx);
    let sent = h.poll();
    assert_eq!(sent, vec![Ring::EndSeq { seq }]);
    assert_eq!(
        h.counters()
            .requests_cancelled
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // A queued request whose client left never starts.
    let queued = h.job(&[3], 1);
    drop(queued);
    let sent = h.poll();
    assert!(sent.iter().all(|m| !matches!(m, Ring::StartSeq(_))), "{sent:?}");
}

#[test]
fn a_lost_ring_rebuilds_running_requests_batch_for_batch() {
    let mut h = Harness::new(true);
    let mut rx = h.job(&[1, 2, 3, 4, 5, 6], 10);
    let first: Vec<Ring> = h.poll();
    for msg in &first {
        h.answer(msg, &[7]);
    }
    let decode = h.poll();
    h.answer(&decode[0], &[8]);
    // The ring breaks while the next decode row is in flight.
    let in_flight = h.poll();
    assert_eq!(tokens(forward(&in_flight[0])), &[8]);
    let gen = h.core.gen();
    h.core
        .lost(gen, "worker w:1 was lost: it closed its heartbeat connection", h.now);
    assert_eq!(h.core.actions(), vec![Action::FormRing { gen: gen + 1 }]);
    assert!(matches!(h.health(), Health::Recovering { .. }));
    // A late reply from the old ring changes nothing.
    h.core.reply(gen, Ring::Done, h.now);

    h.core.installed(1, serving(), EndCounters::default(), h.now);
    let rebuilt = sends(h.core.actions());
    match &rebuilt[..] {
        [Ring::StartSeq(StartSeq {
            keep: 0,
            history,
            drawn: 2,
            ..
        })] => assert_eq!(history, &[1, 2, 3, 4, 5, 6, 7, 8]),
        other => panic!("expected one StartSeq, got {other:?}"),
    }
    h.answer(&rebuilt[0], &[]);
    let replay = h.poll();
    let shapes: Vec<(Vec<u32>, Vec<u32>)> = replay
        .iter()
        .map(|m| (tokens(forward(m)).to_vec(), forward(m).sample_rows.clone()))
        .collect();
    // Chunks of 4 and 2 and the decode row of 7 as before; the row of 8 is sampled.
    assert_eq!(shapes[..2], [(vec![1, 2, 3, 4], vec![]), (vec![5, 6], vec![])]);
    for msg in &replay {
        h.answer(msg, &[]);
    }
    let mut rest = h.poll();
    while rest.iter().all(|m| forward(m).sample_rows.is_empty()) && !rest.is_empty() {
        for msg in &rest {
            h.answer(msg, &[]);
        }
        rest = h.poll();
    }
    let all: Vec<Vec<u32>> = replay
        .iter()
        .chain(&rest)
        .map(|m| tokens(forward(m)).to_vec())
        .collect();
    assert_eq!(all, vec![vec![1, 2, 3, 4], vec![5, 6], vec![7], vec![8]]);
    for msg in &rest {
        h.answer(msg, &[9]);
    }
    assert_eq!(
        texts(&h.events(&mut rx)),
        vec!["<7>", "<8>", "<9>"],
        "no token repeated or missing"
    );
    assert_eq!(
        h.counters().tokens_replayed.load(std::sync::atomic::Ordering::Relaxed),
        8
    );
}

/// The core tells and counts, and the shell delivers: a loss without a ring source
/// tells every running and waiting client, and takes away from the counters only what
/// the core counted. A request the engine queued that has not reached the core yet
/// stays counted (the counters used to be zeroed, and its admission later took the
/// queue below zero).
#[test]
fn failing_every_request_takes_away_only_what_the_core_counted() {
    use std::sync::atomic::Ordering::Relaxed;
    let mut h = Harness::new(false);
    // Four submitted to the engine (which counts them), three of them in the core.
    h.counters.queued.store(4, Relaxed);
    let mut running: Vec<_> = (0..2).map(|i| h.job(&[1, 2 + i], 4)).collect();
    let mut waiting = h.job(&[7, 8], 4);
    h.poll();
    assert_eq!(h.counters().active.load(Relaxed), 2);
    assert_eq!(h.counters().queued.load(Relaxed), 2);
    let gen = h.core.gen();
    h.core.lost(gen, "the ring broke", h.now);
    for rx in running.iter_mut().chain([&mut waiting]) {
        assert!(matches!(h.events(rx).last(), Some(Event::Failed(_))));
    }
    let counters = h.counters();
    assert_eq!(counters.active.load(Relaxed), 0);
    assert_eq!(counters.queued.load(Relaxed), 1, "the one on its way to the core");
    assert_eq!(counters.requests_failed.load(Relaxed), 3);
}

#[test]
fn without_a_ring_source_a_loss_fails_every_request() {
    let mut h = Harness::new(false);
    let mut rx = h.job(&[1, 2], 4);
    h.poll();
    let gen = h.core.gen();
    h.core.lost(gen, "the ring broke: link to stage 1 is closed", h.now);
    assert!(h.core.actions().is_empty(), "nothing forms a new ring");
    assert!(matches!(h.health(), Health::Failed { .. }));
    assert!(matches!(h.events(&mut rx).last(), Some(Event::Failed(e)) if e.reason.contains("link to stage 1")));
}

#[test]
fn deadlines_come_from_the_clock_given() {
    // A step unanswered for longer than the step timeout: the ring counts as lost.
    let mut h = Harness::new(true);
    let _rx = h.job(&[1, 2], 4);
    h.poll();
    h.now += Duration::from_secs(59);
    h.core.poll(h.now, None);
    assert!(h.core.actions().is_empty());
    h.now += Duration::from_secs(2);
    h.core.poll(h.now, None);
    assert!(matches!(h.core.actions()[..], [Action::FormRing { .. }]));

    // No new ring within the recovery timeout: running requests fail, health waits.
    let mut h = Harness::new(true);
    let mut rx = h.job(&[1, 2], 4);
    h.poll();
    let gen = h.core.gen();
    h.core.lost(gen, "worker w:1 was lost", h.now);
    h.core.actions();
    h.core.form_failed(FormError::Retry("w:2 refused".into()));
    h.now += Duration::from_secs(31);
    h.core.poll(h.now, None);
    assert!(matches!(h.events(&mut rx).last(), Some(Event::Failed(e)) if e.reason.contains("within 30 s")));
    assert!(matches!(h.health(), Health::Waiting { .. }));
}

#[test]
fn without_capacity_requests_fail_at_once_and_new_ones_wait_for_a_ring() {
    let mut h = Harness::new(true);
    let mut rx = h.job(&[1, 2], 4);
    h.poll();
    let gen = h.core.gen();
    h.core.lost(gen, "worker w:1 was lost", h.now);
    h.core
        .form_failed(FormError::Capacity("the workers left cannot hold the model".into()));
    assert!(matches!(h.events(&mut rx).last(), Some(Event::Failed(e)) if e.reason.contains("cannot hold")));
    assert!(matches!(h.health(), Health::Waiting { .. }));
    let _later = h.job(&[3], 1);
    assert!(h.poll().is_empty(), "nothing is sent without a ring");
}

#[test]
fn when_a_lost_node_returns_an_idle_engine_moves_to_the_better_ring() {
    let mut h = Harness::new(true);
    let rx = h.job(&[1], 1);
    let sent = h.poll();
    h.core.poll(h.now, Some(Better::Returned));
    assert!(h.core.actions().is_empty(), "busy: stays on the ring it has");
    for msg in &sent {
        h.answer(msg, &[5]);
    }
    drop(rx);
    h.core.poll(h.now, Some(Better::Returned));
    assert!(matches!(h.core.actions()[..], [Action::FormRing { .. }]));
}

#[test]
fn when_a_node_joins_a_busy_engine_forms_a_ring_with_it_at_once_and_keeps_its_requests() {
    let mut h = Harness::new(true);
    let mut rx = h.job(&[1], 4);
    h.poll();
    h.core.poll(h.now, Some(Better::Joined));
    assert!(matches!(h.core.actions()[..], [Action::FormRing { .. }]));
    assert!(matches!(h.health(), Health::Recovering { .. }));
    assert!(
        !h.events(&mut rx).iter().any(|e| matches!(e, Event::Failed(_))),
        "the running request waits for the new ring"
    );
}

#[test]
fn a_stage_error_fails_only_the_sequences_of_its_step() {
    let mut h = Harness::new(false);
    let mut a = h.job(&[1], 4);
    let mut b = h.job(&[2], 4);
    let sent = h.poll();
    // StartSeq a, StartSeq b, prompt of a (alone), prompt of b waits its turn... answer
    // the first forward with an error.
    let step = sent.iter().position(|m| matches!(m, Ring::Forward(_))).unwrap();
    for msg in &sent[..step] {
        h.answer(msg, &[]);
    }
    let gen = h.core.gen();
    h.core.reply(
        gen,
        Ring::Error {
            first_layer: 12,
            fault: baton_proto::Fault::Request,
            message: "the grammar allows no token here".into(),
        },
        h.now,
    );
    // The stage's fault says whose failure it is: the request's here (an HTTP 400).
    h.deliver();
    let failed = |rx: &mut UnboundedReceiver<Event>| {
        std::iter::from_fn(|| rx.try_recv().ok()).any(|e| {
            matches!(&e, Event::Failed(f) if f.cause == crate::Cause::Request
                && f.reason == "the stage from layer 12: the grammar allows no token here")
        })
    };
    let a_seq = start_seq(&sent);
    let first_seq = forward(&sent[step]).seq_ids[0];
    let (hit, spared) = if first_seq == a_seq {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    assert!(failed(hit), "the sequence of the failed step fails");
    assert!(!failed(spared), "the other goes on");
}

/// A stage that returns a token id outside the vocabulary fails that request with a
/// clear error; the id is never detokenized (llama.cpp would throw across the C
/// boundary and abort the head).
#[test]
fn a_token_outside_the_vocabulary_fails_its_request_not_the_head() {
    let mut h = Harness::new(false);
    let mut bad = h.job(&[1, 2], 4);
    let mut good = h.job(&[3, 4], 4);
    let sent = h.poll_answering_with(|seq| if seq == 0 { 1_000_000 } else { 7 });
    assert!(!sent.is_empty());
    let bad_events = h.events(&mut bad);
    let good_events = h.events(&mut good);
    let (failed, spared) = if bad_events.iter().any(|e| matches!(e, Event::Failed(_))) {
        (bad_events, good_events)
    } else {
        (good_events, bad_events)
    };
    assert!(
        failed
            .iter()
            .any(|e| matches!(e, Event::Failed(why) if why.reason.contains("outside the vocabulary of 1000"))),
        "{failed:?}"
    );
    assert!(spared.iter().any(|e| matches!(e, Event::Finished(_))), "{spared:?}");
}

/// Why there are no figures is a case a caller can tell apart: a ring being formed, a
/// stage's error with its fault, a ring lost.
#[test]
fn stats_that_cannot_be_had_say_why_by_case() {
    let mut h = Harness::new(true);
    let (reply, mut answer) = tokio::sync::oneshot::channel();
    h.core.stats(reply, h.now);
    assert!(matches!(h.poll().as_slice(), [Ring::Stats(_)]));
    let error = Ring::Error {
        first_layer: 12,
        fault: baton_proto::Fault::CacheFull,
        message: "the KV cache is full".into(),
    };
    let gen = h.core.gen();
    h.core.reply(gen, error, h.now);
    h.deliver();
    let Err(StatsError::Stage { first_layer, fault, .. }) = answer.try_recv().unwrap() else {
        panic!("a stage's error")
    };
    assert_eq!((first_layer, fault), (12, baton_proto::Fault::CacheFull));

    // A supervised head that lost its ring forms another meanwhile.
    h.core.lost(gen, "worker 2 is gone", h.now);
    let (reply, mut answer) = tokio::sync::oneshot::channel();
    h.core.stats(reply, h.now);
    h.deliver();
    assert_eq!(answer.try_recv().unwrap(), Err(StatsError::Forming));
}

#[test]
fn the_last_links_round_trip_is_the_heads_own_where_the_stage_measured_none() {
    let mut h = Harness::new(true);
    let ends = EndCounters::default();
    ends.into_first.record_round_trip(Duration::from_micros(700));
    ends.from_last.record_round_trip(Duration::from_micros(3_000));
    h.core.installed(2, serving(), ends, h.now);
    let ask = |h: &mut Harness, link_rtt_us: Vec<u64>| {
        let (reply, mut answer) = tokio::sync::oneshot::channel();
        h.core.stats(reply, h.now);
        assert!(matches!(h.poll().as_slice(), [Ring::Stats(_)]));
        let stats = Ring::Stats(Stats {
            resident: vec![1, 2],
            kv_used: vec![0, 0],
            busy_us: vec![0, 0],
            rows: vec![0, 0],
            link_sent: vec![10, 20],
            link_rtt_us,
        });
        let gen = h.core.gen();
        h.core.reply(gen, stats, h.now);
        h.deliver();
        answer.try_recv().unwrap().unwrap()
    };
    // The last stage was dialed by the head: it reports 0, and the head fills in what it
    // measured on its end of that link.
    let stats = ask(&mut h, vec![1_500, 0]);
    assert_eq!(stats.ring.link_rtt_us, [1_500, 3_000]);
    assert_eq!(stats.head_link_rtt_us, 700);
    // A figure the stage measured itself is kept.
    assert_eq!(ask(&mut h, vec![1_500, 40]).ring.link_rtt_us, [1_500, 40]);
}

/// Ends generation once the text holds `<3>`.
#[derive(Debug, Default)]
struct EndsAtThree(String);

impl EndCheck for EndsAtThree {
    fn ends_after(&mut self, text: &str) -> bool {
        self.0.push_str(text);
        self.0.contains("<3>")
    }
}

#[test]
fn a_jobs_end_check_ends_it_at_the_token_that_completes_it() {
    let mut h = Harness::new(false);
    let (events_tx, mut rx) = unbounded_channel();
    h.core.submit(Box::new(Job {
        end: Some(Box::new(EndsAtThree::default())),
        ..greedy_job(&[1, 2], 10, events_tx)
    }));
    // The ring would go on with 4, 5, ...: nothing after 3 is sent or reported.
    let sent = h.poll_answering(&[2, 3, 4, 5]);
    let events = h.events(&mut rx);
    assert_eq!(texts(&events), ["<2>", "<3>"]);
    match events.last() {
        Some(Event::Finished(f)) => {
            assert_eq!(f.reason, FinishReason::Stop);
            assert_eq!(f.completion_tokens, 2);
        }
        other => panic!("expected the end, got {other:?}"),
    }
    let decoded: Vec<u32> = sent
        .iter()
        .filter_map(|m| match m {
            Ring::Forward(f) if f.positions[0] >= 2 => Some(tokens(f)[0]),
            _ => None,
        })
        .collect();
    assert_eq!(decoded, [2], "only the token before the end goes back into the ring");
}

/// Runs an embedding of `prompt` to its last chunk: the sends, and the last forward.
fn pooled_job(h: &mut Harness, prompt: &[u32]) -> (UnboundedReceiver<Event>, Vec<Ring>, Forward) {
    let (events, receiver) = unbounded_channel();
    h.core.submit(Box::new(Job {
        pooling: Some(baton_proto::Pooling::Mean),
        ..greedy_job(prompt, 0, events)
    }));
    let mut all = Vec::new();
    loop {
        let sent = h.poll();
        assert!(!sent.is_empty(), "the embedding stalled: {all:?}");
        for msg in &sent {
            if let Ring::Forward(f) = msg {
                if !f.sample_rows.is_empty() {
                    all.extend(sent.clone());
                    return (receiver, all, f.clone());
                }
            }
            h.answer(msg, &[]);
        }
        all.extend(sent);
    }
}

/// An embedding: the stages are told to pool the sequence from an empty cache, its
/// prompt goes in chunks, each alone, the last samples only the last row; the pooled
/// vector finishes the request, its cells are freed on every stage, and its prompt is
/// never reused as a cached prefix.
#[test]
fn an_embedding_pools_its_prompt_and_keeps_nothing_cached() {
    let mut h = Harness::new(false);
    let prompt: Vec<u32> = (1..=10).collect();
    let (mut rx, sent, last) = pooled_job(&mut h, &prompt);
    assert!(
        matches!(
            sent[0],
            Ring::StartSeq(StartSeq {
                keep: 0,
                pooling: Some(baton_proto::Pooling::Mean),
                ..
            })
        ),
        "{sent:?}"
    );
    let chunks: Vec<&Forward> = sent
        .iter()
        .filter(|m| matches!(m, Ring::Forward(_)))
        .map(forward)
        .collect();
    assert_eq!(chunks.iter().map(|f| tokens(f).len()).collect::<Vec<_>>(), [4, 4, 2]);
    assert!(chunks.iter().all(|f| f.seq_ids.iter().all(|&s| s == f.seq_ids[0])));
    assert_eq!(last.sample_rows, [1]);
    let seq = last.seq_ids[0];
    let values = vec![0.5, -0.5, 0.5, -0.5];
    let gen = h.core.gen();
    let pooled = Ring::Pooled {
        step: last.step,
        seq,
        values: values.clone(),
    };
    h.core.reply(gen, pooled, h.now);
    let events = h.events(&mut rx);
    match events.as_slice() {
        [Event::Finished(f)] => {
            assert_eq!(f.embedding.as_deref(), Some(&values[..]));
            assert_eq!((f.prompt_tokens, f.completion_tokens, f.cached_tokens), (10, 0, 0));
        }
        other => panic!("{other:?}"),
    }
    let sent = h.poll();
    assert!(sent.contains(&Ring::EndSeq { seq }), "{sent:?}");
    h.answer(&sent[0], &[]);
    // The same prompt to generate from: nothing is reused.
    let _rx = h.job(&prompt, 2);
    let sent = h.poll();
    assert!(
        matches!(
            sent[0],
            Ring::StartSeq(StartSeq {
                keep: 0,
                pooling: None,
                ..
            })
        ),
        "{sent:?}"
    );
}

/// A pooled vector of another width than the model's, or for a step that asked for
/// none, fails the request as the server's fault.
#[test]
fn a_pooled_vector_of_the_wrong_width_fails_the_request() {
    for values in [vec![1.0; 3], vec![1.0; 5]] {
        let mut h = Harness::new(false);
        let (mut rx, _, last) = pooled_job(&mut h, &[1, 2, 3]);
        let gen = h.core.gen();
        let seq = last.seq_ids[0];
        h.core.reply(
            gen,
            Ring::Pooled {
                step: last.step,
                seq,
                values,
            },
            h.now,
        );
        match h.events(&mut rx).as_slice() {
            [Event::Failed(f)] => assert_eq!(f.cause, crate::types::Cause::Server, "{f:?}"),
            other => panic!("{other:?}"),
        }
    }
    // A generating request answered with a vector fails too.
    let mut h = Harness::new(false);
    let mut rx = h.job(&[1, 2, 3], 2);
    let sent = h.poll();
    h.answer(&sent[0], &[]);
    let f = forward(&sent[1]).clone();
    let gen = h.core.gen();
    h.core.reply(
        gen,
        Ring::Pooled {
            step: f.step,
            seq: f.seq_ids[0],
            values: vec![1.0; 4],
        },
        h.now,
    );
    assert!(matches!(h.events(&mut rx).as_slice(), [Event::Failed(_)]));
}

/// An embedding whose ring is lost mid-way is started again on the new one, pooled, and
/// its chunks sent again as before, each alone (a one-token chunk included: it is never
/// taken for a decode row beside another sequence's).
#[test]
fn a_lost_ring_rebuilds_an_embedding_chunk_for_chunk() {
    let mut h = Harness::new(true);
    let decoding = h.job(&[1, 2], 10);
    let sent = h.poll();
    for msg in &sent {
        h.answer(msg, &[7]);
    }
    let (events_tx, mut rx) = unbounded_channel();
    h.core.submit(Box::new(Job {
        pooling: Some(baton_proto::Pooling::Cls),
        ..greedy_job(&[1, 2, 3, 4, 5], 0, events_tx)
    }));
    // Everything answered until the embedding's last chunk is in flight: the ring is
    // lost then, so both of its chunks (4 tokens, then 1) are sent again.
    'sent: for _ in 0..10 {
        for msg in h.poll() {
            if matches!(&msg, Ring::Forward(f) if f.sample_rows.len() == 1 && tokens(f) == [5]) {
                break 'sent;
            }
            h.answer(&msg, &[7]);
        }
    }
    let gen = h.core.gen();
    h.core.lost(gen, "worker w:1 was lost", h.now);
    h.core.installed(1, serving(), EndCounters::default(), h.now);
    let rebuilt = sends(h.core.actions());
    let pooled_seq = rebuilt
        .iter()
        .find_map(|m| match m {
            Ring::StartSeq(StartSeq {
                seq,
                keep: 0,
                pooling: Some(baton_proto::Pooling::Cls),
                ..
            }) => Some(*seq),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no pooled StartSeq: {rebuilt:?}"));
    for msg in &rebuilt {
        h.answer(msg, &[]);
    }
    let mut pooled_batches = Vec::new();
    for _ in 0..10 {
        let sent = h.poll();
        for msg in &sent {
            if let Ring::Forward(f) = msg {
                if f.seq_ids.contains(&pooled_seq) {
                    let alone = f.seq_ids.iter().all(|&s| s == pooled_seq);
                    assert!(alone, "a pooled chunk in company: {f:?}");
                    pooled_batches.push(tokens(f).to_vec());
                    if !f.sample_rows.is_empty() {
                        let pooled = Ring::Pooled {
                            step: f.step,
                            seq: pooled_seq,
                            values: vec![0.5; 4],
                        };
                        let gen = h.core.gen();
                        h.core.reply(gen, pooled, h.now);
                        continue;
                    }
                }
            }
            h.answer(msg, &[7]);
        }
    }
    assert_eq!(pooled_batches, [vec![1, 2, 3, 4], vec![5]]);
    assert!(matches!(h.events(&mut rx).as_slice(), [Event::Finished(f)] if f.embedding.is_some()));
    drop(decoding);
}

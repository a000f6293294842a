//! Slots: a sequence id with its own region of every stage's KV cache, the request that
//! runs in it, and, between requests, the cached prefix it keeps for the next one.

use std::collections::VecDeque;

use super::draft::SeqDraft;
use super::text::TextStream;
use super::types::{Job, PrefixReuse};

/// A sequence id with its share of the KV cache.
pub(crate) struct Slot {
    /// Tokens whose cache every stage holds for this slot (when no request runs in it).
    pub cached: Vec<u32>,
    /// The batches `cached` went into the ring in (token counts, in order).
    pub cached_runs: Vec<u32>,
    /// Positions where the stages keep a checkpoint of this slot's recurrent states,
    /// oldest first (models with recurrent layers).
    pub checkpoints: Vec<usize>,
    /// When it was last given out (for least-recently-used choice).
    pub last_used: u64,
    pub active: Option<Active>,
}

impl Slot {
    pub fn empty() -> Slot {
        Slot {
            cached: Vec::new(),
            cached_runs: Vec::new(),
            checkpoints: Vec::new(),
            last_used: 0,
            active: None,
        }
    }

    /// Forgets the cached prefix (its cells are gone or about to be).
    pub fn forget(&mut self) {
        self.cached.clear();
        self.cached_runs.clear();
        self.checkpoints.clear();
    }

    /// How many leading tokens of `prompt` a request may take from this slot's cache
    /// (see [`reusable_prefix`]), where `reuse` allows.
    pub fn reusable(&self, prompt: &[u32], chunk: usize, reuse: PrefixReuse) -> usize {
        let anywhere = reusable_prefix(&self.cached, &self.cached_runs, prompt, chunk);
        match reuse {
            PrefixReuse::Anywhere => anywhere,
            PrefixReuse::Recent(slack) if self.cached.len() - anywhere.min(self.cached.len()) <= slack => anywhere,
            PrefixReuse::Recent(_) => 0,
            PrefixReuse::Checkpoints => self
                .checkpoints
                .iter()
                .copied()
                .filter(|&at| at <= anywhere)
                .max()
                .unwrap_or(0),
        }
    }
}

/// A request running in a slot.
pub(crate) struct Active {
    /// Distinguishes this request from earlier ones in the same slot (stale replies).
    pub epoch: u64,
    pub job: Box<Job>,
    /// Prompt followed by generated tokens.
    pub tokens: Vec<u32>,
    pub n_prompt: usize,
    /// Prompt tokens taken from the slot's cache.
    pub n_reused: usize,
    /// Tokens sent into the ring (their cache exists once the steps are through).
    pub n_sent: usize,
    /// How many tokens each send carried, covering `tokens[..n_sent]`: what a rebuild
    /// on a new ring repeats, batch for batch.
    pub runs: Vec<u32>,
    /// Positions where the stages keep a checkpoint of its recurrent states, oldest
    /// first.
    pub checkpoints: Vec<usize>,
    /// Sends still to repeat after a rebuild.
    pub replay: VecDeque<u32>,
    /// A row of this sequence that will be sampled is in the ring.
    pub waiting: bool,
    pub generated: usize,
    pub text: TextStream,
    /// Step counter when this sequence last went into a batch (fairness).
    pub last_batch: u64,
    /// What its log lines belong to (`BATON_LOG=debug`).
    pub span: tracing::Span,
    /// Its speculation settings and measured acceptance.
    pub draft: SeqDraft,
}

impl Active {
    /// A request starting in a slot whose first `n_reused` prompt tokens are cached,
    /// sent in `runs`.
    pub fn new(job: Box<Job>, epoch: u64, n_reused: usize, runs: Vec<u32>, acceptance: f64) -> Active {
        Active {
            epoch,
            tokens: job.prompt.clone(),
            n_prompt: job.prompt.len(),
            n_reused,
            n_sent: n_reused,
            runs,
            checkpoints: Vec::new(),
            replay: VecDeque::new(),
            waiting: false,
            generated: 0,
            text: TextStream::new(&job.stop),
            last_batch: 0,
            span: tracing::debug_span!("request", id = epoch, n_prompt = job.prompt.len(), n_reused),
            draft: SeqDraft {
                draft: job.draft,
                acceptance,
            },
            job,
        }
    }

    /// What the sequence sends next, if anything: `(tokens, alone)`. A prompt chunk
    /// (or a repeated one) goes alone in its micro-batch; a single token goes as a
    /// decode row beside other sequences' rows.
    pub fn next_send(&self, chunk: usize) -> Option<(usize, bool)> {
        if self.waiting || self.n_sent >= self.tokens.len() {
            return None;
        }
        if let Some(&n) = self.replay.front() {
            return Some((n as usize, n > 1 || self.pooled()));
        }
        if self.n_sent < self.n_prompt {
            return Some((chunk.min(self.n_prompt - self.n_sent), true));
        }
        Some((1, false))
    }

    /// Whether its next send is a decode row.
    pub fn decoding(&self) -> bool {
        if self.pooled() {
            return false;
        }
        match self.replay.front() {
            Some(&n) => n == 1,
            None => self.n_sent >= self.n_prompt,
        }
    }

    /// Whether the request is an embedding: its prompt only, each chunk alone in its
    /// batch (a one-token chunk is never a decode row), its rows pooled.
    pub fn pooled(&self) -> bool {
        self.job.pooling.is_some()
    }

    /// Prepares the sequence to be sent again from the start on a new ring, in exactly
    /// the batches it went in; returns how many tokens will be repeated.
    pub fn restart(&mut self) -> usize {
        self.replay = self.runs.drain(..).collect();
        // The new ring's stages keep none; the repeated chunks ask for them again.
        self.checkpoints.clear();
        let repeated = self.n_sent;
        self.n_sent = 0;
        self.waiting = false;
        repeated
    }
}

/// The free slot an embedding should run in: it keeps no prefix, so the one whose
/// cache has least to lose, then the least recently used.
pub(crate) fn choose_slot_to_pool(slots: &[Slot]) -> Option<usize> {
    (0..slots.len())
        .filter(|&i| slots[i].active.is_none())
        .min_by_key(|&i| (slots[i].cached.len(), slots[i].last_used))
}

/// The free slot a prompt should run in: the one with the longest reusable prefix, then
/// the longest common prefix, then the least recently used.
pub(crate) fn choose_slot(slots: &[Slot], prompt: &[u32], chunk: usize, reuse: PrefixReuse) -> Option<usize> {
    (0..slots.len())
        .filter(|&i| slots[i].active.is_none())
        .max_by_key(|&i| {
            let slot = &slots[i];
            (
                slot.reusable(prompt, chunk, reuse),
                common_prefix(&slot.cached, prompt),
                std::cmp::Reverse(slot.last_used),
            )
        })
}

/// How many leading tokens of `prompt` may be taken from a slot's cache (`cached`, sent
/// in `runs`) so that every row the request computes is bit-identical to a fresh run.
///
/// A fresh prompt is cut into chunks of `chunk` tokens from position 0, the last chunk
/// holding the rest; ggml rounds a row differently in batches of different shapes, so a
/// cached cell is as good as a fresh one only if it was computed in the same chunk as a
/// fresh run computes it: reuse stops at the first run that was not a whole chunk (a
/// short last prompt chunk, a generated token), at the first chunk whose tokens differ,
/// and before the prompt's own last chunk (the one sampled). What follows is computed
/// exactly as a fresh run computes it.
pub(crate) fn reusable_prefix(cached: &[u32], runs: &[u32], prompt: &[u32], chunk: usize) -> usize {
    let chunk = chunk.max(1);
    let last_chunk_start = (prompt.len().saturating_sub(1) / chunk) * chunk;
    let common = common_prefix(cached, prompt);
    let whole = runs.iter().take_while(|&&run| run as usize == chunk).count() * chunk;
    let reusable = whole.min(common).min(last_chunk_start);
    reusable - reusable % chunk
}

/// The runs that cover the first `n` tokens of `runs` (the last one cut short if `n`
/// falls inside it).
pub(crate) fn runs_prefix(runs: &[u32], n: usize) -> Vec<u32> {
    let mut out = Vec::new();
    let mut left = n;
    for &run in runs {
        if left == 0 {
            break;
        }
        let take = (run as usize).min(left);
        out.push(take as u32);
        left -= take;
    }
    if left > 0 {
        // Cannot happen (the runs cover the cache), but a rebuild must cover every token.
        out.push(left as u32);
    }
    out
}

/// Length of the common prefix of two token lists.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::type_complexity)] // a table of cases
    fn reuse_is_cut_where_a_fresh_prompt_is_cut() {
        let prompt: Vec<u32> = (0..40).collect();
        // (cached tokens, their runs, chunk, prompt) -> reusable
        let cases: [(&[u32], &[u32], usize, &[u32], usize); 8] = [
            // turn 1 computed 2 whole chunks of 8, a short last chunk, then decoded 3
            (&prompt[..23], &[8, 8, 4, 1, 1, 1], 8, &prompt, 16),
            // the same, but the new prompt differs inside the second chunk
            (
                &prompt[..23],
                &[8, 8, 4, 1, 1, 1],
                8,
                &[&prompt[..12], &[99]].concat(),
                8,
            ),
            // a fresh prompt's last chunk is always computed, even when all is cached
            (&prompt[..32], &[8, 8, 8, 8], 8, &prompt[..32], 24),
            (&prompt[..32], &[8, 8, 8, 8], 8, &prompt[..33], 32),
            // nothing cached, or nothing in common
            (&[], &[], 8, &prompt, 0),
            (&[7, 7, 7, 7, 7, 7, 7, 7, 7], &[8, 1], 8, &prompt, 0),
            // decoded tokens are never whole chunks (unless a chunk is one token)
            (
                &prompt[..20],
                &[4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
                8,
                &prompt,
                0,
            ),
            (&prompt[..5], &[1, 1, 1, 1, 1], 1, &prompt[..10], 5),
        ];
        for (i, (cached, runs, chunk, prompt, want)) in cases.into_iter().enumerate() {
            assert_eq!(reusable_prefix(cached, runs, prompt, chunk), want, "case {i}");
        }
    }

    #[test]
    fn runs_prefix_table() {
        let cases: [(&[u32], usize, &[u32]); 5] = [
            (&[8, 8, 4, 1], 0, &[]),
            (&[8, 8, 4, 1], 8, &[8]),
            (&[8, 8, 4, 1], 12, &[8, 4]),
            (&[8, 8, 4, 1], 21, &[8, 8, 4, 1]),
            (&[8], 10, &[8, 2]),
        ];
        for (runs, n, want) in cases {
            assert_eq!(runs_prefix(runs, n), want, "{runs:?} {n}");
        }
    }

    #[test]
    fn the_slot_with_the_most_reusable_cache_wins_then_the_least_recently_used() {
        let slot = |cached: &[u32], runs: &[u32], last_used: u64| Slot {
            cached: cached.to_vec(),
            cached_runs: runs.to_vec(),
            checkpoints: Vec::new(),
            last_used,
            active: None,
        };
        let prompt: Vec<u32> = (0..20).collect();
        let slots = vec![
            slot(&prompt[..9], &[4, 4, 1], 5),
            slot(&prompt[..6], &[4, 2], 1),
            slot(&[], &[], 0),
            slot(&prompt[..3], &[3], 9),
        ];
        assert_eq!(
            choose_slot(&slots, &prompt, 4, PrefixReuse::Anywhere),
            Some(0),
            "8 reusable tokens"
        );
        // Nothing reusable anywhere (chunk 16): the longest common prefix, then the LRU.
        assert_eq!(choose_slot(&slots, &prompt, 16, PrefixReuse::Anywhere), Some(0));
        assert_eq!(
            choose_slot(&slots, &[99, 98], 16, PrefixReuse::Anywhere),
            Some(2),
            "least recently used"
        );
    }

    /// With window-sized caches a slot's prefix is reused only when the cut is within
    /// the caches' slack; cut back further, the prompt is computed from the start.
    #[test]
    fn window_caches_reuse_only_prefixes_near_the_end_of_the_slot() {
        let prompt: Vec<u32> = (0..40).collect();
        let mut slot = Slot::empty();
        slot.cached = (0..30).collect();
        slot.cached.push(99);
        slot.cached_runs = vec![4; 7];
        slot.cached_runs.extend([2, 1]);
        // 31 cached, 28 reusable (7 whole chunks): a cut of 3.
        assert_eq!(slot.reusable(&prompt, 4, PrefixReuse::Anywhere), 28);
        assert_eq!(slot.reusable(&prompt, 4, PrefixReuse::Recent(3)), 28);
        assert_eq!(slot.reusable(&prompt, 4, PrefixReuse::Recent(2)), 0);
        // Only the first chunk in common: a cut of 27.
        let other: Vec<u32> = (0..4).chain(100..140).collect();
        assert_eq!(slot.reusable(&other, 4, PrefixReuse::Anywhere), 4);
        assert_eq!(slot.reusable(&other, 4, PrefixReuse::Recent(26)), 0);
        assert_eq!(slot.reusable(&other, 4, PrefixReuse::Recent(27)), 4);
    }
}

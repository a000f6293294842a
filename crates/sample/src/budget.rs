//! A budget of thinking tokens, as llama.cpp's `common_reasoning_budget` sampler keeps
//! it: after a start sequence (`<think>`), count the generated tokens; when the budget
//! is spent, let a character split across tokens complete, then force the forced
//! sequence (the end tag, `</think>`) token by token; a natural end sequence ends the
//! count early, and a new start sequence starts a new budget.
//!
//! The budget masks logits (every token but the forced one gets `-inf`) before the
//! sampler's own chain, as llama.cpp applies it first; the token drawn is then accepted
//! here as everywhere else.

/// What a sequence's thinking may spend, and how it is recognised and ended (token ids
/// of the model's vocabulary).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReasoningBudget {
    /// Tokens the thinking may take after its start sequence (0: the end is forced at
    /// once).
    pub tokens: u32,
    /// The sequence that opens the thinking.
    pub start: Vec<u32>,
    /// Sequences that close it (the model ending its thinking itself).
    pub ends: Vec<Vec<u32>>,
    /// What is forced when the budget is spent (an optional message, then the first
    /// end sequence).
    pub forced: Vec<u32>,
    /// The end of the prompt, read before the generated tokens: the start sequence when
    /// the template's generation prompt opens the thinking (llama.cpp's prefill).
    pub prefill: Vec<u32>,
}

/// Longest start, end, forced or prefill sequence a budget may carry: tags are a few
/// tokens; this bounds what a peer can make a stage hold and match.
pub const MAX_BUDGET_SEQ: usize = 64;
/// Most end sequences a budget may carry.
pub const MAX_BUDGET_ENDS: usize = 8;

/// Where a sequence is in its budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetState {
    /// Waiting for the start sequence.
    Idle,
    /// Counting: `remaining` tokens left.
    Counting { remaining: u32 },
    /// Spent, waiting for a character split across tokens to complete.
    WaitingUtf8,
    /// Forcing the forced sequence; `at`: the next of its tokens.
    Forcing { at: usize },
    /// Ended (naturally or forced); a new start sequence counts again.
    Done,
}

/// A budget being spent by one sequence.
#[derive(Clone, Debug)]
pub struct BudgetTracker {
    budget: ReasoningBudget,
    state: BudgetState,
    /// Tokens since the start matcher last matched (or was reset), at most the longest
    /// start sequence.
    start_tail: Vec<u32>,
    /// The same for the end sequences.
    end_tail: Vec<u32>,
}

impl BudgetTracker {
    /// A tracker of `budget`, past its prefill (counting already when the prefill ends
    /// with the start sequence).
    pub fn new(budget: ReasoningBudget) -> BudgetTracker {
        let mut tracker = BudgetTracker {
            budget,
            state: BudgetState::Idle,
            start_tail: Vec::new(),
            end_tail: Vec::new(),
        };
        for token in std::mem::take(&mut tracker.budget.prefill) {
            tracker.accept(token, true);
        }
        tracker
    }

    /// Where the sequence is.
    pub fn state(&self) -> BudgetState {
        self.state
    }

    /// The only token the next draw may give, while the end is being forced.
    pub fn forced(&self) -> Option<u32> {
        match self.state {
            BudgetState::Forcing { at } => self.budget.forced.get(at).copied(),
            _ => None,
        }
    }

    /// Sets every logit but the forced token's to `-inf` (nothing while not forcing).
    pub fn mask(&self, logits: &mut [f32]) {
        if let Some(forced) = self.forced() {
            for (token, logit) in logits.iter_mut().enumerate() {
                if token as u32 != forced {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Takes the token the sequence got; `complete`: whether the token's text ends on a
    /// whole character (a token that ends inside one delays the forcing, as llama.cpp's
    /// does).
    pub fn accept(&mut self, token: u32, complete: bool) {
        match self.state {
            // Waiting for the start, or ended: a start counts (again).
            BudgetState::Idle | BudgetState::Done => {
                if matches(&mut self.start_tail, std::slice::from_ref(&self.budget.start), token) {
                    self.end_tail.clear();
                    self.start();
                }
            }
            BudgetState::Counting { .. } | BudgetState::WaitingUtf8 => {
                if matches(&mut self.end_tail, &self.budget.ends, token) {
                    self.state = BudgetState::Done;
                    return;
                }
                self.state = match self.state {
                    BudgetState::WaitingUtf8 if complete => self.forcing(),
                    BudgetState::Counting { remaining } if remaining <= 1 && complete => self.forcing(),
                    BudgetState::Counting { remaining } if remaining <= 1 => {
                        self.end_tail.clear();
                        BudgetState::WaitingUtf8
                    }
                    BudgetState::Counting { remaining } => BudgetState::Counting {
                        remaining: remaining - 1,
                    },
                    other => other,
                };
            }
            BudgetState::Forcing { at } => {
                // The end sequence inside the forced one is tracked, as llama.cpp does.
                matches(&mut self.end_tail, &self.budget.ends, token);
                self.state = if at + 1 >= self.budget.forced.len() {
                    BudgetState::Done
                } else {
                    BudgetState::Forcing { at: at + 1 }
                };
            }
        }
    }

    fn start(&mut self) {
        self.state = match self.budget.tokens {
            0 => self.forcing(),
            n => BudgetState::Counting { remaining: n },
        };
    }

    fn forcing(&mut self) -> BudgetState {
        self.end_tail.clear();
        match self.budget.forced.is_empty() {
            true => BudgetState::Done,
            false => BudgetState::Forcing { at: 0 },
        }
    }
}

/// Appends `token` to `tail` and says whether one of `seqs` (non-empty ones) now ends
/// it; a match empties `tail`, as llama.cpp's matcher restarts after one. `tail` keeps
/// no more than the longest sequence.
fn matches(tail: &mut Vec<u32>, seqs: &[Vec<u32>], token: u32) -> bool {
    let longest = seqs.iter().map(Vec::len).max().unwrap_or(0);
    if longest == 0 {
        return false;
    }
    tail.push(token);
    if tail.len() > longest {
        tail.remove(0);
    }
    let hit = seqs.iter().any(|s| !s.is_empty() && tail.ends_with(s));
    if hit {
        tail.clear();
    }
    hit
}

/// Whether `bytes` end on a whole UTF-8 character (llama.cpp's
/// `common_utf8_is_complete`): no lead byte at the end waits for continuation bytes.
pub fn utf8_complete(bytes: &[u8]) -> bool {
    for back in 1..=bytes.len().min(4) {
        let byte = bytes[bytes.len() - back];
        if byte & 0xC0 == 0x80 {
            continue; // a continuation byte: look further back for its lead
        }
        let needed = match byte {
            b if b & 0x80 == 0 => 1,
            b if b & 0xE0 == 0xC0 => 2,
            b if b & 0xF0 == 0xE0 => 3,
            b if b & 0xF8 == 0xF0 => 4,
            _ => return true, // not a lead byte: nothing is waiting
        };
        return back >= needed;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const START: u32 = 100;
    const END: u32 = 101;

    fn budget(tokens: u32) -> ReasoningBudget {
        ReasoningBudget {
            tokens,
            start: vec![START],
            ends: vec![vec![END], vec![7, 8]],
            forced: vec![50, END],
            prefill: Vec::new(),
        }
    }

    fn feed(tracker: &mut BudgetTracker, tokens: &[u32]) {
        for &t in tokens {
            tracker.accept(t, true);
        }
    }

    #[test]
    fn a_spent_budget_forces_the_end_token_by_token_then_passes_through() {
        let mut t = BudgetTracker::new(budget(3));
        feed(&mut t, &[1, 2]);
        assert_eq!(t.state(), BudgetState::Idle, "nothing counts before the start");
        feed(&mut t, &[START, 1, 2]);
        assert_eq!(t.state(), BudgetState::Counting { remaining: 1 });
        assert_eq!(t.forced(), None);
        feed(&mut t, &[3]);
        assert_eq!(t.forced(), Some(50));
        let mut logits = vec![1.0f32; 200];
        t.mask(&mut logits);
        assert!(logits.iter().enumerate().all(|(i, &l)| (i == 50) == l.is_finite()));
        feed(&mut t, &[50]);
        assert_eq!(t.forced(), Some(END));
        feed(&mut t, &[END]);
        assert_eq!(t.state(), BudgetState::Done);
        let mut logits = vec![1.0f32; 200];
        t.mask(&mut logits);
        assert!(logits.iter().all(|l| l.is_finite()), "done: nothing masked");
        // A new start counts again.
        feed(&mut t, &[START]);
        assert_eq!(t.state(), BudgetState::Counting { remaining: 3 });
    }

    #[test]
    fn a_prefill_that_opens_the_thinking_starts_the_count() {
        let t = BudgetTracker::new(ReasoningBudget {
            prefill: vec![9, START],
            ..budget(4)
        });
        assert_eq!(t.state(), BudgetState::Counting { remaining: 4 });
    }

    #[test]
    fn a_natural_end_stops_the_count_and_a_zero_budget_forces_at_once() {
        let mut t = BudgetTracker::new(budget(10));
        feed(&mut t, &[START, 1, 7, 8]);
        assert_eq!(t.state(), BudgetState::Done, "the two-token end sequence");
        let mut t = BudgetTracker::new(budget(0));
        feed(&mut t, &[START]);
        assert_eq!(t.forced(), Some(50));
    }

    #[test]
    fn a_character_split_across_tokens_completes_before_the_end_is_forced() {
        let mut t = BudgetTracker::new(budget(1));
        feed(&mut t, &[START]);
        t.accept(5, false);
        assert_eq!(t.state(), BudgetState::WaitingUtf8);
        t.accept(6, false);
        assert_eq!(t.state(), BudgetState::WaitingUtf8);
        t.accept(6, true);
        assert_eq!(t.forced(), Some(50));
    }

    #[test]
    fn utf8_completeness_looks_at_the_last_character_only() {
        assert!(utf8_complete(b"abc"));
        assert!(utf8_complete("é".as_bytes()));
        assert!(!utf8_complete(&"é".as_bytes()[..1]));
        assert!(!utf8_complete(&"€".as_bytes()[..2]));
        assert!(utf8_complete("a€".as_bytes()));
        assert!(!utf8_complete(&"a😀".as_bytes()[..4]));
        assert!(utf8_complete(b""));
    }
}

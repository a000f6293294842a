//! The recurrent states of one stage: for each of its recurrent layers (gated DeltaNet,
//! Mamba2) and each sequence, the convolution's last inputs and the recurrence's state
//! (the delta rule's or the selective scan's), in place of the keys and values an
//! attention layer caches.
//!
//! A state cannot be cut back to an earlier position the way a KV cache can, so each
//! sequence keeps the states of its last [`KEPT_STATES`] positions in a ring: a
//! rejected draft (at most `KEPT_STATES - 1` rows) rolls back to one of them, as
//! llama.cpp's `n_rs_seq` snapshots do. It also keeps [`CHECKPOINTS`] copies of its
//! states at positions the engine asks for (the ends of whole prompt chunks), which a
//! later request reusing that prefix starts from, as llama-server's context checkpoints
//! do. Cutting a sequence back anywhere else loses its state; it must then start again
//! from position 0.

use std::ops::Range;

use baton_ggml::{Buffer, BufferType, Context, DType, Tensor};

use crate::hparams::HParams;
use crate::ModelError;

/// Positions whose states each sequence keeps: its newest and the 8 before, so that a
/// draft of up to 8 tokens can be rejected (the engine drafts no more for these
/// models). Each kept state costs what the model's recurrent layers hold per sequence
/// (Qwen3.5-35B-A3B: 66 MB), so the ring is kept short.
pub const KEPT_STATES: usize = 9;

/// Checkpoints each sequence keeps (the newest the engine asked for).
pub const CHECKPOINTS: usize = 3;

/// Rows of each sequence: its ring, then its checkpoints.
const SLOT_ROWS: usize = KEPT_STATES + CHECKPOINTS;

/// Sequences a stage keeps states for when the configuration does not say
/// (`StageConfig::n_seq` 0).
const DEFAULT_SEQS: usize = 4;

/// Rows of each state tensor for `n_seq` sequences (0: the default): each sequence's
/// kept states and checkpoints, and the zero row.
pub fn state_rows(n_seq: usize) -> usize {
    let n_slots = if n_seq == 0 { DEFAULT_SEQS } else { n_seq };
    n_slots * SLOT_ROWS + 1
}

/// One sequence's share of the states: `SLOT_ROWS` rows of every state tensor.
#[derive(Clone, Debug, Default)]
struct Slot {
    /// The sequence holding it.
    seq: Option<u32>,
    /// Positions computed: the state the next token continues from (`None`: lost, the
    /// sequence must start again from position 0).
    len: Option<usize>,
    /// Which position count each ring row holds the state after (row `len % KEPT_STATES`).
    held: [Option<usize>; KEPT_STATES],
    /// The position count each checkpoint row holds the state after, in the order they
    /// were taken (the oldest is replaced first).
    checkpoints: Vec<(usize, usize)>,
    /// The checkpoint row the state after `len` is in, when the ring holds none (the
    /// sequence was cut back to a checkpoint).
    resume: Option<i32>,
}

/// The rows of a batch that continue one sequence's state, and where its states are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateRun {
    /// Consecutive rows of the batch, at consecutive positions.
    pub rows: Range<usize>,
    /// The sequence.
    pub seq: u32,
    /// The slot its states are in (a free one for a sequence that starts).
    pub slot: usize,
    /// Its position before the run.
    pub start: usize,
    /// Row of the state tensors the run starts from (the zero row for position 0).
    pub source: i32,
    /// Rows the states after the run's last tokens go to, newest first
    /// (`min(rows, KEPT_STATES)` of them).
    pub targets: Vec<i64>,
}

/// Recurrent states of a stage's recurrent layers, for a fixed number of sequences.
pub struct RecurrentCache {
    // Tensors `conv_l{layer}` `[conv floats, rows]` and `state_l{layer}`
    // `[state floats, rows]` live in `ctx`, their data in `buffer`. The last row is
    // zeros, never written: where every sequence starts.
    ctx: Context,
    buffer: Option<Buffer>,
    layers: Vec<usize>,
    slots: Vec<Slot>,
}

impl RecurrentCache {
    /// States of the recurrent layers among `layers` for `n_seq` sequences (0: a
    /// default of 4), in memory of `buft` (`None`: the CPU's). A model without
    /// recurrent layers gets an empty cache.
    pub fn new_in(
        hp: &HParams,
        layers: Range<usize>,
        n_seq: usize,
        buft: Option<BufferType>,
    ) -> Result<RecurrentCache, ModelError> {
        let recurrent: Vec<usize> = layers.filter(|&l| hp.is_recurrent(l)).collect();
        let n_slots = if n_seq == 0 { DEFAULT_SEQS } else { n_seq };
        let ctx = Context::new(2 * recurrent.len() + 2, 0);
        let buffer = match &hp.ssm {
            Some(ssm) if !recurrent.is_empty() => {
                let rows = state_rows(n_seq) as i64;
                for &layer in &recurrent {
                    ctx.new_tensor(DType::F32, &[ssm.conv_state_len() as i64, rows])
                        .named(&format!("conv_l{layer}"));
                    ctx.new_tensor(DType::F32, &[ssm.state_len() as i64, rows])
                        .named(&format!("state_l{layer}"));
                }
                let mut buffer = match buft {
                    Some(buft) => buft.alloc(&ctx)?,
                    None => Buffer::alloc_cpu(&ctx)?,
                };
                // The zero row every sequence starts from.
                buffer.clear(0);
                Some(buffer)
            }
            _ => None,
        };
        Ok(RecurrentCache {
            ctx,
            buffer,
            layers: recurrent,
            slots: vec![Slot::default(); n_slots],
        })
    }

    /// Whether the stage has recurrent layers.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Bytes of state memory.
    pub fn bytes(&self) -> usize {
        self.buffer.as_ref().map_or(0, Buffer::size)
    }

    /// Convolution states of recurrent layer `layer`.
    pub fn conv(&self, layer: usize) -> Tensor<'_> {
        self.tensor("conv", layer)
    }

    /// Delta-rule states of recurrent layer `layer`.
    pub fn state(&self, layer: usize) -> Tensor<'_> {
        self.tensor("state", layer)
    }

    fn tensor(&self, kind: &str, layer: usize) -> Tensor<'_> {
        assert!(
            self.layers.contains(&layer),
            "layer {layer} is not a recurrent layer of this stage"
        );
        self.ctx
            .get_tensor(&format!("{kind}_l{layer}"))
            .expect("state tensors are created for every recurrent layer")
    }

    fn zero_row(&self) -> i32 {
        (self.slots.len() * SLOT_ROWS) as i32
    }

    /// How the rows of a batch continue their sequences' states; changes nothing.
    /// Refuses a batch whose rows of one sequence are not consecutive rows at
    /// consecutive positions from where its state is, and more sequences than the
    /// cache holds.
    pub fn plan(&self, seq_ids: &[u32], positions: &[i32]) -> Result<Vec<StateRun>, ModelError> {
        if self.is_empty() {
            return Ok(Vec::new());
        }
        let bad = |why: String| Err(ModelError::BadBatch(why));
        let mut runs: Vec<StateRun> = Vec::new();
        let mut free = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.seq.is_none())
            .map(|(i, _)| i);
        let mut row = 0;
        while row < seq_ids.len() {
            let seq = seq_ids[row];
            let start = positions[row];
            let mut end = row + 1;
            while end < seq_ids.len() && seq_ids[end] == seq {
                if positions[end] != positions[end - 1] + 1 {
                    return bad(format!(
                        "sequence {seq} has positions {} then {} in one batch: a recurrent model's rows of a sequence are consecutive positions",
                        positions[end - 1],
                        positions[end]
                    ));
                }
                end += 1;
            }
            if runs.iter().any(|r| r.seq == seq) {
                return bad(format!(
                    "sequence {seq} has rows in two places of one batch: a recurrent model takes a sequence's rows together"
                ));
            }
            if start < 0 {
                return bad(format!("negative position {start}"));
            }
            let start = start as usize;
            let held = self.slots.iter().position(|s| s.seq == Some(seq));
            let (slot, source) = match held {
                Some(slot) if start == 0 => (slot, self.zero_row()),
                None if start == 0 => match free.next() {
                    Some(slot) => (slot, self.zero_row()),
                    None => {
                        return Err(ModelError::CacheFull {
                            need: 1,
                            free: 0,
                            capacity: self.slots.len(),
                        })
                    }
                },
                None => {
                    return bad(format!(
                        "sequence {seq} holds no recurrent state to continue at position {start}"
                    ))
                }
                Some(slot) => {
                    let s = &self.slots[slot];
                    match s.len {
                        Some(len) if len == start => (slot, s.resume.unwrap_or(Self::row(slot, start))),
                        Some(len) => {
                            return bad(format!(
                                "sequence {seq} is at position {len}, not {start}: its recurrent state continues only where it is"
                            ))
                        }
                        None => {
                            return bad(format!(
                                "sequence {seq}'s recurrent state at position {start} is gone (a recurrent layer keeps \
                                 only its last {KEPT_STATES} positions); start it again from position 0"
                            ))
                        }
                    }
                }
            };
            let n = end - row;
            let targets = (0..n.min(KEPT_STATES))
                .map(|j| Self::row(slot, start + n - j) as i64)
                .collect();
            runs.push(StateRun {
                rows: row..end,
                seq,
                slot,
                start,
                source,
                targets,
            });
            row = end;
        }
        Ok(runs)
    }

    /// The ring row of `slot` that holds the state after `len` positions.
    fn row(slot: usize, len: usize) -> i32 {
        (slot * SLOT_ROWS + len % KEPT_STATES) as i32
    }

    /// Checkpoint row `i` of `slot`.
    fn checkpoint_row(slot: usize, i: usize) -> i32 {
        (slot * SLOT_ROWS + KEPT_STATES + i) as i32
    }

    /// Records that `runs` (from [`RecurrentCache::plan`]) were computed.
    pub fn commit(&mut self, runs: &[StateRun]) {
        for run in runs {
            let s = &mut self.slots[run.slot];
            if run.start == 0 {
                *s = Slot {
                    seq: Some(run.seq),
                    ..Slot::default()
                };
            }
            let end = run.start + run.rows.len();
            for j in 0..run.targets.len() {
                let len = end - j;
                s.held[len % KEPT_STATES] = Some(len);
            }
            s.len = Some(end);
            s.resume = None;
        }
    }

    /// Records that computing `runs` failed: the rows they may have written hold
    /// nothing any more (and a sequence whose own state was among them lost it).
    pub fn fail(&mut self, runs: &[StateRun]) {
        for run in runs {
            let s = &mut self.slots[run.slot];
            if s.seq != Some(run.seq) {
                continue; // a slot the run would have taken: nothing of it was kept
            }
            for &target in &run.targets {
                let i = target as usize % SLOT_ROWS;
                if s.held[i].is_some() && s.held[i] == s.len {
                    s.len = None;
                }
                s.held[i] = None;
            }
        }
    }

    /// Keeps `seq`'s state after `len` positions: its own, one of the last
    /// [`KEPT_STATES`], or a checkpoint's; elsewhere the state is lost (and the sequence
    /// must start again from 0). Checkpoints past `len` are dropped (the tokens after it
    /// will be others). `len` 0 frees the sequence's slot.
    pub fn truncate_seq(&mut self, seq: u32, len: usize) {
        let Some(slot) = self.slots.iter().position(|s| s.seq == Some(seq)) else {
            return;
        };
        let s = &mut self.slots[slot];
        if len == 0 {
            *s = Slot::default();
            return;
        }
        if s.len.is_some_and(|now| now <= len) {
            return;
        }
        s.checkpoints.retain(|&(at, _)| at <= len);
        let checkpoint = s.checkpoints.iter().find(|&&(at, _)| at == len).map(|&(_, i)| i);
        if s.held[len % KEPT_STATES] == Some(len) {
            s.len = Some(len);
            s.resume = None;
            for held in &mut s.held {
                if held.is_some_and(|h| h > len) {
                    *held = None;
                }
            }
        } else if let Some(i) = checkpoint {
            s.len = Some(len);
            s.resume = Some(Self::checkpoint_row(slot, i));
            s.held = [None; KEPT_STATES];
        } else {
            s.len = None;
            s.resume = None;
        }
    }

    /// Copies `seq`'s states after `len` positions (where the sequence is, or a kept
    /// position) into one of its checkpoint rows, replacing its oldest checkpoint when
    /// it has [`CHECKPOINTS`]; a later [`RecurrentCache::truncate_seq`] to `len` returns
    /// there. Refused when no state after `len` is at hand.
    pub fn checkpoint_seq(&mut self, seq: u32, len: usize) -> Result<(), ModelError> {
        if self.is_empty() {
            return Ok(());
        }
        let Some(slot) = self.slots.iter().position(|s| s.seq == Some(seq)) else {
            return Err(ModelError::BadBatch(format!(
                "sequence {seq} holds no recurrent state to keep"
            )));
        };
        let s = &self.slots[slot];
        if s.checkpoints.iter().any(|&(at, _)| at == len) {
            return Ok(());
        }
        let source = match s.resume {
            Some(row) if s.len == Some(len) => row,
            _ if len > 0 && s.held[len % KEPT_STATES] == Some(len) => Self::row(slot, len),
            _ => {
                return Err(ModelError::BadBatch(format!(
                    "sequence {seq} has no recurrent state after {len} positions to keep"
                )))
            }
        };
        let i = if s.checkpoints.len() < CHECKPOINTS {
            (0..CHECKPOINTS)
                .find(|i| s.checkpoints.iter().all(|&(_, used)| used != *i))
                .expect("fewer checkpoints than rows")
        } else {
            s.checkpoints[0].1
        };
        let target = Self::checkpoint_row(slot, i);
        self.copy_row(source as usize, target as usize)?;
        let s = &mut self.slots[slot];
        s.checkpoints.retain(|&(_, used)| used != i);
        s.checkpoints.push((len, i));
        Ok(())
    }

    /// Copies row `from` of every state tensor to row `to`.
    fn copy_row(&self, from: usize, to: usize) -> Result<(), ModelError> {
        for &layer in &self.layers {
            for tensor in [self.conv(layer), self.state(layer)] {
                let row = tensor.nb()[1];
                let mut bytes = vec![0u8; row];
                tensor.read_bytes_at(from * row, &mut bytes)?;
                tensor.write_bytes_at(to * row, &bytes)?;
            }
        }
        Ok(())
    }

    /// Whether `seq`'s state after `len` positions is at hand (its own, a kept one or a
    /// checkpoint's; always, on a stage without recurrent layers).
    pub fn has_state(&self, seq: u32, len: usize) -> bool {
        len == 0
            || self.is_empty()
            || self.slots.iter().find(|s| s.seq == Some(seq)).is_some_and(|s| {
                s.len == Some(len)
                    || s.held[len % KEPT_STATES] == Some(len)
                    || s.checkpoints.iter().any(|&(at, _)| at == len)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache of one layer of 4-float states for 2 sequences.
    fn cache() -> RecurrentCache {
        let n_slots = 2;
        let ctx = Context::new(4, 0);
        let rows = (n_slots * SLOT_ROWS + 1) as i64;
        ctx.new_tensor(DType::F32, &[4, rows]).named("conv_l0");
        ctx.new_tensor(DType::F32, &[4, rows]).named("state_l0");
        let mut buffer = Buffer::alloc_cpu(&ctx).unwrap();
        buffer.clear(0);
        RecurrentCache {
            ctx,
            buffer: Some(buffer),
            layers: vec![0],
            slots: vec![Slot::default(); n_slots],
        }
    }

    fn row_of(rs: &RecurrentCache, row: usize) -> [f32; 4] {
        let mut bytes = [0u8; 16];
        rs.state(0).read_bytes_at(row * 16, &mut bytes).unwrap();
        std::array::from_fn(|i| f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()))
    }

    /// A checkpoint keeps a copy of the state after its position, which a sequence cut
    /// back there continues from, long after the ring moved on; the oldest of
    /// `CHECKPOINTS` goes first, and those past a cut go with it.
    #[test]
    fn checkpoints_are_where_a_cut_sequence_resumes() {
        let mut rs = cache();
        let step = |rs: &mut RecurrentCache, from: i32, n: i32, value: f32| {
            let runs = rs
                .plan(&vec![1; n as usize], &(from..from + n).collect::<Vec<_>>())
                .unwrap();
            // What the graph would write: the newest state into the newest target.
            let bytes: Vec<u8> = [value; 4].iter().flat_map(|v| v.to_le_bytes()).collect();
            rs.state(0)
                .write_bytes_at(runs[0].targets[0] as usize * 16, &bytes)
                .unwrap();
            rs.commit(&runs);
            runs[0].source
        };
        step(&mut rs, 0, 8, 8.0);
        rs.checkpoint_seq(1, 8).unwrap();
        step(&mut rs, 8, 8, 16.0);
        rs.checkpoint_seq(1, 16).unwrap();
        step(&mut rs, 16, 30, 46.0);
        let err = rs.checkpoint_seq(1, 20).unwrap_err().to_string();
        assert!(err.contains("no recurrent state after 20"), "{err}");
        // Back to 16, long out of the ring: its checkpoint.
        rs.truncate_seq(1, 16);
        assert!(rs.has_state(1, 16) && rs.has_state(1, 8));
        let source = step(&mut rs, 16, 4, 20.0);
        assert_eq!(row_of(&rs, source as usize), [16.0; 4]);
        // Back to 8 drops the checkpoint at 16.
        rs.truncate_seq(1, 8);
        assert!(!rs.has_state(1, 16));
        let source = step(&mut rs, 8, 8, 16.5);
        assert_eq!(row_of(&rs, source as usize), [8.0; 4]);
        for at in [16usize, 24, 32, 40] {
            if at > 16 {
                step(&mut rs, at as i32 - 8, 8, at as f32);
            }
            rs.checkpoint_seq(1, at).unwrap();
        }
        assert!(!rs.has_state(1, 8), "the oldest of 4 went");
        rs.truncate_seq(1, 24);
        let source = step(&mut rs, 24, 1, 25.0);
        assert_eq!(row_of(&rs, source as usize), [24.0; 4]);
    }

    #[test]
    fn runs_continue_states_and_drafts_roll_back() {
        let mut rs = cache();
        let zero = rs.zero_row();
        let runs = rs.plan(&[5, 5, 5, 9], &[0, 1, 2, 0]).unwrap();
        assert_eq!(runs.len(), 2);
        assert_eq!((runs[0].rows.clone(), runs[0].source), (0..3, zero));
        assert_eq!(runs[0].targets, vec![3, 2, 1]);
        assert_eq!(
            (runs[1].rows.clone(), runs[1].targets.clone()),
            (3..4, vec![SLOT_ROWS as i64 + 1])
        );
        rs.commit(&runs);
        // A draft of 4 rows, then 2 rejected: back to the state after position 4.
        let runs = rs.plan(&[5; 4], &[3, 4, 5, 6]).unwrap();
        assert_eq!(runs[0].source, 3);
        rs.commit(&runs);
        rs.truncate_seq(5, 5);
        assert!(rs.has_state(5, 5) && !rs.has_state(5, 6));
        assert_eq!(rs.plan(&[5], &[5]).unwrap()[0].source, 5);
        let err = rs.plan(&[5], &[6]).unwrap_err().to_string();
        assert!(err.contains("is at position 5, not 6"), "{err}");
        // Too far back: lost, until the sequence starts again.
        let long: Vec<i32> = (5..40).collect();
        rs.commit(&rs.plan(&[5; 35], &long).unwrap());
        rs.truncate_seq(5, 10);
        let err = rs.plan(&[5], &[10]).unwrap_err().to_string();
        assert!(err.contains("is gone"), "{err}");
        assert_eq!(rs.plan(&[5], &[0]).unwrap()[0].source, zero);
        // A third sequence finds no slot; one that ends frees its own.
        let full = rs.plan(&[7], &[0]).unwrap_err();
        assert!(matches!(full, ModelError::CacheFull { .. }), "{full}");
        rs.truncate_seq(9, 0);
        assert!(rs.plan(&[7], &[0]).is_ok());
    }

    #[test]
    fn batches_a_recurrent_model_cannot_take_are_refused() {
        let rs = cache();
        let err = rs.plan(&[1, 1], &[0, 2]).unwrap_err().to_string();
        assert!(err.contains("consecutive positions"), "{err}");
        let err = rs.plan(&[1, 2, 1], &[0, 0, 1]).unwrap_err().to_string();
        assert!(err.contains("two places"), "{err}");
        let err = rs.plan(&[1], &[3]).unwrap_err().to_string();
        assert!(err.contains("holds no recurrent state"), "{err}");
    }

    #[test]
    fn a_failed_step_forgets_what_it_may_have_written() {
        let mut rs = cache();
        rs.commit(&rs.plan(&[1; 20], &(0..20).collect::<Vec<_>>()).unwrap());
        // 17 rows from 20 write the ring rows of the last KEPT_STATES positions up to
        // 37, among them (37 - 20 = 17 ≡ 20 modulo 9) the row that holds 20's state.
        let runs = rs.plan(&[1; 17], &(20..37).collect::<Vec<_>>()).unwrap();
        rs.fail(&runs);
        assert!(!rs.has_state(1, 20));
        let err = rs.plan(&[1], &[20]).unwrap_err().to_string();
        assert!(err.contains("is gone"), "{err}");
    }
}

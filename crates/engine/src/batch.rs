//! Which work goes into the next micro-batch: a pure function of the slots, tested with
//! tables.

use baton_proto::{Forward, Payload};

use super::slots::{Active, Slot};

/// How micro-batches are cut.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BatchRules {
    /// Most prompt tokens per micro-batch.
    pub chunk: usize,
    /// Stages in the ring: decoding sequences are split into this many groups, so each
    /// stage has a group to work on.
    pub n_stages: usize,
    /// Most decoding sequences per micro-batch ([`super::MAX_DECODE_SEQS`]).
    pub max_decode_seqs: usize,
}

/// A sequence in a micro-batch: its slot, the request's epoch, whether its last row
/// is sampled, and how many drafted tokens follow its token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Member {
    pub seq: usize,
    pub epoch: u64,
    pub sampled: bool,
    pub drafted: usize,
}

/// Builds the next micro-batch (step number `step`) from the slots and marks what it
/// takes as sent; `None` when nothing is ready. A micro-batch is either the next token
/// of some decoding sequences or one chunk of one prompt, alternating when both wait
/// (`last_decoded` remembers which went last): mixed into one batch, a sequence's rows
/// would meet kernels that round differently from those it meets alone, and a request
/// would generate differently in company. Chunks start where the prompt's last chunk
/// ended, so a prompt is cut the same way whatever else runs; a sequence being rebuilt
/// repeats its earlier sends exactly. A decoding sequence's token may be followed by
/// tokens `draft(slot, sequence)` guesses; every row of a decode batch is sampled, and
/// the batch then carries its row tokens for the last stage to check the drafts.
pub(crate) fn next_batch(
    slots: &mut [Slot],
    rules: BatchRules,
    last_decoded: &mut bool,
    step: u64,
    draft: &mut dyn FnMut(usize, &Active) -> Vec<u32>,
) -> Option<(Forward, Vec<Member>)> {
    let n_decoding = slots
        .iter()
        .filter_map(|s| s.active.as_ref())
        .filter(|a| a.decoding())
        .count();
    let group = n_decoding
        .div_ceil(rules.n_stages.max(1))
        .clamp(1, rules.max_decode_seqs.max(1));

    let chunk = rules.chunk.max(1);
    let next = |i: usize| slots[i].active.as_ref().and_then(|a| a.next_send(chunk));
    let mut decoding: Vec<usize> = (0..slots.len())
        .filter(|&i| matches!(next(i), Some((_, false))))
        .collect();
    decoding.sort_by_key(|&i| slots[i].active.as_ref().map_or(0, |a| a.last_batch));
    decoding.truncate(group);
    // The oldest request's prompt goes first.
    let prefilling = (0..slots.len())
        .filter_map(|i| match next(i) {
            Some((n, true)) => Some((slots[i].active.as_ref()?.epoch, i, n)),
            _ => None,
        })
        .min();

    let work: Vec<(usize, usize)> = match prefilling {
        Some((_, seq, n)) if decoding.is_empty() || *last_decoded => {
            *last_decoded = false;
            vec![(seq, n)]
        }
        _ if !decoding.is_empty() => {
            *last_decoded = true;
            decoding.iter().map(|&seq| (seq, 1)).collect()
        }
        _ => return None,
    };
    let (mut tokens, mut positions, mut seq_ids, mut sample_rows) = (vec![], vec![], vec![], vec![]);
    let mut members = Vec::new();
    for (seq, n) in work {
        let drafted = {
            let active = slots[seq].active.as_ref().expect("chosen slots are active");
            // Only a fresh decode row (not a repeated one) may carry a draft.
            let fresh_decode = n == 1
                && active.replay.is_empty()
                && active.n_sent >= active.n_prompt
                && active.n_sent + 1 == active.tokens.len();
            if fresh_decode {
                draft(seq, active)
            } else {
                Vec::new()
            }
        };
        let active = slots[seq].active.as_mut().expect("chosen slots are active");
        let start = active.n_sent;
        tokens.extend_from_slice(&active.tokens[start..start + n]);
        tokens.extend_from_slice(&drafted);
        let rows = n + drafted.len();
        positions.extend((start..start + rows).map(|p| p as i32));
        seq_ids.extend(std::iter::repeat_n(seq as u32, rows));
        active.n_sent += n;
        active.runs.push(n as u32);
        active.replay.pop_front();
        active.last_batch = step + 1;
        let sampled = active.n_sent == active.tokens.len();
        if sampled {
            active.waiting = true;
            let first = tokens.len() - drafted.len() - 1;
            sample_rows.extend((first..tokens.len()).map(|r| r as u32));
        }
        members.push(Member {
            seq,
            epoch: active.epoch,
            sampled,
            drafted: drafted.len(),
        });
    }
    let row_tokens = if members.iter().any(|m| m.drafted > 0) {
        tokens.clone()
    } else {
        Vec::new()
    };
    let forward = Forward {
        step,
        payload: Payload::Tokens(tokens),
        positions,
        seq_ids,
        sample_rows,
        row_tokens,
    };
    Some((forward, members))
}

#[cfg(test)]
mod tests {
    use super::super::types::Job;
    use super::*;

    /// A slot running a request for `prompt`, `n_reused` of it cached in runs of `chunk`.
    fn running(prompt: &[u32], epoch: u64, n_reused: usize, chunk: usize) -> Slot {
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt: prompt.to_vec(),
            params: baton_sample::SamplingParams::greedy(),
            max_tokens: 100,
            logprobs: false,
            top_logprobs: 0,
            stop: Vec::new(),
            draft: crate::draft::Draft::OFF,
            grammar: None,
            budget: None,
            show: Vec::new(),
            end: None,
            pooling: None,
            events,
        };
        let runs = vec![chunk as u32; n_reused / chunk];
        let mut slot = Slot::empty();
        slot.active = Some(Active::new(Box::new(job), epoch, n_reused, runs, 0.5));
        slot
    }

    /// A slot decoding: its prompt sent, its last token sampled and appended.
    fn decoding(epoch: u64) -> Slot {
        let mut slot = running(&[1, 2, 3], epoch, 0, 8);
        let active = slot.active.as_mut().unwrap();
        active.n_sent = 3;
        active.runs = vec![3];
        active.tokens.push(4);
        slot
    }

    fn rules(chunk: usize, n_stages: usize, max_decode_seqs: usize) -> BatchRules {
        BatchRules {
            chunk,
            n_stages,
            max_decode_seqs,
        }
    }

    /// Runs `next_batch` until nothing is ready (sampled rows stay unanswered); returns
    /// each batch as (seq ids, positions, sampled rows).
    fn drain(slots: &mut [Slot], rules: BatchRules) -> Vec<(Vec<u32>, Vec<i32>, Vec<u32>)> {
        let mut last_decoded = false;
        let mut out = Vec::new();
        for step in 0..100 {
            let Some((forward, members)) = next_batch(slots, rules, &mut last_decoded, step, &mut |_, _| Vec::new())
            else {
                break;
            };
            assert_eq!(members.iter().filter(|m| m.sampled).count(), forward.sample_rows.len());
            out.push((forward.seq_ids, forward.positions, forward.sample_rows));
        }
        out
    }

    #[test]
    fn decode_rows_are_capped_and_shared_among_stages() {
        // (decoding slots, stages, row cap) -> rows per batch
        let cases: [(usize, usize, usize, &[usize]); 5] = [
            (10, 1, 7, &[7, 3]),
            (10, 1, 3, &[3, 3, 3, 1]),
            (6, 2, 7, &[3, 3]),
            (5, 3, 3, &[2, 2, 1]),
            (1, 4, 3, &[1]),
        ];
        for (n, stages, cap, want) in cases {
            let mut slots: Vec<Slot> = (0..n as u64).map(decoding).collect();
            let rows: Vec<usize> = drain(&mut slots, rules(8, stages, cap))
                .iter()
                .map(|(seqs, _, _)| seqs.len())
                .collect();
            assert_eq!(rows, want, "{n} decoding, {stages} stages, cap {cap}");
        }
    }

    #[test]
    fn prompt_chunks_go_alone_and_alternate_with_decode_rows() {
        let prompt: Vec<u32> = (0..20).collect();
        let mut slots = vec![decoding(1), running(&prompt, 2, 0, 8), decoding(3)];
        let mut last_decoded = false;
        let mut shape = Vec::new();
        for step in 0..6 {
            let (forward, members) = next_batch(&mut slots, rules(8, 1, 7), &mut last_decoded, step, &mut |_, _| {
                Vec::new()
            })
            .unwrap();
            shape.push((forward.seq_ids, forward.sample_rows));
            // Every sampled row is answered before the next batch.
            for member in members.iter().filter(|m| m.sampled) {
                let active = slots[member.seq].active.as_mut().unwrap();
                active.waiting = false;
                active.tokens.push(7);
            }
        }
        assert_eq!(
            shape,
            vec![
                (vec![0, 2], vec![0, 1]), // decode rows
                (vec![1; 8], vec![]),     // a chunk of the prompt, alone
                (vec![0, 2], vec![0, 1]), // decode rows again
                (vec![1; 8], vec![]),     // the next chunk
                (vec![0, 2], vec![0, 1]),
                (vec![1; 4], vec![3]), // the last chunk, sampled
            ]
        );
        assert_eq!(slots[1].active.as_ref().unwrap().runs, vec![8, 8, 4]);
    }

    #[test]
    fn a_request_with_a_cached_prefix_is_cut_as_a_fresh_one() {
        let prompt: Vec<u32> = (0..40).collect();
        let mut fresh = vec![running(&prompt, 1, 0, 16)];
        let mut cached = vec![running(&prompt, 1, 32, 16)];
        let fresh = drain(&mut fresh, rules(16, 1, 3));
        let cached = drain(&mut cached, rules(16, 1, 3));
        assert_eq!(fresh.len(), 3);
        assert_eq!(
            cached,
            fresh[2..],
            "the cached request computes the fresh run's last chunk"
        );
    }

    #[test]
    fn a_rebuilt_sequence_repeats_its_sends_exactly() {
        let prompt: Vec<u32> = (0..20).collect();
        let mut slots = vec![running(&prompt, 1, 0, 8)];
        let first = drain(&mut slots, rules(8, 1, 3));
        // Answered: the sequence generates three tokens, one step each.
        let active = slots[0].active.as_mut().unwrap();
        for token in [100, 101, 102] {
            active.waiting = false;
            active.tokens.push(token);
        }
        let mut decoded = Vec::new();
        for step in 0..3 {
            let mut last = false;
            let (forward, _) = next_batch(&mut slots, rules(8, 1, 3), &mut last, step, &mut |_, _| Vec::new()).unwrap();
            decoded.push((forward.seq_ids, forward.positions, forward.sample_rows));
            slots[0].active.as_mut().unwrap().waiting = false;
        }
        assert_eq!(slots[0].active.as_ref().unwrap().runs, vec![8, 8, 4, 1, 1, 1]);

        // The ring is lost: everything is sent again in the same batches.
        let repeated = slots[0].active.as_mut().unwrap().restart();
        assert_eq!(repeated, 23);
        let again = drain(&mut slots, rules(8, 1, 3));
        let mut before = first;
        before.extend(decoded);
        // The last replayed row is sampled again (the new ring must give the next token).
        let last = before.len() - 1;
        before[last].2 = vec![0];
        for batch in &mut before[..last] {
            batch.2.clear();
        }
        assert_eq!(again, before);
    }

    #[test]
    fn nothing_is_ready_while_every_sequence_waits_for_its_token() {
        let mut slots = vec![decoding(1), decoding(2), Slot::empty()];
        assert_eq!(drain(&mut slots, rules(8, 1, 7)).len(), 1);
        assert!(drain(&mut slots, rules(8, 1, 7)).is_empty());
    }
}

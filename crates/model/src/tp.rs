//! Tensor parallelism: the members of a group each hold a slice of every layer of a
//! stage and exchange their slices of the activations four times per layer.
//!
//! Every weight is cut by rows (output features), never along its input dimension, so
//! every dot product a member computes is the one llama.cpp computes, over the whole
//! row, in the same order, and the group's logits are bit-identical to llama.cpp's:
//! - attention by key/value heads (with their query heads, so the GQA ratio holds):
//!   rows of `attn_q`, `attn_k`, `attn_v` and their biases; each member caches the keys
//!   and values of its own heads. With MLA (deepseek2) every head reads one compressed
//!   row per token: every member computes and caches that row whole, and splits the
//!   query heads (rows of the query projection, each head's `k_b` and `v_b`). The heads' outputs are gathered (all-gather), then
//!   each member computes its share of `attn_output`'s rows (of `n_embd`), gathered
//!   again.
//! - the FFN: rows of `ffn_gate` and `ffn_up` (a share of the inner dimension); the
//!   activations are gathered, each member computes its share of `ffn_down`'s rows, and
//!   those are gathered.
//! - routed experts (mixture-of-experts layers): every member holds a share of every
//!   expert's FFN, cut exactly as the dense FFN is (rows of each expert's `gate` and
//!   `up`, rows of each expert's `down`); the router is whole on every member, so all
//!   choose the same experts; the chosen experts' activations are gathered, each member
//!   computes its rows of their outputs and sums them with the router's weights
//!   (element-wise, as llama.cpp sums them), and those rows are gathered. Shared
//!   experts are a dense FFN of their own width, cut the same way.
//! - the output projection by vocabulary rows: each member computes the logits of its
//!   share of the vocabulary, gathered by the group's first member.
//!
//! Megatron-LM's form (cut `attn_output` and `ffn_down` along their input dimension and
//! sum the partial products: one all-reduce after attention and one after the FFN)
//! needs half the exchanges, but the partial sums round differently from one dot
//! product: measured on qwen2 0.5B, logits NMSE 1.2e-4 to 1.6e-4 against llama.cpp (the
//! size of llama.cpp's own change from chunking a prompt), and greedy text that leaves
//! llama.cpp's after two tokens on one test prompt. Bit-identical logits cost two more
//! exchanges per layer, which in one process cost microseconds; over links see
//! docs/tensor-parallel.md. Row slices of a quantized matrix are contiguous bytes of the
//! file, so no slice ever falls inside a quantization block.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::hparams::HParams;
use crate::ModelError;

/// Architectures whose layers baton can split: llama-style attention with a dense FFN
/// or routed experts (`llama` covers Mixtral; glm4moe has shared experts and dense
/// leading layers; gpt-oss has expert biases and attention sinks), deepseek2 (MLA),
/// gemma2/gemma3 (norms after attention and after the FFN), and phi3 (fused
/// projections).
pub const TP_ARCHITECTURES: &[&str] = &[
    "llama",
    "mistral3",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "glm4moe",
    "gpt-oss",
    "deepseek2",
    "gemma2",
    "gemma3",
    "phi3",
];

/// Rows of a matrix a member gets are a multiple of this where they can be (ggml repacks
/// matrices whose row count is a multiple of 8 or 16 into its faster CPU layouts).
const ROW_UNIT: usize = 16;

/// What one member of a tensor-parallel group holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpSplit {
    /// Index of the member in the group (0 drives the others and gathers the logits).
    pub rank: usize,
    /// Members in the group.
    pub size: usize,
    /// Its key/value heads (possibly none when the group has more members than the
    /// model has key/value heads: that member then only computes FFN and logits; all of
    /// them with MLA, whose one compressed row every head reads).
    pub kv_heads: Range<usize>,
    /// Its query heads: those that read its key/value heads (a share of all with MLA).
    pub q_heads: Range<usize>,
    /// Its share of the FFN's inner dimension (rows of `ffn_gate`, `ffn_up`).
    pub ff: Range<usize>,
    /// Its share of each routed expert's inner dimension (rows of every expert's
    /// `ffn_gate_exps`, `ffn_up_exps`); empty for a dense model.
    pub ff_exp: Range<usize>,
    /// Its share of the shared experts' inner dimension (rows of `ffn_gate_shexp`,
    /// `ffn_up_shexp`); empty without shared experts.
    pub ff_shexp: Range<usize>,
    /// Its share of the hidden size (rows of `attn_output`, `ffn_down`).
    pub embd: Range<usize>,
    /// Its rows of the output projection.
    pub vocab: Range<usize>,
}

/// `[rank * n / size, (rank + 1) * n / size)` in units of `unit` (the last member takes
/// what does not divide).
fn share(n: usize, unit: usize, rank: usize, size: usize) -> Range<usize> {
    let units = n / unit;
    let at = |r: usize| if r == size { n } else { r * units / size * unit };
    at(rank)..at(rank + 1)
}

impl TpSplit {
    /// Member `rank` of `size` for a model of `hp`.
    pub fn new(hp: &HParams, rank: usize, size: usize) -> Result<TpSplit, ModelError> {
        if size == 0 || rank >= size {
            return Err(ModelError::BadConfig(format!("member {rank} of a group of {size}")));
        }
        if !TP_ARCHITECTURES.contains(&hp.arch.name) {
            return Err(ModelError::BadConfig(format!(
                "tensor parallelism splits {} layers; {} is not one",
                TP_ARCHITECTURES.join("/"),
                hp.arch.name
            )));
        }
        let unit = |n: usize| if n / ROW_UNIT >= size { ROW_UNIT } else { 1 };
        let shexp = hp.moe.n_ff_exp * hp.moe.n_expert_shared;
        let experts_too_narrow = hp.moe.n_expert > 0 && hp.moe.n_ff_exp < size || shexp > 0 && shexp < size;
        if hp.n_ff < size || hp.n_embd < size || experts_too_narrow {
            return Err(ModelError::BadConfig(format!(
                "a model of hidden size {} and FFN {} cannot be split {size} ways",
                hp.n_embd, hp.n_ff
            )));
        }
        let (kv_heads, q_heads) = if hp.mla.is_some() {
            // Query heads two at a time (or none): a decode step's view of one head's
            // query is contiguous where several heads' are not, and ggml then multiplies
            // it by `k_b` with another kernel, which rounds differently (measured: NMSE
            // 6.7e-6 on a member with one head of four).
            (0..hp.n_head_kv, share(hp.n_head, hp.n_head.min(2), rank, size))
        } else {
            let kv = share(hp.n_head_kv, 1, rank, size);
            let group = hp.n_head / hp.n_head_kv.max(1);
            (kv.clone(), kv.start * group..kv.end * group)
        };
        Ok(TpSplit {
            rank,
            size,
            kv_heads,
            q_heads,
            ff: share(hp.n_ff, unit(hp.n_ff), rank, size),
            ff_exp: share(hp.moe.n_ff_exp, unit(hp.moe.n_ff_exp), rank, size),
            ff_shexp: share(shexp, unit(shexp), rank, size),
            embd: share(hp.n_embd, unit(hp.n_embd), rank, size),
            vocab: share(hp.n_vocab, unit(hp.n_vocab), rank, size),
        })
    }

    /// Values per row its heads put out before the output projection (the input of
    /// `attn_output` it holds).
    pub fn heads_width(&self, hp: &HParams) -> usize {
        self.q_heads.len() * hp.mla.as_ref().map_or(hp.head_dim_v, |mla| mla.head_dim_v)
    }

    /// The hyper-parameters the member's graph is built with: its heads and FFN width.
    pub fn hparams(&self, hp: &HParams) -> HParams {
        let mut sliced = hp.clone();
        sliced.n_head = self.q_heads.len();
        sliced.n_head_kv = self.kv_heads.len();
        sliced.n_ff = self.ff.len();
        sliced.moe.n_ff_exp = self.ff_exp.len();
        sliced
    }

    /// How the member slices the stage tensor `name` (`blk.3.attn_q.weight`,
    /// `output.weight`) of shape `dims`.
    pub fn cut(&self, hp: &HParams, name: &str, dims: &[i64]) -> Result<Cut, ModelError> {
        let short = match name.strip_prefix("blk.") {
            Some(rest) => rest.split_once('.').map_or(rest, |(_, short)| short),
            None => {
                return Ok(match name {
                    "output.weight" => Cut::Rows(self.vocab.clone()),
                    _ => Cut::Whole,
                })
            }
        };
        let attention_in =
            short.starts_with("attn_") && !short.starts_with("attn_output") && short != "attn_norm.weight";
        if self.q_heads.is_empty() && attention_in {
            return Ok(Cut::Skip);
        }
        let q = self.q_heads.clone();
        let (d_k, d_v) = (hp.head_dim_k, hp.head_dim_v);
        // A query head's rows: MLA's heads are wider than the cached row they read.
        let d_q = hp.mla.as_ref().map_or(d_k, |mla| mla.head_dim_k);
        let heads = |r: &Range<usize>, d: usize| r.start * d..r.end * d;
        let shifted = |r: Range<usize>, by: usize| r.start + by..r.end + by;
        // phi3's fused projections: `[q | k | v]` rows, and `[gate | up]` rows.
        let (n_q, n_k) = (hp.n_head * d_k, hp.n_head_kv * d_k);
        let fused_up = dims.get(1).is_some_and(|&rows| rows as usize == 2 * hp.n_ff);
        Ok(match short {
            "attn_qkv.weight" | "attn_qkv.bias" => Cut::RowRanges(vec![
                heads(&q, d_k),
                shifted(heads(&self.kv_heads, d_k), n_q),
                shifted(heads(&self.kv_heads, d_v), n_q + n_k),
            ]),
            "ffn_up.weight" if fused_up => Cut::RowRanges(vec![self.ff.clone(), shifted(self.ff.clone(), hp.n_ff)]),
            "ffn_gate_up_exps.weight" => {
                Cut::RowRanges(vec![self.ff_exp.clone(), shifted(self.ff_exp.clone(), hp.moe.n_ff_exp)])
            }
            // MLA: the compressed row whole; each query head's matrices.
            "attn_q_a.weight" | "attn_q_a_norm.weight" | "attn_kv_a_mqa.weight" | "attn_kv_a_norm.weight" => Cut::Whole,
            "attn_q_b.weight" => Cut::Rows(heads(&q, d_q)),
            "attn_k_b.weight" | "attn_v_b.weight" => Cut::Matrices(q.clone()),
            "attn_norm.weight"
            | "ffn_norm.weight"
            | "attn_q_norm.weight"
            | "attn_k_norm.weight"
            | "post_attention_norm.weight"
            | "post_ffw_norm.weight"
            | "ffn_gate_inp.weight"
            | "ffn_gate_inp.bias"
            | "exp_probs_b.bias" => Cut::Whole,
            // One value per query head.
            "attn_sinks.weight" => Cut::Rows(q.clone()),
            // Every expert's bias, `[n, n_expert]`: the elements of its rows.
            "ffn_gate_exps.bias" | "ffn_up_exps.bias" => Cut::Columns(self.ff_exp.clone()),
            "ffn_down_exps.bias" => Cut::Columns(self.embd.clone()),
            // Every expert's matrix by rows, as the dense FFN's.
            "ffn_gate_exps.weight" | "ffn_up_exps.weight" => Cut::Rows(self.ff_exp.clone()),
            "ffn_down_exps.weight" => Cut::Rows(self.embd.clone()),
            "ffn_gate_shexp.weight" | "ffn_up_shexp.weight" | "ffn_gate_shexp.bias" | "ffn_up_shexp.bias" => {
                Cut::Rows(self.ff_shexp.clone())
            }
            "ffn_down_shexp.weight" | "ffn_down_shexp.bias" => Cut::Rows(self.embd.clone()),
            "attn_q.weight" | "attn_q.bias" => Cut::Rows(heads(&q, d_q)),
            "attn_k.weight" | "attn_k.bias" => Cut::Rows(heads(&self.kv_heads, d_k)),
            "attn_v.weight" | "attn_v.bias" => Cut::Rows(heads(&self.kv_heads, d_v)),
            "ffn_gate.weight" | "ffn_up.weight" | "ffn_gate.bias" | "ffn_up.bias" => Cut::Rows(self.ff.clone()),
            "attn_output.weight" | "attn_output.bias" | "ffn_down.weight" | "ffn_down.bias" => {
                Cut::Rows(self.embd.clone())
            }
            _ => {
                return Err(ModelError::BadConfig(format!(
                    "tensor parallelism does not know how to split '{name}'"
                )))
            }
        })
    }
}

/// How one member holds one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cut {
    /// All of it.
    Whole,
    /// Rows (the second dimension: of a matrix, of each expert's matrix; elements of a
    /// vector).
    Rows(Range<usize>),
    /// Several ranges of rows, joined in order (fused projections).
    RowRanges(Vec<Range<usize>>),
    /// Whole matrices of a 3-d tensor (one per head: MLA's `k_b`, `v_b`).
    Matrices(Range<usize>),
    /// Elements of every row of an f32 matrix (one bias per expert: the same elements
    /// of each).
    Columns(Range<usize>),
    /// None of it (attention weights of a member without heads).
    Skip,
}

/// Why a collective failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum CollectiveError {
    /// Another member failed or left; the group cannot go on.
    #[error("tensor-parallel group aborted: {0}")]
    Aborted(String),
    /// A member sent something that is not a partial sum of this step.
    #[error("tensor-parallel peer {peer}: {reason}")]
    Peer { peer: usize, reason: String },
}

/// The exchange a tensor-parallel group needs four times per layer.
pub trait Collective: Send + Sync {
    /// Every member's slice of `rows` rows, joined: member `r` gives `mine` (`rows` rows
    /// of `widths[r]` values), and `out` (`rows` rows of `Σ widths`) gets row by row the
    /// members' rows in rank order. Every member calls it with the same `widths`.
    fn all_gather(&self, mine: &[f32], widths: &[usize], rows: usize, out: &mut [f32]) -> Result<(), CollectiveError>;

    /// Tells the other members this one will not take part any more (so none waits
    /// forever on it).
    fn abort(&self, reason: &str);
}

/// A group of threads in one process exchanging through shared memory.
pub struct LocalGroup {
    size: usize,
    slots: Vec<Mutex<Vec<f32>>>,
    /// Members arrived at the current barrier, and the barrier's generation.
    state: Mutex<(usize, usize)>,
    wake: Condvar,
    /// The generation, readable without the lock (for spinning).
    generation: AtomicUsize,
    aborted: AtomicBool,
    reason: Mutex<String>,
}

/// One member's handle on a [`LocalGroup`].
pub struct LocalMember {
    group: Arc<LocalGroup>,
    rank: usize,
}

impl LocalGroup {
    /// `size` members' handles, by rank.
    pub fn members(size: usize) -> Vec<Arc<dyn Collective>> {
        let group = Arc::new(LocalGroup {
            size,
            slots: (0..size).map(|_| Mutex::new(Vec::new())).collect(),
            state: Mutex::new((0, 0)),
            wake: Condvar::new(),
            generation: AtomicUsize::new(0),
            aborted: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
        });
        (0..size)
            .map(|rank| {
                Arc::new(LocalMember {
                    group: group.clone(),
                    rank,
                }) as Arc<dyn Collective>
            })
            .collect()
    }

    /// Waits until every member arrived. Spins for a few microseconds first (the
    /// members reach each exchange close together, and waking a sleeping thread takes
    /// about as long), then sleeps: a spinning or yielding thread on a busy machine
    /// loses whole scheduler slices (measured: 12 tok/s instead of 40).
    fn barrier(&self) -> Result<(), CollectiveError> {
        fn poisoned<T>(_: T) -> CollectiveError {
            CollectiveError::Aborted("a member panicked".into())
        }
        let mut state = self.state.lock().map_err(poisoned)?;
        let generation = state.1;
        state.0 += 1;
        if state.0 == self.size {
            *state = (0, generation + 1);
            self.generation.store(generation + 1, Ordering::Release);
            self.wake.notify_all();
            return Ok(());
        }
        drop(state);
        let started = Instant::now();
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == generation {
            spins += 1;
            if spins.is_multiple_of(64) && started.elapsed() > SPIN {
                break;
            }
            std::hint::spin_loop();
        }
        let mut state = self.state.lock().map_err(poisoned)?;
        while state.1 == generation {
            if self.aborted.load(Ordering::Acquire) {
                let reason = self.reason.lock().map(|r| r.clone()).unwrap_or_default();
                return Err(CollectiveError::Aborted(reason));
            }
            state = self
                .wake
                .wait_timeout(state, Duration::from_millis(50))
                .map_err(poisoned)?
                .0;
        }
        Ok(())
    }
}

/// How long a member spins at a barrier before it sleeps.
const SPIN: Duration = Duration::from_micros(20);

impl Collective for LocalMember {
    fn all_gather(&self, mine: &[f32], widths: &[usize], rows: usize, out: &mut [f32]) -> Result<(), CollectiveError> {
        let group = &*self.group;
        {
            let mut slot = group.slots[self.rank]
                .lock()
                .expect("a slot's lock is never held across a panic");
            slot.clear();
            slot.extend_from_slice(mine);
        }
        if group.size > 1 {
            group.barrier()?;
        }
        let slots: Vec<_> = group
            .slots
            .iter()
            .map(|s| s.lock().expect("a slot's lock is never held across a panic"))
            .collect();
        let result = join_rows(slots.iter().map(|s| s.as_slice()), widths, rows, out);
        drop(slots);
        result?;
        // Nobody refills a slot before everyone has read them all.
        if group.size > 1 {
            group.barrier()?;
        }
        Ok(())
    }

    fn abort(&self, reason: &str) {
        if let Ok(mut r) = self.group.reason.lock() {
            *r = format!("member {}: {reason}", self.rank);
        }
        self.group.aborted.store(true, Ordering::Release);
        self.group.wake.notify_all();
    }
}

/// Joins the members' slices (`parts`, in rank order) row by row into `out`: row `t`
/// of `out` is row `t` of each part in turn. Shared by every [`Collective`].
pub fn join_rows<'a>(
    parts: impl Iterator<Item = &'a [f32]>,
    widths: &[usize],
    rows: usize,
    out: &mut [f32],
) -> Result<(), CollectiveError> {
    let total: usize = widths.iter().sum();
    if out.len() != total * rows {
        return Err(CollectiveError::Aborted(format!(
            "{} values to fill, expected {rows} rows of {total}",
            out.len()
        )));
    }
    let mut at = 0;
    for (rank, (part, &width)) in parts.zip(widths).enumerate() {
        if part.len() != width * rows {
            return Err(CollectiveError::Peer {
                peer: rank,
                reason: format!("{} values, expected {rows} rows of {width}", part.len()),
            });
        }
        for row in 0..rows {
            out[row * total + at..row * total + at + width].copy_from_slice(&part[row * width..(row + 1) * width]);
        }
        at += width;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_everything_in_units() {
        // (n, unit, size) -> ranges
        let table: &[(usize, usize, usize, &[Range<usize>])] = &[
            (4864, 256, 2, &[0..2304, 2304..4864]),
            (4864, 256, 3, &[0..1536, 1536..3072, 3072..4864]),
            (2, 1, 3, &[0..0, 0..1, 1..2]),
            (14, 1, 2, &[0..7, 7..14]),
            (151936, 16, 3, &[0..50640, 50640..101280, 101280..151936]),
        ];
        for (n, unit, size, expected) in table {
            let got: Vec<_> = (0..*size).map(|r| share(*n, *unit, r, *size)).collect();
            assert_eq!(&got, expected, "n {n} unit {unit} size {size}");
        }
    }

    #[test]
    fn local_group_gathers_rows_in_rank_order_on_every_member() {
        // Widths 1, 0 (a member without heads) and 2; two rows.
        let widths = [1, 0, 2];
        let members = LocalGroup::members(3);
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = members
                .iter()
                .enumerate()
                .map(|(rank, m)| {
                    s.spawn(move || {
                        let mut all = Vec::new();
                        for step in 0..100 {
                            let mine: Vec<f32> = (0..widths[rank] * 2)
                                .map(|i| (step * 100 + rank * 10 + i) as f32)
                                .collect();
                            let mut out = vec![0.0; 6];
                            m.all_gather(&mine, &widths, 2, &mut out).unwrap();
                            all.extend(out);
                        }
                        all
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(results[0], results[1]);
        assert_eq!(results[0], results[2]);
        assert_eq!(results[0][..6], [0.0, 20.0, 21.0, 1.0, 22.0, 23.0]);
    }

    #[test]
    fn an_aborted_member_releases_the_others() {
        let members = LocalGroup::members(2);
        members[1].abort("load failed");
        let err = members[0].all_gather(&[1.0], &[1, 1], 1, &mut [0.0; 2]).unwrap_err();
        assert_eq!(err, CollectiveError::Aborted("member 1: load failed".into()));
    }
}

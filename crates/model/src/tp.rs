//! Tensor parallelism: the members of a group each hold a slice of every layer of a
//! stage and exchange their slices of the activations four times per layer.
//!
//! Each architecture declares how each tensor it lists is cut (a [`Split`]: whole, by
//! rows of heads, of the FFN, of each expert, ...; the shared lists in
//! [`crate::tensors`] declare theirs); this module turns a declaration into one member's
//! slice ([`TpSplit::cut`]). The declarations follow these rules:
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
//! - q/k norms over all heads at once (minimax-m2): the query rows are gathered before
//!   the norm (a fifth exchange) and every member with heads computes all key heads
//!   (`attn_k` is not split); each keeps its own heads after the norms.
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

use crate::hparams::{HParams, SsmKind, TpHeads};
use crate::tensors::{Dim, Split};
use crate::ModelError;

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
        if let Some(ssm) = &hp.ssm {
            let kind = match ssm.kind {
                SsmKind::GatedDeltaNet => "gated DeltaNet",
                SsmKind::Mamba2 => "Mamba2",
                SsmKind::Kda => "Kimi Delta Attention",
            };
            return Err(ModelError::BadConfig(format!(
                "{} has recurrent ({kind}) layers, which baton does not split between \
                 tensor-parallel members yet: their convolution and state would have to be cut by \
                 heads; run it as pipeline stages",
                hp.arch.name
            )));
        }
        if hp.hyper.is_some() {
            return Err(ModelError::BadConfig(format!(
                "{}'s residual stream is {} copies of the hidden state (hyper-connections), which \
                 baton does not split between tensor-parallel members yet; run it as pipeline stages",
                hp.arch.name,
                hp.hidden_width() / hp.n_embd
            )));
        }
        if hp.msa.is_some() {
            return Err(ModelError::BadConfig(format!(
                "{}'s sparse attention (MSA) chooses blocks per key/value head from indexer \
                 heads that baton does not split between tensor-parallel members; run it as \
                 pipeline stages",
                hp.arch.name
            )));
        }
        if let Some(swa) = &hp.swa_heads {
            return Err(ModelError::BadConfig(format!(
                "{}'s sliding-window layers have heads of their own ({} key/value heads of {}, the \
                 global layers {} of {}), which baton does not split between tensor-parallel \
                 members yet: a group joins every layer's heads in one width; run it as pipeline stages",
                hp.arch.name, swa.n_head_kv, swa.head_dim_k, hp.n_head_kv, hp.head_dim_k
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
        sliced.tp_heads = Some(TpHeads {
            q: self.q_heads.clone(),
            kv: self.kv_heads.clone(),
        });
        sliced
    }

    /// How the member slices a tensor its architecture declares cut by `split`, in a
    /// model of `hp` (the whole model's).
    pub fn cut(&self, hp: &HParams, split: &Split) -> Cut {
        if split.needs_heads() && self.q_heads.is_empty() {
            return Cut::Skip;
        }
        match split {
            Split::Whole | Split::WithHeads => Cut::Whole,
            Split::Rows(dim) => Cut::Rows(self.rows(*dim)),
            Split::EachRow(dim) => Cut::Columns(self.rows(*dim)),
            Split::HeadMatrices => Cut::Matrices(self.q_heads.clone()),
            Split::Fused(parts) => {
                // Each part's rows follow all of the parts before it.
                let mut at = 0;
                let ranges = parts
                    .iter()
                    .map(|&dim| {
                        let rows = self.rows(dim);
                        let shifted = rows.start + at..rows.end + at;
                        at += whole_rows(hp, dim);
                        shifted
                    })
                    .collect();
                Cut::RowRanges(ranges)
            }
        }
    }

    /// The member's share of `dim`, in rows.
    fn rows(&self, dim: Dim) -> Range<usize> {
        let heads = |r: &Range<usize>, d: usize| r.start * d..r.end * d;
        match dim {
            Dim::QHeads(d) => heads(&self.q_heads, d),
            Dim::KvHeads(d) => heads(&self.kv_heads, d),
            Dim::Ff => self.ff.clone(),
            Dim::FfExp => self.ff_exp.clone(),
            Dim::FfShexp => self.ff_shexp.clone(),
            Dim::Embd => self.embd.clone(),
            Dim::Vocab => self.vocab.clone(),
        }
    }
}

/// Rows of all of `dim` in a model of `hp`.
fn whole_rows(hp: &HParams, dim: Dim) -> usize {
    match dim {
        Dim::QHeads(d) => hp.n_head * d,
        Dim::KvHeads(d) => hp.n_head_kv * d,
        Dim::Ff => hp.n_ff,
        Dim::FfExp => hp.moe.n_ff_exp,
        Dim::FfShexp => hp.moe.n_ff_exp * hp.moe.n_expert_shared,
        Dim::Embd => hp.n_embd,
        Dim::Vocab => hp.n_vocab,
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

    /// Cuts of phi3's declared tensors (fused q/k/v and gate/up), 2 and 3 ways: each
    /// member's rows of each part; a member without heads holds no attention input.
    #[test]
    fn declared_splits_cut_fused_projections_and_skip_headless_members() {
        use crate::names::LayerTensor as T;
        use crate::tensors::TensorKind;
        let shape = crate::Shape {
            n_layer: 1,
            n_embd: 64,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 16,
            n_ff: 96,
            n_expert: 0,
            n_expert_used: 0,
            n_ff_exp: 0,
            n_expert_shared: 0,
            n_dense_lead: 0,
            n_swa: 0,
            n_ctx: 256,
        };
        let arch = crate::find_architecture("phi3").unwrap();
        let metadata = crate::example::example_metadata(arch, &shape);
        let header = metadata
            .into_iter()
            .fold(baton_gguf::GgufWriter::new(), |w, (k, v)| w.kv(k, v));
        let gguf = baton_gguf::Gguf::parse(&header.to_bytes()).unwrap();
        let hp = HParams::from_metadata(&gguf, 256).unwrap();
        let specs = crate::tensors::layer(&hp, 0, &|name| name == T::AttnQkv.name());
        let cut = |tensor: T, rank: usize, size: usize| {
            let spec = specs
                .iter()
                .find(|s| s.kind == TensorKind::Layer { layer: 0, tensor })
                .unwrap_or_else(|| panic!("phi3 lists {tensor}"));
            TpSplit::new(&hp, rank, size).unwrap().cut(&hp, &spec.split)
        };
        // Member 1 of 2: query heads 2..4, key/value head 1 (16 rows a head); FFN rows
        // 48..96 of 96 (units of 16).
        assert_eq!(cut(T::AttnQkv, 1, 2), Cut::RowRanges(vec![32..64, 80..96, 112..128]));
        assert_eq!(cut(T::FfnUp, 1, 2), Cut::RowRanges(vec![48..96, 144..192]));
        assert_eq!(cut(T::FfnDown, 1, 2), Cut::Rows(32..64));
        assert_eq!(cut(T::AttnOutput, 1, 2), Cut::Rows(32..64));
        assert_eq!(cut(T::AttnNorm, 1, 2), Cut::Whole);
        // Member 0 of 3 gets no key/value head (2 for 3 members): no attention inputs,
        // but its rows of the output projection.
        assert_eq!(cut(T::AttnQkv, 0, 3), Cut::Skip);
        assert_eq!(cut(T::AttnOutput, 0, 3), Cut::Rows(0..16));
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

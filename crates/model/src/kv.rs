//! The KV cache of one stage: keys and values for each of its layers (f16, or the
//! types of [`KvTypes`]), in cells shared by many sequences. Each cell holds one token
//! of one sequence.

use std::ops::Range;

use baton_ggml::{Buffer, BufferType, Context, DType, Tensor};

use crate::cache_type::{hadamard, KvTypes};
use crate::hparams::{HParams, Window};
use crate::ModelError;

/// Rows of one sequence a stage computes in one batch unless configured otherwise
/// (llama.cpp's default `n_ubatch`): with a sliding-window cache of
/// [`HParams::window_cells`], a batch of more rows of one sequence is refused.
pub const DEFAULT_UBATCH: usize = 512;

/// f16 bit patterns of the two mask values: keep (0.0) and drop (-inf).
const MASK_KEEP: u16 = 0x0000;
const MASK_DROP: u16 = 0xFC00;

/// llama.cpp pads the attended cell count to 256 so graphs keep their shape; we do the
/// same (masked cells cost nothing in flash attention, and results stay identical).
const N_KV_PAD: usize = 256;

/// `used` cells padded to [`N_KV_PAD`] (at least one pad), at most `max`.
fn pad_cells(used: usize, max: usize) -> usize {
    used.div_ceil(N_KV_PAD).max(1).saturating_mul(N_KV_PAD).min(max)
}

/// Rows of a batch that attend together, and the cells they attend over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttnSpan {
    /// Consecutive rows of the batch.
    pub rows: Range<usize>,
    /// Consecutive cells of the cache of the full-attention layers.
    pub cells: Range<usize>,
    /// Consecutive cells of the cache of the sliding-window layers (`cells` when those
    /// layers keep a cell for every token).
    pub window_cells: Range<usize>,
}

/// The cells a batch's keys and values go to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Slots {
    /// A cell of the full-attention layers' cache per row.
    pub full: Vec<i64>,
    /// A cell of the sliding-window layers' cache per row, when they have their own
    /// window-sized cache.
    pub window: Option<Vec<i64>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cell {
    /// Position of the token, or -1 when the cell is free.
    pos: i32,
    seq: u32,
}

const FREE: Cell = Cell { pos: -1, seq: 0 };

/// The bookkeeping of one set of cells: which token each holds.
struct Cells {
    cells: Vec<Cell>,
    n_used: usize,
    /// Cells per sequence when each sequence has a region of its own; 0: any sequence
    /// takes any free cell.
    region: usize,
    /// A window cache's: position `p` of a sequence goes to cell `p mod region` of its
    /// region, over the token `region` positions before it, which the window no
    /// longer shows.
    window: Option<Window>,
    /// A window cache's: for each region, the highest position overwritten since the
    /// sequence started (-1: none). A sequence cut back below it cannot continue: the
    /// tokens its next rows would see are gone.
    overwritten: Vec<i32>,
}

impl Cells {
    fn new(n_cells: usize, n_seq: usize, window: Option<Window>) -> Cells {
        Cells {
            cells: vec![FREE; n_cells],
            n_used: 0,
            region: n_cells.checked_div(n_seq).unwrap_or(0),
            window,
            overwritten: vec![-1; if window.is_some() { n_seq } else { 0 }],
        }
    }

    /// Claims one cell per token (see [`KvCache::claim`]).
    fn claim(&mut self, seq_ids: &[u32], positions: &[i32]) -> Result<Vec<i64>, ModelError> {
        if self.window.is_some() {
            return self.claim_in_window(seq_ids, positions);
        }
        let free = self.cells.len() - self.n_used;
        if seq_ids.len() > free {
            return Err(ModelError::CacheFull {
                need: seq_ids.len(),
                free,
                capacity: self.cells.len(),
            });
        }
        for (&seq, &pos) in seq_ids.iter().zip(positions) {
            if pos < 0 {
                return Err(ModelError::BadBatch(format!("negative position {pos}")));
            }
            if self.cells.iter().any(|c| c.pos == pos && c.seq == seq) {
                return Err(ModelError::BadBatch(format!(
                    "sequence {seq} already holds position {pos}; truncate it before recomputing"
                )));
            }
        }
        if self.region > 0 {
            return self.claim_in_regions(seq_ids, positions);
        }
        let mut slots = Vec::with_capacity(seq_ids.len());
        let mut next = 0;
        for (&seq, &pos) in seq_ids.iter().zip(positions) {
            while self.cells[next].pos >= 0 {
                next += 1;
            }
            self.cells[next] = Cell { pos, seq };
            slots.push(next as i64);
        }
        self.n_used += seq_ids.len();
        Ok(slots)
    }

    /// The region of `seq`, or why it has none.
    fn region_of(&self, seq: u32) -> Result<usize, ModelError> {
        let n_seq = self.cells.len() / self.region;
        if seq as usize >= n_seq {
            return Err(ModelError::BadBatch(format!(
                "sequence id {seq} is out of range: the cache holds {n_seq}"
            )));
        }
        Ok(seq as usize * self.region)
    }

    fn claim_in_regions(&mut self, seq_ids: &[u32], positions: &[i32]) -> Result<Vec<i64>, ModelError> {
        let mut slots = Vec::with_capacity(seq_ids.len());
        for (&seq, &pos) in seq_ids.iter().zip(positions) {
            let start = self.region_of(seq)?;
            if pos as usize >= self.region {
                return Err(ModelError::BadBatch(format!(
                    "sequence {seq} is full: position {pos} is beyond its {} cells",
                    self.region
                )));
            }
            let cell = start + pos as usize;
            if slots.contains(&(cell as i64)) {
                return Err(ModelError::BadBatch(format!(
                    "sequence {seq} has position {pos} twice in the batch"
                )));
            }
            slots.push(cell as i64);
        }
        for ((&seq, &pos), &cell) in seq_ids.iter().zip(positions).zip(&slots) {
            self.cells[cell as usize] = Cell { pos, seq };
        }
        self.n_used += slots.len();
        Ok(slots)
    }

    /// A window cache's claim: position `p` of a sequence takes cell `p mod region` of
    /// its region, as llama.cpp's sliding-window cache places a sequence's tokens from
    /// position 0 on. The token it replaces must be hidden from every row of the batch
    /// (the region holds the window and one batch), and what the batch's first row sees
    /// must not have been overwritten (a sequence cut back further than its region
    /// allows). Checks everything before changing anything.
    fn claim_in_window(&mut self, seq_ids: &[u32], positions: &[i32]) -> Result<Vec<i64>, ModelError> {
        let window = self.window.expect("a window cache has a window");
        let mut slots = Vec::with_capacity(seq_ids.len());
        // The first position of each sequence in the batch: what its rows see from.
        let first = |seq: u32| {
            seq_ids
                .iter()
                .zip(positions)
                .filter(|(&s, _)| s == seq)
                .map(|(_, &p)| p)
                .min()
                .unwrap_or(0)
        };
        for (&seq, &pos) in seq_ids.iter().zip(positions) {
            if pos < 0 {
                return Err(ModelError::BadBatch(format!("negative position {pos}")));
            }
            let start = self.region_of(seq)?;
            let cell = start + pos as usize % self.region;
            if slots.contains(&(cell as i64)) {
                return Err(ModelError::BadBatch(format!(
                    "sequence {seq} has position {pos} twice in the batch, or more rows than \
                     its sliding-window cache of {} cells holds",
                    self.region
                )));
            }
            let first = first(seq);
            let held = self.cells[cell];
            if held.pos == pos {
                return Err(ModelError::BadBatch(format!(
                    "sequence {seq} already holds position {pos}; truncate it before recomputing"
                )));
            }
            if held.pos >= 0 && !(held.pos < first && window.hides(first, held.pos)) {
                return Err(ModelError::BadBatch(format!(
                    "sequence {seq}: rows {first}..={pos} in one batch are more than its \
                     sliding-window cache of {} cells holds besides its window of {:?}; send \
                     fewer rows of a sequence per batch",
                    self.region, window
                )));
            }
            let seen_from = window.first_visible(first);
            let overwritten = self.overwritten[start / self.region];
            if seen_from < first && seen_from <= overwritten {
                return Err(ModelError::BadBatch(format!(
                    "sequence {seq} cannot continue at position {first}: its sliding-window \
                     cache no longer holds positions {seen_from}..={overwritten}, which it \
                     sees; it was cut back further than its {} cells allow, recompute it \
                     from the start",
                    self.region
                )));
            }
            slots.push(cell as i64);
        }
        for ((&seq, &pos), &cell) in seq_ids.iter().zip(positions).zip(&slots) {
            let held = &mut self.cells[cell as usize];
            if held.pos >= 0 {
                let overwritten = &mut self.overwritten[cell as usize / self.region];
                *overwritten = (*overwritten).max(held.pos);
            } else {
                self.n_used += 1;
            }
            *held = Cell { pos, seq };
        }
        Ok(slots)
    }

    /// Frees the cells just claimed (used when a computation fails). A window cache's
    /// cells that replaced tokens are freed too: those tokens stay gone.
    fn release(&mut self, slots: &[i64]) {
        for &slot in slots {
            if let Some(cell) = self.cells.get_mut(slot as usize) {
                if cell.pos >= 0 {
                    *cell = FREE;
                    self.n_used -= 1;
                }
            }
        }
    }

    /// Cells attention looks at: past the last used cell, padded. A window region's
    /// is what a fresh run of the sequence to its highest position uses (its
    /// positions from 0 on, placed as [`Cells::claim_in_window`] places them), so
    /// that it does not depend on where the sequence was cut back before.
    fn span(&self, seq: Option<u32>) -> Range<usize> {
        let Some(seq) = seq.filter(|_| self.region > 0) else {
            let last = self.cells.iter().rposition(|c| c.pos >= 0).map_or(0, |i| i + 1);
            return 0..pad_cells(last, self.cells.len());
        };
        let start = seq as usize * self.region;
        let region = &self.cells[start..(start + self.region).min(self.cells.len())];
        let used = match self.window {
            Some(_) => region
                .iter()
                .map(|c| c.pos + 1)
                .max()
                .map_or(0, |end| (end.max(0) as usize).min(self.region)),
            None => region.iter().rposition(|c| c.pos >= 0).map_or(0, |i| i + 1),
        };
        start..start + pad_cells(used, self.region)
    }

    fn mask(&self, seq_ids: &[u32], positions: &[i32], cells: Range<usize>, window: Option<Window>) -> Vec<u16> {
        let n_kv = cells.len();
        let mut mask = vec![MASK_DROP; n_kv * seq_ids.len()];
        for (row, (&seq, &pos)) in mask.chunks_exact_mut(n_kv).zip(seq_ids.iter().zip(positions)) {
            for (value, cell) in row.iter_mut().zip(&self.cells[cells.clone()]) {
                let visible = cell.pos >= 0
                    && cell.seq == seq
                    && cell.pos <= pos
                    && window.is_none_or(|w| !w.hides(pos, cell.pos));
                if visible {
                    *value = MASK_KEEP;
                }
            }
        }
        mask
    }

    fn truncate_seq(&mut self, seq: u32, len: usize) {
        for cell in &mut self.cells {
            if cell.pos >= 0 && cell.seq == seq && cell.pos as usize >= len {
                *cell = FREE;
                self.n_used -= 1;
            }
        }
        // Positions from `len` on are computed again: only those before it stay lost.
        if let Some(overwritten) = self.overwritten.get_mut(seq as usize) {
            *overwritten = (*overwritten).min(len as i32 - 1);
        }
    }

    /// How many tokens of `seq` `cells` holds when they are its positions 0, 1, … in
    /// consecutive cells from the first, and no other of its tokens follows; `None`
    /// when they are not.
    fn positions_in_order(&self, seq: u32, cells: Range<usize>) -> Option<usize> {
        let cells = &self.cells[cells];
        let n = cells
            .iter()
            .enumerate()
            .take_while(|&(i, c)| c.seq == seq && c.pos == i as i32)
            .count();
        cells[n..].iter().all(|c| c.pos < 0 || c.seq != seq).then_some(n)
    }
}

/// Keys and values for a stage's layers plus the cell bookkeeping: one set of cells
/// for the full-attention layers and, when sequences have regions, a smaller one for
/// the sliding-window layers (see [`HParams::window_cells`]).
pub struct KvCache {
    // Tensors `cache_k_l{layer}` / `cache_v_l{layer}` (and the rotations `cache_k_rot`
    // / `cache_v_rot` of quantized types) live in `ctx`, their data in `buffer`; none
    // for a tensor-parallel member without heads (cells only).
    ctx: Context,
    types: KvTypes,
    buffer: Option<Buffer>,
    layers: Range<usize>,
    full: Cells,
    /// The sliding-window layers' own cells, when they have them.
    window_cells: Option<Cells>,
    /// What the sliding-window layers see, for models that have them.
    window: Option<Window>,
    /// Whether each run of one sequence's rows attends as a span of its own even
    /// without regions (MiniMax sparse attention chooses blocks of one sequence's
    /// positions).
    spans_per_sequence: bool,
}

impl KvCache {
    /// A cache of `n_ctx` cells for global layers `layers`. With `n_seq > 0`, sequence
    /// `s` owns cells `s × n_ctx/n_seq ..`, position `p` in cell `s × n_ctx/n_seq + p`:
    /// attention then visits a sequence's cells in position order whatever else runs,
    /// so a sequence computes the same in any batch (ggml accumulates attention in f16,
    /// where order shows). With `n_seq = 0` any free cell is taken.
    ///
    /// With `n_seq > 0`, sliding-window layers keep [`HParams::window_cells`] cells per
    /// sequence instead (batches of at most [`DEFAULT_UBATCH`] rows of a sequence), in
    /// the order llama.cpp's sliding-window cache keeps them.
    pub fn new(hp: &HParams, layers: Range<usize>, n_ctx: usize, n_seq: usize) -> Result<KvCache, ModelError> {
        KvCache::new_in(hp, layers, n_ctx, n_seq, DEFAULT_UBATCH, KvTypes::default(), None)
    }

    /// [`KvCache::new`] for batches of at most `n_ubatch` rows of a sequence, with
    /// keys and values of `types`, in memory of `buft` (a device's own memory) instead
    /// of the CPU's.
    pub fn new_in(
        hp: &HParams,
        layers: Range<usize>,
        n_ctx: usize,
        n_seq: usize,
        n_ubatch: usize,
        types: KvTypes,
        buft: Option<BufferType>,
    ) -> Result<KvCache, ModelError> {
        if n_ctx == 0 {
            return Err(ModelError::BadConfig("context size must be at least 1".into()));
        }
        if n_seq > n_ctx {
            return Err(ModelError::BadConfig(format!(
                "{n_seq} sequences cannot share {n_ctx} cells"
            )));
        }
        if n_ubatch == 0 {
            return Err(ModelError::BadConfig("a batch must hold at least one row".into()));
        }
        types.check(hp)?;
        let window = layers.clone().any(|l| hp.is_swa(l)).then(|| hp.window());
        let window_cells = window
            .and_then(|w| Some((w, hp.window_cells(n_ctx, n_seq, n_ubatch)?)))
            .map(|(w, per_seq)| Cells::new(per_seq * n_seq, n_seq, Some(w)));
        let ctx = Context::new(5 * layers.len() + 6, 0);
        // Recurrent layers keep states instead (see `RecurrentCache`); layers that do not
        // attend keep nothing.
        let has_heads = hp.n_embd_k_gqa() > 0 && layers.clone().any(|l| hp.has_kv(l));
        for layer in layers.clone().filter(|&l| has_heads && hp.has_kv(l)) {
            let n_cells = match &window_cells {
                Some(cells) if hp.is_swa(layer) => cells.cells.len(),
                _ => n_ctx,
            } as i64;
            // Sliding-window layers may have heads of their own (Gemma 4).
            let heads = hp.layer_heads(layer);
            ctx.new_tensor(types.k.dtype(), &[(heads.n_head_kv * heads.head_dim_k) as i64, n_cells])
                .named(&format!("cache_k_l{layer}"));
            // MLA caches only the compressed keys; values are a view of them.
            if !hp.keys_only() {
                ctx.new_tensor(types.v.dtype(), &[(heads.n_head_kv * heads.head_dim_v) as i64, n_cells])
                    .named(&format!("cache_v_l{layer}"));
            }
            // Sparse attention (DeepSeek's, MiniMax's): the indexer's key of each token,
            // in the same cells.
            if let Some(dim) = hp.indexer_key_dim(layer) {
                ctx.new_tensor(types.k.dtype(), &[dim as i64, n_cells])
                    .named(&format!("cache_ik_l{layer}"));
            }
            // DeepSeek V4's compressor: each token's value and score rows in f32, in a
            // cell of every token (see `compressor`).
            if let Some(dim) = hp.compressor_dim(layer) {
                ctx.new_tensor(DType::F32, &[dim as i64, n_ctx as i64])
                    .named(&format!("cache_ck_l{layer}"));
            }
            if let Some(dim) = hp.indexer_compressor_dim(layer) {
                ctx.new_tensor(DType::F32, &[dim as i64, n_ctx as i64])
                    .named(&format!("cache_cik_l{layer}"));
            }
        }
        // DeepSeek V4's lightning indexer: llama.cpp multiplies its queries and
        // compressed keys by a Walsh-Hadamard matrix of the whole head.
        let compressor_rotation = hp
            .dsv4
            .as_ref()
            .filter(|v4| has_heads && layers.clone().any(|l| v4.is_csa(l)))
            .map_or(0, |v4| v4.indexer_heads.1);
        if compressor_rotation > 0 {
            ctx.new_tensor(DType::F32, &[compressor_rotation as i64, compressor_rotation as i64])
                .named("cache_cik_rot");
        }
        let indexer_rotation = hp.indexer().map_or(0, |ix| ix.rotation());
        if has_heads && indexer_rotation > 0 {
            ctx.new_tensor(DType::F32, &[indexer_rotation as i64, indexer_rotation as i64])
                .named("cache_ik_rot");
        }
        let rotations = [("k", types.k_rotation(hp)), ("v", types.v_rotation(hp))];
        for (kind, n) in rotations.iter().filter(|(_, n)| has_heads && *n > 0) {
            ctx.new_tensor(DType::F32, &[*n as i64, *n as i64])
                .named(&format!("cache_{kind}_rot"));
        }
        let buffer = if has_heads {
            let mut buffer = match buft {
                Some(buft) => buft.alloc(&ctx)?,
                None => Buffer::alloc_cpu(&ctx)?,
            };
            // Zeroed so that never-written cells hold finite values (masked, but multiplied).
            buffer.clear(0);
            for (kind, n) in rotations.iter().filter(|(_, n)| *n > 0) {
                if let Some(rot) = ctx.get_tensor(&format!("cache_{kind}_rot")) {
                    rot.write(&hadamard(*n))?;
                }
            }
            if let Some(rot) = ctx.get_tensor("cache_ik_rot") {
                rot.write(&hadamard(indexer_rotation))?;
            }
            if let Some(rot) = ctx.get_tensor("cache_cik_rot") {
                rot.write(&hadamard(compressor_rotation))?;
            }
            Some(buffer)
        } else {
            None
        };
        Ok(KvCache {
            ctx,
            types,
            buffer,
            layers,
            full: Cells::new(n_ctx, n_seq, None),
            window_cells,
            window,
            spans_per_sequence: hp.msa.is_some(),
        })
    }

    /// Key cache of global layer `layer` (`[n_embd_k_gqa, cells]`).
    pub fn k(&self, layer: usize) -> Tensor<'_> {
        self.tensor("k", layer)
    }

    /// Value cache of global layer `layer` (`[n_embd_v_gqa, cells]`); models with MLA
    /// have none (their values are the first `head_dim_v` entries of each key row).
    pub fn v(&self, layer: usize) -> Tensor<'_> {
        self.tensor("v", layer)
    }

    /// Indexer key cache of global layer `layer` (`[head_dim, n_ctx]`, DeepSeek sparse
    /// attention; `[2 head_dim, n_ctx]` with a k-pool, each key followed by its gate
    /// scores): one key per cell, written and dropped with the cell's latent row, so
    /// truncating a sequence (prefix reuse, rejected drafts) and replaying it (recovery)
    /// keep it with them. `None` on layers that reuse an earlier layer's selection.
    pub fn indexer_k(&self, layer: usize) -> Option<Tensor<'_>> {
        assert!(self.layers.contains(&layer), "layer {layer} is not in this cache");
        self.ctx.get_tensor(&format!("cache_ik_l{layer}"))
    }

    /// DeepSeek V4's compressor rows of global layer `layer` (`[2 head_dim, n_ctx]` f32,
    /// each token's value row then its score row; `[4 head_dim, n_ctx]` on a compressed
    /// sparse layer, whose rows are twice as wide) in the cells of the full cache (the
    /// cells of [`Slots::full`], a cell for every token), so that truncating a sequence
    /// drops them with its tokens and the compressed keys, a function of these rows
    /// alone, are computed again from them. `None` on layers without a compressor.
    pub fn compressor(&self, layer: usize) -> Option<Tensor<'_>> {
        assert!(self.layers.contains(&layer), "layer {layer} is not in this cache");
        self.ctx.get_tensor(&format!("cache_ck_l{layer}"))
    }

    /// DeepSeek V4's lightning indexer's compressor rows of global layer `layer` (`[4
    /// indexer head, n_ctx]` f32; as [`KvCache::compressor`]'s), on compressed sparse
    /// layers.
    pub fn indexer_compressor(&self, layer: usize) -> Option<Tensor<'_>> {
        assert!(self.layers.contains(&layer), "layer {layer} is not in this cache");
        self.ctx.get_tensor(&format!("cache_cik_l{layer}"))
    }

    /// The Walsh-Hadamard matrix DeepSeek V4's lightning indexer multiplies its queries
    /// and compressed keys by (a stage with compressed sparse layers).
    pub fn compressor_rotation(&self) -> Option<Tensor<'_>> {
        self.ctx.get_tensor("cache_cik_rot")
    }

    /// The Walsh-Hadamard matrix indexer queries and keys are multiplied by before
    /// scoring (as llama.cpp does, whatever the cache type).
    pub fn indexer_rotation(&self) -> Option<Tensor<'_>> {
        self.ctx.get_tensor("cache_ik_rot")
    }

    /// The element types of keys and values.
    pub fn types(&self) -> KvTypes {
        self.types
    }

    /// The Walsh-Hadamard matrix queries and keys are rotated by before a quantized
    /// key cache (see [`KvTypes::k_rotation`]); `None` when they are not.
    pub fn k_rotation(&self) -> Option<Tensor<'_>> {
        self.ctx.get_tensor("cache_k_rot")
    }

    /// The matrix values are rotated by before a quantized value cache, and the
    /// attention's output after it (see [`KvTypes::v_rotation`]); `None` when they are
    /// not.
    pub fn v_rotation(&self) -> Option<Tensor<'_>> {
        self.ctx.get_tensor("cache_v_rot")
    }

    fn tensor(&self, kind: &str, layer: usize) -> Tensor<'_> {
        assert!(
            self.layers.contains(&layer),
            "layer {layer} is not in this cache ({:?})",
            self.layers
        );
        self.ctx
            .get_tensor(&format!("cache_{kind}_l{layer}"))
            .expect("cache tensors are created for every layer")
    }

    /// Number of cells (of the full-attention layers: one per token of the context).
    pub fn capacity(&self) -> usize {
        self.full.cells.len()
    }

    /// Cells of the sliding-window layers' own cache, when they have one.
    pub fn window_capacity(&self) -> Option<usize> {
        self.window_cells.as_ref().map(|c| c.cells.len())
    }

    /// Cells in use (of the full-attention layers).
    pub fn n_used(&self) -> usize {
        self.full.n_used
    }

    /// Bytes of key and value memory (with a quantized type, also the two rotation
    /// matrices: 16 KiB each for heads of 64).
    pub fn bytes(&self) -> usize {
        self.buffer.as_ref().map_or(0, Buffer::size)
    }

    /// Number of tokens `seq` holds.
    pub fn seq_len(&self, seq: u32) -> usize {
        self.full.cells.iter().filter(|c| c.pos >= 0 && c.seq == seq).count()
    }

    /// Claims a cell per token in each set of cells; returns the cell indices. Fails
    /// without changing anything when the cache is full, a position is already taken,
    /// or the sliding-window cells cannot take the batch (see [`Slots`]).
    pub fn claim(&mut self, seq_ids: &[u32], positions: &[i32]) -> Result<Slots, ModelError> {
        let full = self.full.claim(seq_ids, positions)?;
        let window = match self.window_cells.as_mut().map(|cells| cells.claim(seq_ids, positions)) {
            Some(Ok(slots)) => Some(slots),
            Some(Err(e)) => {
                self.full.release(&full);
                return Err(e);
            }
            None => None,
        };
        Ok(Slots { full, window })
    }

    /// Frees the cells just claimed (used when a computation fails).
    pub fn release(&mut self, slots: &Slots) {
        self.full.release(&slots.full);
        if let (Some(cells), Some(window)) = (self.window_cells.as_mut(), &slots.window) {
            cells.release(window);
        }
    }

    /// How many tokens of `seq` the full-attention cells `cells` (a span's) hold, when
    /// they hold its positions 0, 1, … in order from the first cell (a sequence's
    /// region, or the cache of a lone sequence): what GLM-5 next's k-pool indexer cuts
    /// into blocks. `None` when they do not.
    pub fn positions_in_order(&self, seq: u32, cells: Range<usize>) -> Option<usize> {
        self.full.positions_in_order(seq, cells)
    }

    /// How many cells attention must look at: past the last used cell, padded.
    pub fn n_kv(&self) -> usize {
        self.full.span(None).end
    }

    /// How the rows of a batch attend: one span per run of consecutive rows of the
    /// same sequence when sequences have regions, each over its own region's used
    /// cells (padded); otherwise one span of every row over every used cell.
    ///
    /// With regions, a sequence's attention then costs what its own length costs, not
    /// what the highest used cell of any sequence does (decoding sequence 7 of 8 with
    /// 1024-cell regions: 38-43 tok/s over all cells, 40-50 over its own, qwen2 0.5B),
    /// and a sequence attends over the same cells alone or in any batch.
    pub fn attention_spans(&self, seq_ids: &[u32]) -> Vec<AttnSpan> {
        let span = |rows: Range<usize>, seq: Option<u32>| {
            let cells = self.full.span(seq);
            let window_cells = self.window_cells.as_ref().map_or(cells.clone(), |w| w.span(seq));
            AttnSpan {
                rows,
                cells,
                window_cells,
            }
        };
        if self.full.region == 0 && !self.spans_per_sequence {
            return vec![span(0..seq_ids.len(), None)];
        }
        let mut spans: Vec<AttnSpan> = Vec::new();
        for (row, &seq) in seq_ids.iter().enumerate() {
            match spans.last_mut() {
                Some(last) if seq_ids[last.rows.start] == seq => last.rows.end = row + 1,
                _ => spans.push(span(row..row + 1, Some(seq))),
            }
        }
        spans
    }

    /// The attention mask `[cells.len(), n_tokens]` (f16 bits) of the tokens of
    /// `seq_ids` at `positions` over `cells` of the full-attention layers' cache: a
    /// token sees the cells of its own sequence at positions not after its own, and,
    /// with a `window`, only those the window shows it (the last `n` positions, or
    /// those of its own chunk).
    pub fn mask(&self, seq_ids: &[u32], positions: &[i32], cells: Range<usize>, window: Option<Window>) -> Vec<u16> {
        self.full.mask(seq_ids, positions, cells, window)
    }

    /// The sliding-window layers' mask (as [`KvCache::mask`] with the model's window)
    /// over `cells` of their cache (an [`AttnSpan::window_cells`]).
    pub fn window_mask(&self, seq_ids: &[u32], positions: &[i32], cells: Range<usize>) -> Vec<u16> {
        let set = self.window_cells.as_ref().unwrap_or(&self.full);
        set.mask(seq_ids, positions, cells, self.window)
    }

    /// For positions `0..n_pos` of `seq`, the cell (counted from `cells.start`) that
    /// holds each, 0 where none does (MiniMax sparse attention's position-to-cell map,
    /// as llama.cpp's `set_input_pos_slot` writes it).
    pub fn pos_cells(&self, seq: u32, cells: Range<usize>, n_pos: usize) -> Vec<i32> {
        let mut map = vec![0; n_pos];
        for (j, cell) in self.full.cells[cells].iter().enumerate() {
            if cell.pos >= 0 && cell.seq == seq && (cell.pos as usize) < n_pos {
                map[cell.pos as usize] = j as i32;
            }
        }
        map
    }

    /// For each of `cells`, the block (of `block` positions) of the position of `seq`
    /// it holds, 0 for cells of no position of `seq` (llama.cpp's `set_input_cell_pos`).
    pub fn cell_blocks(&self, seq: u32, cells: Range<usize>, block: usize) -> Vec<i32> {
        self.full.cells[cells]
            .iter()
            .map(|c| {
                if c.pos >= 0 && c.seq == seq {
                    c.pos / block as i32
                } else {
                    0
                }
            })
            .collect()
    }

    /// f32 `[n_pos, n_tokens]`: for each token of `seq_ids` at `positions`, 0 at the
    /// positions of its sequence that `cells` (its span's, which hold every cell of its
    /// sequence) hold and it sees (causally), -inf elsewhere (llama.cpp's
    /// `set_input_pos_mask`).
    pub fn pos_mask(&self, seq_ids: &[u32], positions: &[i32], cells: Range<usize>, n_pos: usize) -> Vec<f32> {
        let mut mask = vec![f32::NEG_INFINITY; n_pos * seq_ids.len()];
        for (row, (&seq, &pos)) in mask.chunks_exact_mut(n_pos).zip(seq_ids.iter().zip(positions)) {
            for cell in &self.full.cells[cells.clone()] {
                if cell.pos >= 0 && cell.seq == seq && cell.pos <= pos && (cell.pos as usize) < n_pos {
                    row[cell.pos as usize] = 0.0;
                }
            }
        }
        mask
    }

    /// Forgets every token of `seq`.
    pub fn clear_seq(&mut self, seq: u32) {
        self.truncate_seq(seq, 0);
    }

    /// Keeps only the tokens of `seq` at positions below `len`. A sequence whose
    /// sliding-window cells overwrote what position `len` sees cannot continue from
    /// there (its next claim says so); it continues after any cut of at most
    /// [`KvCache::window_slack`] positions.
    pub fn truncate_seq(&mut self, seq: u32, len: usize) {
        self.full.truncate_seq(seq, len);
        if let Some(cells) = self.window_cells.as_mut() {
            cells.truncate_seq(seq, len);
        }
    }

    /// How many positions a sequence may always be cut back by and continue: a batch
    /// of up to `n_ubatch` rows past its window, the slack of its sliding-window
    /// cells (`None`: any cut, the cache keeps every token).
    pub fn window_slack(&self) -> Option<usize> {
        let (cells, window) = (self.window_cells.as_ref()?, self.window?);
        let n = match window {
            Window::Sliding(n) | Window::Chunked(n) => n,
        };
        Some(cells.region.saturating_sub(n) + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> HParams {
        let rope = baton_ggml::RopeParams {
            n_dims: 4,
            mode: 0,
            n_ctx_orig: 64,
            freq_base: 10000.0,
            freq_scale: 1.0,
            ext_factor: 0.0,
            attn_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        HParams {
            arch: crate::arch::find("llama").unwrap(),
            n_layer: 2,
            n_layer_nextn: 0,
            n_embd: 8,
            n_head: 2,
            n_head_kv: 1,
            head_dim_k: 4,
            head_dim_v: 4,
            n_ff: 16,
            n_vocab: 10,
            n_ctx_train: 64,
            rms_eps: 1e-5,
            rope_swa: rope.clone(),
            rope,
            attn_scale: 0.5,
            query_scale: 1.0,
            n_swa: 0,
            swa_type: crate::hparams::SwaType::Sliding,
            swa_layers: vec![false; 2],
            final_logit_softcap: 0.0,
            attn_logit_softcap: 0.0,
            moe: crate::MoeParams {
                n_expert: 0,
                n_expert_used: 0,
                n_ff_exp: 0,
                n_expert_shared: 0,
                n_ff_shexp: 0,
                n_layer_dense_lead: 0,
                layer_step: 1,
                n_group: 0,
                n_group_used: 0,
                weights_norm: false,
                weights_scale: 0.0,
                gating: crate::Gating::Softmax,
                swiglu_clamps: None,
            },
            mla: None,
            attn_temp: None,
            tp_heads: None,
            ssm: None,
            recurrent_layers: vec![false; 2],
            layer_kv_heads: vec![1; 2],
            swa_heads: None,
            kimi_k3: None,
            kda_gate_lower_bound: None,
            unrotated: false,
            hyper: None,
            dsv4: None,
            msa: None,
            layer_ff: vec![16; 2],
            rope_sections: None,
            yarn: crate::Yarn {
                attn_factor: 1.0,
                log_mul: 0.0,
                mscale_from_log_mul: false,
            },
        }
    }

    #[test]
    fn claims_masks_and_truncates() {
        let mut kv = KvCache::new(&tiny(), 0..2, 8, 0).unwrap();
        let slots = kv.claim(&[0, 0, 1], &[0, 1, 0]).unwrap();
        assert_eq!(slots.full, vec![0, 1, 2]);
        assert_eq!(kv.n_kv(), 8);
        let mask = kv.mask(&[0, 1], &[1, 0], 0..4, None);
        assert_eq!(&mask[..4], &[MASK_KEEP, MASK_KEEP, MASK_DROP, MASK_DROP]);
        assert_eq!(&mask[4..], &[MASK_DROP, MASK_DROP, MASK_KEEP, MASK_DROP]);
        let swa = kv.mask(&[0], &[1], 0..4, Some(Window::Sliding(1)));
        assert_eq!(&swa, &[MASK_DROP, MASK_KEEP, MASK_DROP, MASK_DROP]);
        kv.truncate_seq(0, 1);
        assert_eq!(kv.seq_len(0), 1);
        assert_eq!(kv.claim(&[0], &[1]).unwrap().full, vec![1]);
        kv.clear_seq(0);
        kv.clear_seq(1);
        assert_eq!(kv.n_used(), 0);
    }

    /// Llama 4's chunks: a token sees the earlier positions of its own chunk only,
    /// however close the previous chunk's last positions are.
    #[test]
    fn chunked_windows_hide_earlier_chunks() {
        let mut kv = KvCache::new(&tiny(), 0..1, 8, 0).unwrap();
        kv.claim(&[0; 7], &[0, 1, 2, 3, 4, 5, 6]).unwrap();
        let mask = kv.mask(&[0, 0, 0], &[3, 4, 6], 0..8, Some(Window::Chunked(4)));
        let (k, d) = (MASK_KEEP, MASK_DROP);
        assert_eq!(
            &mask[..8],
            &[k, k, k, k, d, d, d, d],
            "position 3: the whole first chunk"
        );
        assert_eq!(&mask[8..16], &[d, d, d, d, k, d, d, d], "position 4: only itself");
        assert_eq!(&mask[16..], &[d, d, d, d, k, k, k, d], "position 6: 4..=6");
        // As llama.cpp's `is_masked_swa` decides, for both kinds.
        for (window, pos, past, hidden) in [
            (Window::Chunked(8192), 8191, 0, false),
            (Window::Chunked(8192), 8192, 8191, true),
            (Window::Chunked(8192), 8193, 8192, false),
            (Window::Sliding(16), 20, 5, false),
            (Window::Sliding(16), 20, 4, true),
            (Window::Sliding(16), 20, 6, false),
        ] {
            assert_eq!(window.hides(pos, past), hidden, "{window:?} {pos} {past}");
        }
    }

    /// A quantized block must lie within one head: heads of 4 values take no q8_0
    /// (blocks of 32), and the error names the flag and both sizes.
    #[test]
    fn quantized_types_whose_blocks_straddle_heads_are_refused() {
        use crate::CacheType;
        let types = KvTypes {
            k: CacheType::F32,
            v: CacheType::Q8_0,
        };
        let err = KvCache::new_in(&tiny(), 0..2, 8, 0, 8, types, None)
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            err,
            "bad stage configuration: --cache-type-v q8_0 stores blocks of 32 values, which do not divide this \
             model's head size 4"
        );
        let kv = KvCache::new_in(&tiny(), 0..2, 8, 0, 8, KvTypes::both(CacheType::Bf16), None).unwrap();
        assert_eq!(
            kv.bytes(),
            2 * 2 * 8 * 4 * 2,
            "2 layers, keys and values, 8 cells of 4 bf16"
        );
        assert!(kv.k_rotation().is_none(), "float types are not rotated");
    }

    /// Rotations of the sizes llama.cpp picks: keys by 64 doubled while it divides the
    /// head, values by 64, none when the head is not a multiple of 64 or the type is
    /// not quantized.
    #[test]
    fn rotations_take_llama_cpps_sizes() {
        use crate::CacheType;
        let mut hp = tiny();
        let q8 = KvTypes::both(CacheType::Q8_0);
        for (head, k, v) in [(64, 64, 64), (128, 128, 64), (256, 256, 64), (192, 64, 64), (96, 0, 0)] {
            hp.head_dim_k = head;
            hp.head_dim_v = head;
            assert_eq!((q8.k_rotation(&hp), q8.v_rotation(&hp)), (k, v), "head {head}");
            let floats = KvTypes {
                k: CacheType::Bf16,
                v: CacheType::F32,
            };
            assert_eq!((floats.k_rotation(&hp), floats.v_rotation(&hp)), (0, 0));
        }
    }

    #[test]
    fn overflow_and_duplicate_positions_are_errors() {
        let mut kv = KvCache::new(&tiny(), 0..1, 2, 0).unwrap();
        kv.claim(&[0], &[0]).unwrap();
        let dup = kv.claim(&[0], &[0]).unwrap_err().to_string();
        assert!(dup.contains("already holds position 0"), "{dup}");
        let full = kv.claim(&[0, 0], &[1, 2]).unwrap_err().to_string();
        assert!(full.contains("KV cache is full"), "{full}");
        assert_eq!(kv.n_used(), 1, "a refused claim changes nothing");
    }

    #[test]
    fn rows_of_each_sequence_attend_over_their_own_region() {
        let mut kv = KvCache::new(&tiny(), 0..1, 2048, 2).unwrap();
        let positions: Vec<i32> = (0..300).collect();
        kv.claim(&[1; 300], &positions).unwrap();
        kv.claim(&[0, 0], &[0, 1]).unwrap();
        let span = |rows, cells: Range<usize>| AttnSpan {
            rows,
            window_cells: cells.clone(),
            cells,
        };
        assert_eq!(
            kv.attention_spans(&[0, 0, 1, 1, 0]),
            vec![span(0..2, 0..256), span(2..4, 1024..1536), span(4..5, 0..256)]
        );
        let shared = KvCache::new(&tiny(), 0..1, 2048, 0).unwrap();
        assert_eq!(shared.attention_spans(&[0, 1, 0]), vec![span(0..3, 0..256)]);
    }

    #[test]
    fn sequences_with_regions_keep_their_cells_in_position_order() {
        let mut kv = KvCache::new(&tiny(), 0..1, 8, 2).unwrap();
        assert_eq!(kv.claim(&[1, 0, 1], &[0, 0, 1]).unwrap().full, vec![4, 0, 5]);
        assert_eq!(kv.claim(&[0], &[1]).unwrap().full, vec![1]);
        kv.truncate_seq(1, 1);
        assert_eq!(kv.n_used(), 3);
        assert_eq!(kv.claim(&[1], &[1]).unwrap().full, vec![5]);
        let err = kv.claim(&[2], &[0]).unwrap_err().to_string();
        assert!(err.contains("out of range"), "{err}");
        let err = kv.claim(&[0], &[4]).unwrap_err().to_string();
        assert!(err.contains("sequence 0 is full"), "{err}");
        let err = kv.claim(&[0], &[1]).unwrap_err().to_string();
        assert!(err.contains("already holds position 1"), "{err}");
        assert_eq!(kv.n_used(), 4, "failed claims change nothing");
    }

    /// What GLM-5 next's k-pool indexer cuts into blocks: a sequence's tokens in
    /// position order from its span's first cell, none after a gap; a shared cache
    /// whose sequences interleave has no such order.
    #[test]
    fn positions_in_order_count_a_sequence_held_from_its_first_cell() {
        let mut kv = KvCache::new(&tiny(), 0..1, 16, 2).unwrap();
        kv.claim(&[0, 0, 0, 1, 1], &[0, 1, 2, 0, 1]).unwrap();
        assert_eq!(kv.positions_in_order(0, 0..8), Some(3));
        assert_eq!(kv.positions_in_order(1, 8..16), Some(2));
        assert_eq!(kv.positions_in_order(0, 8..16), Some(0), "another sequence's region");
        kv.claim(&[0], &[5]).unwrap();
        assert_eq!(kv.positions_in_order(0, 0..8), None, "a gap at positions 3 and 4");
        let mut shared = KvCache::new(&tiny(), 0..1, 16, 0).unwrap();
        shared.claim(&[0, 1, 0], &[0, 0, 1]).unwrap();
        assert_eq!(shared.positions_in_order(0, 0..16), None);
        let mut alone = KvCache::new(&tiny(), 0..1, 16, 0).unwrap();
        alone.claim(&[0, 0, 0, 0], &[0, 1, 2, 3]).unwrap();
        alone.truncate_seq(0, 2);
        assert_eq!(alone.positions_in_order(0, 0..16), Some(2));
    }

    /// `tiny` with a window of 4 on layer 0; layer 1 attends to everything.
    fn tiny_swa() -> HParams {
        HParams {
            n_swa: 4,
            swa_layers: vec![true, false],
            ..tiny()
        }
    }

    /// Claims `positions` of `seq` in batches of `n_rows`; returns the window cells.
    fn run(kv: &mut KvCache, seq: u32, positions: Range<i32>, n_rows: usize) -> Vec<i64> {
        let positions: Vec<i32> = positions.collect();
        let mut cells = Vec::new();
        for batch in positions.chunks(n_rows) {
            let slots = kv.claim(&vec![seq; batch.len()], batch).unwrap();
            cells.extend(slots.window.unwrap());
        }
        cells
    }

    /// Sliding-window layers keep the window and one batch per sequence (padded to
    /// 256), position `p` in cell `p mod 256` of the sequence's region, as llama.cpp's
    /// sliding-window cache places a sequence's tokens; full layers keep every token.
    #[test]
    fn window_layers_keep_a_window_sized_region_per_sequence() {
        let mut kv = KvCache::new_in(&tiny_swa(), 0..2, 2048, 2, 8, KvTypes::default(), None).unwrap();
        assert_eq!(kv.window_capacity(), Some(2 * 256));
        assert_eq!(
            kv.bytes(),
            2 * 8 * (2 * 256 + 2048),
            "keys and values of 4 f16: layer 0's 512 cells, layer 1's 2048"
        );
        let cells = run(&mut kv, 1, 0..300, 8);
        let expected: Vec<i64> = (0..300).map(|p| 256 + p % 256).collect();
        assert_eq!(cells, expected);
        assert_eq!(kv.seq_len(1), 300, "the full layers keep every token");
        let spans = kv.attention_spans(&[1]);
        assert_eq!(
            (spans[0].cells.clone(), spans[0].window_cells.clone()),
            (1024..1536, 256..512)
        );
        // Position 299 sees 296..=299, in cells 40..=43 of its region.
        let mask = kv.window_mask(&[1], &[299], 256..512);
        let seen: Vec<usize> = (0..256).filter(|&c| mask[c] == MASK_KEEP).collect();
        assert_eq!(seen, vec![40, 41, 42, 43]);
        // Sequence 0 is untouched by sequence 1.
        assert_eq!(kv.attention_spans(&[0])[0].window_cells, 0..256);
    }

    /// A batch may carry the region's cells less the window's, plus one: the rows
    /// after that would overwrite what the batch's first row still sees.
    #[test]
    fn window_cells_refuse_a_batch_that_would_overwrite_what_it_sees() {
        let mut kv = KvCache::new_in(&tiny_swa(), 0..2, 2048, 2, 8, KvTypes::default(), None).unwrap();
        run(&mut kv, 0, 0..256, 64);
        let too_many: Vec<i32> = (256..256 + 254).collect();
        let err = kv.claim(&[0; 254], &too_many).unwrap_err().to_string();
        assert!(err.contains("rows 256..=509 in one batch are more than"), "{err}");
        assert_eq!(kv.n_used(), 256, "a refused claim changes nothing");
        assert_eq!(kv.window_slack(), Some(253));
        kv.claim(&[0; 253], &too_many[..253]).unwrap();
    }

    /// A sequence cut back within the slack continues in the cells a fresh run uses;
    /// cut back further, its next claim says to recompute it, and it can from 0.
    #[test]
    fn window_cells_continue_after_short_cuts_and_refuse_long_ones() {
        let mut kv = KvCache::new_in(&tiny_swa(), 0..2, 2048, 2, 8, KvTypes::default(), None).unwrap();
        run(&mut kv, 0, 0..600, 8);
        // Positions 344..=599 remain; 400 sees 397..=399.
        kv.truncate_seq(0, 400);
        assert_eq!(run(&mut kv, 0, 400..402, 2), vec![400 % 256, 401 % 256]);
        assert_eq!(kv.attention_spans(&[0])[0].window_cells, 0..256);
        kv.truncate_seq(0, 340);
        let err = kv.claim(&[0], &[340]).unwrap_err().to_string();
        assert!(
            err.contains("cannot continue at position 340") && err.contains("positions 337..=339"),
            "{err}"
        );
        kv.clear_seq(0);
        assert_eq!(run(&mut kv, 0, 0..3, 3), vec![0, 1, 2]);
        assert_eq!(kv.attention_spans(&[0])[0].window_cells, 0..256);
    }

    /// Without regions (sequences sharing every cell), window layers keep a cell for
    /// every token, as before.
    #[test]
    fn window_layers_without_regions_keep_every_token() {
        let mut kv = KvCache::new_in(&tiny_swa(), 0..2, 512, 0, 8, KvTypes::default(), None).unwrap();
        assert_eq!(kv.window_capacity(), None);
        assert_eq!(kv.bytes(), 2 * 8 * 2 * 512);
        assert_eq!(kv.claim(&[0], &[0]).unwrap().window, None);
    }

    /// Llama 4's chunks in a window cache: a row at the start of a chunk sees nothing
    /// before it, so a sequence may be cut back to a chunk start whatever was
    /// overwritten; inside a chunk, only while the chunk's earlier positions remain.
    #[test]
    fn chunked_window_cells_continue_from_chunk_starts() {
        let hp = HParams {
            n_swa: 200,
            swa_type: crate::hparams::SwaType::Chunked,
            ..tiny_swa()
        };
        let mut kv = KvCache::new_in(&hp, 0..2, 4096, 1, 56, KvTypes::default(), None).unwrap();
        assert_eq!(kv.window_capacity(), Some(256), "200 + 56 cells");
        let cells = run(&mut kv, 0, 0..900, 8);
        assert!(cells.iter().enumerate().all(|(p, &c)| c == (p % 256) as i64));
        // Positions 644..=899 remain; 610 would see 600..=609, overwritten.
        kv.truncate_seq(0, 610);
        let err = kv.claim(&[0], &[610]).unwrap_err().to_string();
        assert!(err.contains("positions 600..=609"), "{err}");
        kv.truncate_seq(0, 600);
        assert_eq!(run(&mut kv, 0, 600..610, 5), (88..98).collect::<Vec<i64>>());
        let mask = kv.window_mask(&[0], &[609], 0..256);
        let seen: Vec<usize> = (0..256).filter(|&c| mask[c] == MASK_KEEP).collect();
        assert_eq!(seen, (88..98).collect::<Vec<usize>>(), "its own chunk only");
    }
}

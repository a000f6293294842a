//! Loading exactly the tensors one stage needs, straight from the mmap'd GGUF.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use baton_ggml::{Buffer, Context, DType, ExtraBufferType, MappedBuffer, MappedFile, Tensor, TensorId};
use baton_gguf::Gguf;

use crate::hparams::{Arch, HParams};
use crate::ModelError;

/// A GGUF file, memory-mapped and parsed (header, metadata and tensor index only).
pub struct ModelFile {
    path: PathBuf,
    map: Arc<MappedFile>,
    gguf: Gguf,
    hparams: HParams,
}

impl ModelFile {
    /// Maps and parses `path`; fails with a clear error for anything that is not a
    /// supported GGUF model.
    pub fn open(path: &Path) -> Result<Arc<ModelFile>, ModelError> {
        let map = Arc::new(MappedFile::open(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?);
        let gguf = Gguf::parse(map.bytes())?;
        let hparams = HParams::from_gguf(&gguf)?;
        Ok(Arc::new(ModelFile {
            path: path.to_path_buf(),
            map,
            gguf,
            hparams,
        }))
    }

    /// The hyper-parameters.
    pub fn hparams(&self) -> &HParams {
        &self.hparams
    }

    /// The parsed header and tensor index.
    pub fn gguf(&self) -> &Gguf {
        &self.gguf
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.bytes()
    }

    /// Start address of the mapping (to find its resident pages).
    pub fn map_address(&self) -> usize {
        self.map.address()
    }

    /// Bytes of the tensors of layer `layer` (`blk.{layer}.*`).
    pub fn layer_bytes(&self, layer: usize) -> u64 {
        let prefix = format!("blk.{layer}.");
        self.gguf
            .tensors
            .iter()
            .filter(|t| t.name.starts_with(&prefix))
            .map(|t| t.n_bytes)
            .sum()
    }
}

/// The weights of one transformer layer, as handles of type `T`. Optional tensors
/// depend on the architecture. Stored as [`TensorId`]s, used as [`Tensor`]s.
#[derive(Clone, Copy, Debug)]
pub struct LayerWeights<T> {
    pub attn_norm: T,
    pub wq: T,
    pub wk: T,
    pub wv: T,
    pub wo: T,
    pub bq: Option<T>,
    pub bk: Option<T>,
    pub bv: Option<T>,
    pub bo: Option<T>,
    pub q_norm: Option<T>,
    pub k_norm: Option<T>,
    pub attn_post_norm: Option<T>,
    pub ffn_norm: T,
    pub ffn_gate: T,
    pub ffn_up: T,
    pub ffn_down: T,
    pub ffn_post_norm: Option<T>,
}

/// A layer's weights ready for graph building.
pub type LayerTensors<'w> = LayerWeights<Tensor<'w>>;

impl<T: Copy> LayerWeights<T> {
    fn map<U>(&self, f: impl Fn(T) -> U) -> LayerWeights<U> {
        LayerWeights {
            attn_norm: f(self.attn_norm),
            wq: f(self.wq),
            wk: f(self.wk),
            wv: f(self.wv),
            wo: f(self.wo),
            bq: self.bq.map(&f),
            bk: self.bk.map(&f),
            bv: self.bv.map(&f),
            bo: self.bo.map(&f),
            q_norm: self.q_norm.map(&f),
            k_norm: self.k_norm.map(&f),
            attn_post_norm: self.attn_post_norm.map(&f),
            ffn_norm: f(self.ffn_norm),
            ffn_gate: f(self.ffn_gate),
            ffn_up: f(self.ffn_up),
            ffn_down: f(self.ffn_down),
            ffn_post_norm: self.ffn_post_norm.map(&f),
        }
    }
}

/// The tensors of a stage, bound to the mapped file.
pub struct StageWeights {
    // Field order matters for drop: tensor handles point into the contexts, tensor
    // data into `file`'s mapping (through `mapped`) or into the repack buffers.
    ctx: Context,
    /// Holds the mapping for the tensors placed in it; never read directly.
    _mapped: MappedBuffer,
    repacked: Vec<Repacked>,
    /// Per layer of the stage (index `layer - first layer`).
    layers: Vec<LayerWeights<TensorId>>,
    first_layer: usize,
    bytes: u64,
    file: Arc<ModelFile>,
}

/// Weights copied into one of ggml's repacking buffer types.
struct Repacked {
    ctx: Context,
    buffer: Option<Buffer>,
}

/// Which tensors a stage holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSpan {
    /// Global indices of the layers it computes.
    pub layers: Range<usize>,
    /// Whether it embeds tokens (first stage).
    pub first: bool,
    /// Whether it produces logits (last stage).
    pub last: bool,
}

impl StageWeights {
    /// Creates the stage's tensors with the shapes `hparams` implies and checks them
    /// against the file's index (name, shape, type). Matrices that one of ggml's
    /// repacking buffer types supports are copied into it when `repack` is set (what
    /// llama.cpp does by default, so results stay identical to it); every other tensor
    /// points straight into the mapping.
    pub fn load(file: Arc<ModelFile>, span: &StageSpan, repack: bool) -> Result<StageWeights, ModelError> {
        let plan = tensor_names(&file, span);
        let extra = if repack { ExtraBufferType::cpu() } else { Vec::new() };
        let ctx = Context::new(plan.len() + 1, 0);
        let mut repacked: Vec<Repacked> = extra
            .iter()
            .map(|_| Repacked {
                ctx: Context::new(plan.len() + 1, 0),
                buffer: None,
            })
            .collect();
        let mut bytes = 0;
        // (tensor, source in the file, group: None = mapped, Some(i) = extra[i])
        let mut placed = Vec::new();
        for (name, shape, source) in &plan {
            let info = file
                .gguf
                .tensor(source)
                .ok_or_else(|| ModelError::MissingTensor(source.clone()))?;
            let dims: Vec<i64> = info.dims.iter().map(|&d| d as i64).collect();
            if &dims != shape {
                return Err(ModelError::WrongShape {
                    tensor: source.clone(),
                    expected: shape.clone(),
                    found: dims,
                });
            }
            // Vectors (norms, biases, RoPE factors) are f32 in every llama.cpp GGUF and
            // are used in element-wise ops; matrices must be types ggml can multiply by.
            let dtype = DType(info.ggml_type.id());
            let ok = if dims.len() == 1 {
                dtype == DType::F32
            } else {
                dtype.can_mul_mat()
            };
            if !ok {
                let expected = if dims.len() == 1 {
                    "f32"
                } else {
                    "a float or quantized matrix type"
                };
                return Err(ModelError::UnsupportedType {
                    tensor: source.clone(),
                    dtype: info.ggml_type.name().into(),
                    expected,
                });
            }
            let tensor = ctx.new_tensor(dtype, &dims).named(name);
            // The token embedding is read by get_rows, everything else 2-d by mul_mat.
            let group = (dims.len() == 2 && name != "token_embd.weight")
                .then(|| extra.iter().position(|buft| buft.supports_mul_mat(tensor)))
                .flatten();
            if let Some(g) = group {
                repacked[g].ctx.new_tensor(dtype, &dims).named(name);
            }
            placed.push((name.clone(), info.offset as usize, info.n_bytes as usize, group));
            bytes += info.n_bytes;
        }
        let mapped = MappedBuffer::new(file.map.clone())?;
        for (g, group) in repacked.iter_mut().enumerate() {
            if placed.iter().any(|p| p.3 == Some(g)) {
                group.buffer = Some(extra[g].alloc(&group.ctx)?);
                tracing::debug!(buffer = extra[g].name(), "repacking weights");
            }
        }
        for (name, offset, n_bytes, group) in &placed {
            match group {
                None => mapped.place(named(&ctx, name)?, *offset)?,
                Some(g) => {
                    let bytes = file
                        .bytes()
                        .get(*offset..offset + n_bytes)
                        .ok_or_else(|| ModelError::MissingTensor(name.clone()))?;
                    named(&repacked[*g].ctx, name)?.write_bytes(bytes)?;
                    file.map.release(*offset, *n_bytes);
                }
            }
        }
        let mut weights = StageWeights {
            ctx,
            _mapped: mapped,
            repacked,
            layers: Vec::new(),
            first_layer: span.layers.start,
            bytes,
            file,
        };
        weights.layers = span
            .layers
            .clone()
            .map(|l| weights.layer_ids(l))
            .collect::<Result<_, _>>()?;
        Ok(weights)
    }

    /// Bytes held in repacking buffers (copies, not mapped pages).
    pub fn repacked_bytes(&self) -> usize {
        self.repacked
            .iter()
            .filter_map(|r| r.buffer.as_ref())
            .map(|b| b.size())
            .sum()
    }

    /// The context a tensor named `name` computes from: its repacked copy if any.
    fn lookup(&self, name: &str) -> Option<(Tensor<'_>, &Context)> {
        for group in self.repacked.iter().filter(|g| g.buffer.is_some()) {
            if let Some(t) = group.ctx.get_tensor(name) {
                return Some((t, &group.ctx));
            }
        }
        self.ctx.get_tensor(name).map(|t| (t, &self.ctx))
    }

    fn get_tensor(&self, name: &str) -> Result<Tensor<'_>, ModelError> {
        self.opt(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    fn opt(&self, name: &str) -> Option<Tensor<'_>> {
        self.lookup(name).map(|(t, _)| t)
    }

    fn id(&self, name: &str) -> Option<TensorId> {
        self.lookup(name).map(|(t, ctx)| ctx.id_of(t))
    }

    fn resolve(&self, id: TensorId) -> Tensor<'_> {
        let ctx = self
            .repacked
            .iter()
            .map(|g| &g.ctx)
            .find(|c| c.owns(id))
            .unwrap_or(&self.ctx);
        ctx.tensor(id)
    }

    /// The token embedding (first stage, or a last stage with tied output).
    pub fn token_embd(&self) -> Result<Tensor<'_>, ModelError> {
        self.get_tensor("token_embd.weight")
    }

    /// The final norm (last stage).
    pub fn output_norm(&self) -> Result<Tensor<'_>, ModelError> {
        self.get_tensor("output_norm.weight")
    }

    /// The output projection (a second view of the token embedding when tied).
    pub fn output(&self) -> Result<Tensor<'_>, ModelError> {
        self.get_tensor("output.weight")
    }

    /// Llama 3 RoPE frequency factors, when the model has them.
    pub fn rope_freqs(&self) -> Option<Tensor<'_>> {
        self.opt("rope_freqs.weight")
    }

    /// The weights of global layer `layer` (one of the stage's).
    pub fn layer(&self, layer: usize) -> LayerTensors<'_> {
        self.layers[layer - self.first_layer].map(|id| self.resolve(id))
    }

    fn layer_ids(&self, layer: usize) -> Result<LayerWeights<TensorId>, ModelError> {
        let o = |n: &str| self.id(&format!("blk.{layer}.{n}"));
        let t = |n: &str| o(n).ok_or_else(|| ModelError::MissingTensor(format!("blk.{layer}.{n}")));
        Ok(LayerWeights {
            attn_norm: t("attn_norm.weight")?,
            wq: t("attn_q.weight")?,
            wk: t("attn_k.weight")?,
            wv: t("attn_v.weight")?,
            wo: t("attn_output.weight")?,
            bq: o("attn_q.bias"),
            bk: o("attn_k.bias"),
            bv: o("attn_v.bias"),
            bo: o("attn_output.bias"),
            q_norm: o("attn_q_norm.weight"),
            k_norm: o("attn_k_norm.weight"),
            attn_post_norm: o("post_attention_norm.weight"),
            ffn_norm: t("ffn_norm.weight")?,
            ffn_gate: t("ffn_gate.weight")?,
            ffn_up: t("ffn_up.weight")?,
            ffn_down: t("ffn_down.weight")?,
            ffn_post_norm: o("post_ffw_norm.weight"),
        })
    }

    /// Bytes of weights this stage uses (what it will have resident once computed).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The model file.
    pub fn file(&self) -> &Arc<ModelFile> {
        &self.file
    }
}

/// The file tensors a stage reads (what a worker without the file must receive).
pub fn stage_tensor_sources(file: &ModelFile, span: &StageSpan) -> Vec<String> {
    let mut sources: Vec<String> = tensor_names(file, span)
        .into_iter()
        .map(|(_, _, source)| source)
        .collect();
    sources.sort();
    sources.dedup();
    sources
}

/// Every tensor a stage needs: its name in the stage, the shape it must have (`ne[0]`
/// first) and the file tensor it reads (a tied output reads `token_embd.weight`).
fn tensor_names(file: &ModelFile, span: &StageSpan) -> Vec<(String, Vec<i64>, String)> {
    let hp = &file.hparams;
    let gguf = &file.gguf;
    let (embd, vocab, ff) = (hp.n_embd as i64, hp.n_vocab as i64, hp.n_ff as i64);
    let q_dim = (hp.head_dim_k * hp.n_head) as i64;
    let k_dim = hp.n_embd_k_gqa() as i64;
    let v_dim = hp.n_embd_v_gqa() as i64;
    let o_dim = (hp.head_dim_v * hp.n_head) as i64;
    let mut names: Vec<(String, Vec<i64>, String)> = Vec::new();
    let mut push = |name: &str, shape: Vec<i64>, source: &str| names.push((name.into(), shape, source.into()));
    if span.first {
        push("token_embd.weight", vec![embd, vocab], "token_embd.weight");
    }
    if span.last {
        push("output_norm.weight", vec![embd], "output_norm.weight");
        let tied = gguf.tensor("output.weight").is_none();
        push(
            "output.weight",
            vec![embd, vocab],
            if tied { "token_embd.weight" } else { "output.weight" },
        );
    }
    if hp.arch == Arch::Llama && gguf.tensor("rope_freqs.weight").is_some() {
        push(
            "rope_freqs.weight",
            vec![hp.rope.n_dims as i64 / 2],
            "rope_freqs.weight",
        );
    }
    for layer in span.layers.clone() {
        let mut add = |n: &str, shape: Vec<i64>| {
            let name = format!("blk.{layer}.{n}");
            names.push((name.clone(), shape, name))
        };
        add("attn_norm.weight", vec![embd]);
        add("attn_q.weight", vec![embd, q_dim]);
        add("attn_k.weight", vec![embd, k_dim]);
        add("attn_v.weight", vec![embd, v_dim]);
        add("attn_output.weight", vec![o_dim, embd]);
        add("ffn_norm.weight", vec![embd]);
        add("ffn_gate.weight", vec![embd, ff]);
        add("ffn_up.weight", vec![embd, ff]);
        add("ffn_down.weight", vec![ff, embd]);
        let head = hp.head_dim_k as i64;
        let mut extra: Vec<(&str, Vec<i64>)> = Vec::new();
        match hp.arch {
            Arch::Qwen2 => {
                extra.push(("attn_q.bias", vec![q_dim]));
                extra.push(("attn_k.bias", vec![k_dim]));
                extra.push(("attn_v.bias", vec![v_dim]));
            }
            Arch::Qwen3 => {
                extra.push(("attn_q_norm.weight", vec![head]));
                extra.push(("attn_k_norm.weight", vec![head]));
            }
            Arch::Gemma3 => {
                extra.push(("attn_q_norm.weight", vec![head]));
                extra.push(("attn_k_norm.weight", vec![head]));
                extra.push(("post_attention_norm.weight", vec![embd]));
                extra.push(("post_ffw_norm.weight", vec![embd]));
            }
            Arch::Llama => {
                // Biases are optional in llama GGUFs; take them when present.
                for (n, shape) in [
                    ("attn_q.bias", vec![q_dim]),
                    ("attn_k.bias", vec![k_dim]),
                    ("attn_v.bias", vec![v_dim]),
                    ("attn_output.bias", vec![embd]),
                ] {
                    if gguf.tensor(&format!("blk.{layer}.{n}")).is_some() {
                        extra.push((n, shape));
                    }
                }
            }
        }
        for (n, shape) in extra {
            add(n, shape);
        }
    }
    names
}

fn named<'c>(ctx: &'c Context, name: &str) -> Result<Tensor<'c>, ModelError> {
    ctx.get_tensor(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
}

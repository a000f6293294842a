//! Loading exactly the tensors one stage needs, straight from the mmap'd GGUF.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use baton_ggml::{Buffer, BufferType, Context, DType, Device, MappedBuffer, MappedFile, Tensor, TensorId, WeightOp};
use baton_gguf::{Gguf, TensorInfo};

use crate::hparams::HParams;
use crate::names::{EndTensor, LayerTensor};
use crate::tensors::{self, Presence, TensorKind, TensorSpec, Use};
use crate::tp::{Cut, TpSplit};
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

    /// Bytes of the tensors a stage holds for the model's ends: the first stage's
    /// (`first`) and the last stage's (`last`), as the architecture lists them
    /// ([`tensors::ends`]: embedding, output norm and projection, and what else the
    /// architecture ends with). A tied output projection counts the embedding it reads.
    pub fn end_bytes(&self, first: bool, last: bool) -> u64 {
        let in_file = |name: &str| self.gguf.tensor(name).is_some();
        tensors::ends(&self.hparams, first, last, &in_file)
            .iter()
            .filter_map(|spec| Some(self.gguf.tensor(&spec.source)?.n_bytes))
            .sum()
    }

    /// Bytes of layer `layer`'s weights one token reads: all of them, except that of
    /// each expert stack only the share of the experts a token uses
    /// (`n_expert_used / n_expert`).
    pub fn layer_work_bytes(&self, layer: usize) -> u64 {
        let hp = &self.hparams;
        let has = |name: &str| self.gguf.tensor(&format!("blk.{layer}.{name}")).is_some();
        tensors::layer(hp, layer, &has)
            .iter()
            .filter_map(|spec| {
                let bytes = self.gguf.tensor(&spec.source)?.n_bytes;
                Some(match spec.usage {
                    Use::Experts => bytes * hp.moe.n_expert_used as u64 / hp.moe.n_expert.max(1) as u64,
                    _ => bytes,
                })
            })
            .sum()
    }
}

/// The weights of one layer of a stage, ready for graph building: looked up by which
/// tensor of the layer they are, among those the architecture listed.
#[derive(Clone, Copy)]
pub struct LayerTensors<'w> {
    weights: &'w StageWeights,
    layer: usize,
    /// Indexed by [`LayerTensor`]: the id of each the stage holds.
    ids: &'w [Option<TensorId>],
}

impl<'w> LayerTensors<'w> {
    /// The layer's `tensor`, if the file has it.
    pub fn opt(&self, tensor: LayerTensor) -> Option<Tensor<'w>> {
        self.ids[tensor as usize].map(|id| self.weights.resolve(id))
    }

    /// The layer's `tensor`, which its architecture lists as required (so the loader
    /// made sure it is there).
    ///
    /// # Panics
    /// When the architecture's graph uses a tensor its tensor list does not require: a
    /// bug in that architecture's file, never something a model file can cause.
    pub fn get(&self, tensor: LayerTensor) -> Tensor<'w> {
        self.opt(tensor).unwrap_or_else(|| {
            panic!(
                "layer {} has no tensor '{tensor}': the architecture's graph uses a tensor its list does not require",
                self.layer
            )
        })
    }
}

/// The tensors of a stage, bound to the mapped file.
pub struct StageWeights {
    // Field order matters for drop: tensor handles point into the contexts, tensor
    // data into `file`'s mapping (through `mapped`) or into the groups' buffers.
    ctx: Context,
    /// Holds the mapping for the tensors placed in it; never read directly.
    _mapped: MappedBuffer,
    groups: Vec<Group>,
    /// Per layer of the stage (index `layer - first layer`), indexed by [`LayerTensor`].
    layers: Vec<Vec<Option<TensorId>>>,
    first_layer: usize,
    bytes: u64,
    file: Arc<ModelFile>,
}

/// Where a tensor's bytes come from.
enum Data {
    /// This offset of the mapped file.
    Mapped(usize),
    /// A slice copied (or decoded) out of the file.
    Owned(Vec<u8>),
}

/// A tensor of the stage and where it goes.
struct Placed {
    name: String,
    data: Data,
    /// Bytes of the whole file tensor.
    n_bytes: usize,
    /// `None`: the mapping; `Some(g)`: the buffer of `StageWeights::groups[g]`.
    group: Option<usize>,
}

/// Weights copied out of the mapping into memory of one buffer type: the device's own
/// memory, one of ggml's CPU repacking buffer types, or (last) a plain CPU buffer
/// holding tensor-parallel slices that no other type takes.
struct Group {
    ctx: Context,
    buft: BufferType,
    /// Whether the memory is the stage's device's (not the CPU's).
    on_device: bool,
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
    /// against the file's index (name, shape, type), and places them for `device` as
    /// llama.cpp places a layer's weights (see [`candidates`]): each in the first
    /// buffer type that supports its use, copied there from the mapping; every other
    /// tensor points straight into the mapping (on the CPU).
    pub fn load(
        file: Arc<ModelFile>,
        span: &StageSpan,
        repack: bool,
        device: Device,
    ) -> Result<StageWeights, ModelError> {
        Self::load_split(file, span, repack, device, None)
    }

    /// [`load`](Self::load) for one member of a tensor-parallel group: each tensor is
    /// cut as `split` says ([`TpSplit::cut`]); the slices are copied out of the
    /// mapping (into the buffer types of [`candidates`] where they fit, else a plain
    /// CPU buffer).
    pub fn load_split(
        file: Arc<ModelFile>,
        span: &StageSpan,
        repack: bool,
        device: Device,
        split: Option<&TpSplit>,
    ) -> Result<StageWeights, ModelError> {
        let plan = stage_plan(&file, span, true)?;
        let mut bufts = candidates(device, repack);
        // Last, one plain CPU buffer for slices nothing else takes.
        let copied = bufts.len();
        bufts.push((Device::cpu().buffer_type(), false));
        let ctx = Context::new(plan.len() + 1, 0);
        let mut groups: Vec<Group> = bufts
            .iter()
            .map(|&(buft, on_device)| Group {
                ctx: Context::new(plan.len() + 1, 0),
                buft,
                on_device,
                buffer: None,
            })
            .collect();
        let n_used = file.hparams.moe.n_expert_used;
        let mut bytes = 0;
        let mut placed: Vec<Placed> = Vec::new();
        for spec in &plan {
            let (info, dtype, dims) = file_tensor(&file.gguf, spec)?;
            let cut = match split {
                Some(split) => split.cut(&file.hparams, &spec.split),
                None => Cut::Whole,
            };
            let source = file
                .bytes()
                .get(info.offset as usize..(info.offset + info.n_bytes) as usize)
                .ok_or_else(|| ModelError::MissingTensor(spec.source.clone()))?;
            let (dtype, dims, data) = match slice(&spec.name, dtype, &dims, source, &cut)? {
                Some(sliced) => sliced,
                None if cut == Cut::Skip => continue,
                None => (dtype, dims, Data::Mapped(info.offset as usize)),
            };
            let tensor = ctx.new_tensor(dtype, &dims).named(&spec.name);
            // The token embedding stays in the mapping on the CPU (llama.cpp's input
            // layer): a step reads only its tokens' rows.
            let op = match spec.usage {
                Use::MulMat => Some(WeightOp::MulMat),
                Use::Experts => Some(WeightOp::MulMatId { n_used }),
                Use::Elementwise => Some(WeightOp::Elementwise),
                Use::Embedding | Use::ExpertIds => None,
            };
            let mut group = op.and_then(|op| {
                groups[..copied]
                    .iter()
                    .position(|g| (g.on_device || op != WeightOp::Elementwise) && g.buft.supports(tensor, op))
            });
            if group.is_none() && matches!(data, Data::Owned(_)) {
                group = Some(copied);
            }
            if let Some(g) = group {
                groups[g].ctx.new_tensor(dtype, &dims).named(&spec.name);
            }
            bytes += match &data {
                Data::Mapped(_) => info.n_bytes,
                Data::Owned(owned) => owned.len() as u64,
            };
            placed.push(Placed {
                name: spec.name.clone(),
                data,
                n_bytes: info.n_bytes as usize,
                group,
            });
        }
        let mut mapped = MappedBuffer::new(file.map.clone())?;
        mapped.mark_weights();
        for (g, group) in groups.iter_mut().enumerate() {
            if placed.iter().any(|p| p.group == Some(g)) {
                let mut buffer = group.buft.alloc(&group.ctx)?;
                buffer.mark_weights();
                group.buffer = Some(buffer);
                tracing::debug!(buffer = group.buft.name(), "copying weights");
            }
        }
        for p in &placed {
            match (&p.data, p.group) {
                (Data::Mapped(offset), None) => mapped.place(named(&ctx, &p.name)?, *offset)?,
                (Data::Mapped(offset), Some(g)) => {
                    let bytes = file
                        .bytes()
                        .get(*offset..offset + p.n_bytes)
                        .ok_or_else(|| ModelError::MissingTensor(p.name.clone()))?;
                    named(&groups[g].ctx, &p.name)?.write_bytes(bytes)?;
                    file.map.release(*offset, p.n_bytes);
                }
                (Data::Owned(owned), Some(g)) => named(&groups[g].ctx, &p.name)?.write_bytes(owned)?,
                (Data::Owned(_), None) => unreachable!("copied slices always get a buffer above"),
            }
        }
        if split.is_some() {
            // The slices are copies: the pages read to make them are not needed again.
            for p in placed.iter().filter(|p| matches!(p.data, Data::Owned(_))) {
                if let Some(info) = file.gguf.tensor(plan_source(&plan, &p.name)) {
                    file.map.release(info.offset as usize, info.n_bytes as usize);
                }
            }
        }
        let mut weights = StageWeights {
            ctx,
            _mapped: mapped,
            groups,
            layers: Vec::new(),
            first_layer: span.layers.start,
            bytes,
            file,
        };
        weights.layers = span
            .layers
            .clone()
            .map(|layer| weights.layer_ids(&plan, layer))
            .collect();
        Ok(weights)
    }

    /// The ids of layer `layer`'s tensors in `plan`, indexed by [`LayerTensor`].
    fn layer_ids(&self, plan: &[TensorSpec], layer: usize) -> Vec<Option<TensorId>> {
        let mut ids = vec![None; LayerTensor::ALL.len()];
        for spec in plan {
            if let TensorKind::Layer { layer: l, tensor } = spec.kind {
                if l == layer {
                    ids[tensor as usize] = self.id(&spec.name);
                }
            }
        }
        ids
    }

    /// Bytes held in the CPU's repacking buffers and tensor-parallel slice copies (not
    /// mapped pages).
    pub fn repacked_bytes(&self) -> usize {
        self.copied_bytes(false)
    }

    /// Bytes of weights in the device's own memory (0 on the CPU).
    pub fn device_bytes(&self) -> usize {
        self.copied_bytes(true)
    }

    fn copied_bytes(&self, on_device: bool) -> usize {
        self.groups
            .iter()
            .filter(|g| g.on_device == on_device)
            .filter_map(|g| g.buffer.as_ref())
            .map(|b| b.size())
            .sum()
    }

    /// The context a tensor named `name` computes from: its copy if any.
    fn lookup(&self, name: &str) -> Option<(Tensor<'_>, &Context)> {
        for group in self.groups.iter().filter(|g| g.buffer.is_some()) {
            if let Some(t) = group.ctx.get_tensor(name) {
                return Some((t, &group.ctx));
            }
        }
        self.ctx.get_tensor(name).map(|t| (t, &self.ctx))
    }

    fn opt(&self, name: &str) -> Option<Tensor<'_>> {
        self.lookup(name).map(|(t, _)| t)
    }

    fn id(&self, name: &str) -> Option<TensorId> {
        self.lookup(name).map(|(t, ctx)| ctx.id_of(t))
    }

    fn resolve(&self, id: TensorId) -> Tensor<'_> {
        let ctx = self
            .groups
            .iter()
            .map(|g| &g.ctx)
            .find(|c| c.owns(id))
            .unwrap_or(&self.ctx);
        ctx.tensor(id)
    }

    /// The stage's end tensor `tensor`, if it holds it (the token embedding on the
    /// first stage, the output norm and projection on the last, RoPE frequency factors
    /// where the model has them; a tied output projection is a second view of the token
    /// embedding).
    pub fn end(&self, tensor: EndTensor) -> Option<Tensor<'_>> {
        self.opt(tensor.name())
    }

    /// The stage's end tensor `tensor`, which its span requires (so the loader made
    /// sure it is there).
    ///
    /// # Panics
    /// When a graph reads an end tensor its stage does not hold: a bug in baton, never
    /// something a model file can cause.
    pub fn end_required(&self, tensor: EndTensor) -> Tensor<'_> {
        self.end(tensor)
            .unwrap_or_else(|| panic!("the stage has no tensor '{tensor}': its span does not include that end"))
    }

    /// The weights of global layer `layer` (one of the stage's).
    pub fn layer(&self, layer: usize) -> LayerTensors<'_> {
        LayerTensors {
            weights: self,
            layer,
            ids: &self.layers[layer - self.first_layer],
        }
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

/// Where a stage on `device` may copy weights to, in order of preference, each with
/// whether it is the device's own memory. As llama.cpp: on a device other than the CPU,
/// its own memory first; then, with `repack`, the CPU's repacking buffer types (for
/// weights the device cannot use); whatever fits none is read from the mapping.
fn candidates(device: Device, repack: bool) -> Vec<(BufferType, bool)> {
    let own = (!device.is_cpu()).then(|| (device.buffer_type(), true));
    let extra = if repack { BufferType::cpu_extra() } else { Vec::new() };
    own.into_iter().chain(extra.into_iter().map(|b| (b, false))).collect()
}

/// The file tensors a stage reads (what a worker without the file must receive).
pub fn stage_tensor_sources(file: &ModelFile, span: &StageSpan) -> Vec<String> {
    // Not strict: a file with tensors baton does not know still sends what the stage
    // would read, and the worker's own load then refuses it with the reason.
    let plan = stage_plan(file, span, false).unwrap_or_default();
    let mut sources: Vec<String> = plan.into_iter().map(|spec| spec.source).collect();
    sources.sort();
    sources.dedup();
    sources
}

/// Every tensor a stage reads: the ends it owns and its layers, as the architecture
/// lists them, optional ones only where the file has them. With `strict`, a tensor of
/// one of its layers that the architecture does not list is an error: computing
/// without it would give other results than llama.cpp.
fn stage_plan(file: &ModelFile, span: &StageSpan, strict: bool) -> Result<Vec<TensorSpec>, ModelError> {
    let hp = &file.hparams;
    let gguf = &file.gguf;
    let in_file = |name: &str| gguf.tensor(name).is_some();
    let mut specs = tensors::ends(hp, span.first, span.last, &in_file);
    if strict {
        let all_ends = tensors::ends(hp, true, true, &in_file);
        if let Some(unknown) = gguf
            .tensors
            .iter()
            .find(|t| !t.name.starts_with("blk.") && !all_ends.iter().any(|s| s.source == t.name))
        {
            return Err(ModelError::UnknownTensor {
                tensor: unknown.name.clone(),
                arch: hp.arch.name,
            });
        }
    }
    for layer in span.layers.clone() {
        let prefix = format!("blk.{layer}.");
        let has = |name: &str| in_file(&format!("{prefix}{name}"));
        let listed = tensors::layer(hp, layer, &has);
        if strict {
            if let Some(unknown) = gguf
                .tensors
                .iter()
                .find(|t| t.name.starts_with(&prefix) && !listed.iter().any(|s| s.source == t.name))
            {
                return Err(ModelError::UnknownTensor {
                    tensor: unknown.name.clone(),
                    arch: hp.arch.name,
                });
            }
        }
        specs.extend(
            listed
                .into_iter()
                .filter(|s| s.presence == Presence::Required || in_file(&s.source)),
        );
    }
    Ok(specs)
}

/// The file's tensor `spec.source`, checked against `spec`: its index entry, its type
/// and its shape.
fn file_tensor<'f>(gguf: &'f Gguf, spec: &TensorSpec) -> Result<(&'f TensorInfo, DType, Vec<i64>), ModelError> {
    let info = gguf
        .tensor(&spec.source)
        .ok_or_else(|| ModelError::MissingTensor(spec.source.clone()))?;
    let found: Vec<i64> = info.dims.iter().map(|&d| d as i64).collect();
    // Trailing dimensions of 1 hold no values: converters may write them (Kimi Linear's
    // `[d_conv, 1, channels, 1]` convolutions) where llama.cpp's quantizer drops them.
    let trimmed = |dims: &[i64]| -> usize { dims.len() - dims.iter().skip(1).rev().take_while(|&&d| d == 1).count() };
    if found[..trimmed(&found)] != spec.shape[..trimmed(&spec.shape)] {
        return Err(ModelError::WrongShape {
            tensor: spec.source.clone(),
            expected: spec.shape.clone(),
            found,
        });
    }
    let dims = spec.shape.clone();
    // Norms, biases and other element-wise weights are f32 in every llama.cpp GGUF;
    // matrices must be types ggml can multiply by.
    let dtype = DType(info.ggml_type.id());
    let (ok, expected) = match spec.usage {
        Use::Elementwise => (dtype == DType::F32, "f32"),
        Use::ExpertIds => (dtype == DType::I32, "i32"),
        _ => (dtype.can_mul_mat(), "a float or quantized matrix type"),
    };
    if !ok {
        return Err(ModelError::UnsupportedType {
            tensor: spec.source.clone(),
            dtype: info.ggml_type.name().into(),
            expected,
        });
    }
    Ok((info, dtype, dims))
}

fn plan_source<'p>(plan: &'p [TensorSpec], name: &'p str) -> &'p str {
    plan.iter().find(|s| s.name == name).map_or(name, |s| s.source.as_str())
}

/// The slice `cut` of a tensor `name` of type `dtype` and shape `dims` whose file
/// bytes are `source`: its type, shape and bytes; `None` for a whole tensor (read in
/// place) or a skipped one.
fn slice(
    name: &str,
    dtype: DType,
    dims: &[i64],
    source: &[u8],
    cut: &Cut,
) -> Result<Option<(DType, Vec<i64>, Data)>, ModelError> {
    let bad = |why: String| ModelError::BadConfig(format!("cannot slice '{name}' {dims:?}: {why}"));
    let ne0 = dims[0] as usize;
    let n_rows: usize = dims[1..].iter().map(|&d| d as usize).product();
    let row_bytes = dtype.row_bytes(ne0);
    // Rows only: a slice along the input dimension would round differently from
    // llama.cpp's dot products (see `crate::tp`).
    match cut {
        Cut::Whole | Cut::Skip => Ok(None),
        Cut::Rows(rows) => slice(name, dtype, dims, source, &Cut::RowRanges(vec![rows.clone()])),
        Cut::RowRanges(ranges) if dims.len() == 1 => {
            // A vector (f32, checked by the caller): elements.
            if ranges.iter().any(|r| r.end > ne0) || dtype != DType::F32 {
                return Err(bad(format!("elements {ranges:?}")));
            }
            let bytes: Vec<u8> = ranges
                .iter()
                .flat_map(|r| &source[r.start * 4..r.end * 4])
                .copied()
                .collect();
            Ok(Some((dtype, vec![bytes.len() as i64 / 4], Data::Owned(bytes))))
        }
        Cut::Matrices(matrices) => {
            let [ne0, ne1, ne2] = dims else {
                return Err(bad(format!("matrices {matrices:?} of a {}-d tensor", dims.len())));
            };
            if matrices.end > *ne2 as usize || matrices.is_empty() {
                return Err(bad(format!("matrices {matrices:?}")));
            }
            let matrix_bytes = dtype.row_bytes(*ne0 as usize) * *ne1 as usize;
            let bytes = source[matrices.start * matrix_bytes..matrices.end * matrix_bytes].to_vec();
            Ok(Some((
                dtype,
                vec![*ne0, *ne1, matrices.len() as i64],
                Data::Owned(bytes),
            )))
        }
        Cut::Columns(cols) => {
            if dtype != DType::F32 || dims.len() != 2 || cols.end > ne0 || cols.is_empty() {
                return Err(bad(format!("elements {cols:?} of every row")));
            }
            let mut bytes = Vec::with_capacity(cols.len() * 4 * n_rows);
            for row in 0..n_rows {
                bytes.extend_from_slice(&source[(row * ne0 + cols.start) * 4..(row * ne0 + cols.end) * 4]);
            }
            Ok(Some((dtype, vec![cols.len() as i64, dims[1]], Data::Owned(bytes))))
        }
        Cut::RowRanges(ranges) => {
            // A matrix, or one matrix per expert (`[n, rows, n_expert]`): the same rows of
            // each, contiguous bytes of the file.
            let (per_matrix, matrices) = match dims {
                [_, r] => (*r as usize, 1),
                [_, r, e] => (*r as usize, *e as usize),
                _ => return Err(bad(format!("rows {ranges:?} of a {}-d tensor", dims.len()))),
            };
            let n_kept: usize = ranges.iter().map(|r| r.len()).sum();
            if ranges.iter().any(|r| r.end > per_matrix) || n_kept == 0 || per_matrix * matrices != n_rows {
                return Err(bad(format!("rows {ranges:?}")));
            }
            let mut bytes = Vec::with_capacity(n_kept * row_bytes * matrices);
            for matrix in 0..matrices {
                let at = matrix * per_matrix;
                for rows in ranges {
                    bytes.extend_from_slice(&source[(at + rows.start) * row_bytes..(at + rows.end) * row_bytes]);
                }
            }
            let mut shape = dims.to_vec();
            shape[1] = n_kept as i64;
            Ok(Some((dtype, shape, Data::Owned(bytes))))
        }
    }
}

fn named<'c>(ctx: &'c Context, name: &str) -> Result<Tensor<'c>, ModelError> {
    ctx.get_tensor(name)
        .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each expert's matrix is cut alike: the rows of every expert, in expert order, as
    /// contiguous bytes of each (f32 here: 4 bytes a value, rows of 2).
    #[test]
    fn rows_of_every_experts_matrix() {
        // [2, 3 rows, 2 experts]: expert e, row r holds values 100 e + 10 r + (0, 1).
        let values: Vec<f32> = (0..2)
            .flat_map(|e| (0..3).flat_map(move |r| [100 * e + 10 * r, 100 * e + 10 * r + 1]))
            .map(|v| v as f32)
            .collect();
        let source: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        // `source` as a tensor of shape `dims`, cut: the slice's shape and values.
        let cut = |name: &str, dims: &[i64], cut: &Cut| -> (Vec<i64>, Vec<f32>) {
            let (_, shape, data) = slice(name, DType::F32, dims, &source, cut).unwrap().unwrap();
            let Data::Owned(bytes) = data else {
                panic!("a slice is a copy")
            };
            let values = bytes
                .chunks(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (shape, values)
        };
        let (shape, got) = cut("blk.0.ffn_up_exps.weight", &[2, 3, 2], &Cut::Rows(1..3));
        assert_eq!(shape, vec![2, 2, 2]);
        assert_eq!(got, [10., 11., 20., 21., 110., 111., 120., 121.]);
        let error = |dims: &[i64], rows| match slice("t", DType::F32, dims, &source, &Cut::Rows(rows)) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{dims:?} is not cut"),
        };
        assert!(error(&[2, 3, 2], 2..4).contains("rows [2..4]"));
        assert!(error(&[2, 3, 2, 1], 0..1).contains("4-d tensor"));
        // Biases of every expert, `[2 values, 6 experts]`: the second value of each.
        let (shape, got) = cut("b", &[2, 6], &Cut::Columns(1..2));
        assert_eq!(shape, vec![1, 6]);
        assert_eq!(got, [1., 11., 21., 101., 111., 121.]);
        // A fused projection `[2, 6 rows]`: rows 0 and 3..5, joined in order.
        let (shape, got) = cut("qkv", &[2, 6], &Cut::RowRanges(vec![0..1, 3..5]));
        assert_eq!(shape, vec![2, 3]);
        assert_eq!(got, [0., 1., 100., 101., 110., 111.]);
    }
}

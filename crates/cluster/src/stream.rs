//! Streaming a stage's tensors to a worker that lacks the model file, once: the head's
//! side of the exchange the worker's `receive` module describes (header and tensor
//! index first, then the tensors the worker still lacks, in chunks).

use std::collections::BTreeSet;
use std::time::Instant;

use baton_model::{ModelFile, StageSpan};
use baton_net::Link;
use baton_proto::auth::identity_hash;
use baton_proto::{Message, TensorEntry};
use baton_stage::NodeError;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

/// Bytes per `TensorChunk`: large frames, few of them.
const CHUNK: usize = 8 << 20;

/// Head side: offers a stage's tensors and sends the ones the worker asks for; returns
/// the bytes sent. A progress bar (bytes, rate, ETA) shows on a terminal, one line of
/// `bars` per worker.
pub fn send_stage_tensors(
    file: &ModelFile,
    span: &StageSpan,
    link: &mut dyn Link,
    worker: &str,
    bars: &MultiProgress,
) -> Result<u64, NodeError> {
    let bytes = file.bytes();
    let header = bytes[..file.gguf().data_offset as usize].to_vec();
    let names: BTreeSet<String> = baton_model::stage_tensor_sources(file, span).into_iter().collect();
    let entries: Vec<TensorEntry> = file
        .gguf()
        .tensors
        .iter()
        .filter(|t| names.contains(&t.name))
        .map(|t| {
            let data = &bytes[t.offset as usize..(t.offset + t.n_bytes) as usize];
            TensorEntry {
                name: t.name.clone(),
                offset: t.offset,
                len: t.n_bytes,
                sha256: identity_hash(data),
            }
        })
        .collect();
    link.send(Message::StreamStart {
        header,
        tensors: entries.clone(),
    })?;
    let wanted = match link.recv()? {
        Message::StreamStart { tensors, .. } => tensors,
        Message::Refused { code, reason } => {
            return Err(NodeError::Refused {
                worker: worker.to_string(),
                code,
                reason,
            })
        }
        other => {
            return Err(NodeError::Protocol(format!(
                "expected StreamStart, got {}",
                other.kind()
            )))
        }
    };
    let total: u64 = wanted.iter().map(|e| e.len).sum();
    let bar = bars.add(ProgressBar::new(total).with_message(format!("weights to {worker}")));
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}")
            .expect("the template is valid")
            .progress_chars("=> "),
    );
    let started = Instant::now();
    let mut sent = 0u64;
    for want in &wanted {
        let index = entries
            .iter()
            .position(|e| e.name == want.name)
            .ok_or_else(|| NodeError::Protocol(format!("worker asked for tensor {} it was not offered", want.name)))?;
        let entry = &entries[index];
        let data = &bytes[entry.offset as usize..(entry.offset + entry.len) as usize];
        for (i, chunk) in data.chunks(CHUNK).enumerate() {
            let offset = (i * CHUNK) as u64;
            link.send(Message::TensorChunk {
                index: index as u32,
                offset,
                data: chunk.to_vec(),
            })?;
            sent += chunk.len() as u64;
            bar.set_position(sent);
        }
    }
    bar.finish_and_clear();
    if sent > 0 {
        let secs = started.elapsed().as_secs_f64();
        tracing::info!(%worker, "sent {:.1} MiB of weights in {secs:.1} s", sent as f64 / 1048576.0);
    }
    Ok(sent)
}

//! Streaming a stage's tensors to a worker that lacks the model file, once.
//!
//! The worker rebuilds a *sparse* copy of the GGUF: the header at offset 0 and the
//! received tensors at their own offsets; the other tensors stay holes that take no
//! disk and are never read. The copy loads exactly like the original file. Each tensor
//! is verified against the head's SHA-256 before it is recorded, so a later start
//! with the same range receives no weight bytes at all.
//!
//! ```text
//! head                                          worker
//!   LoadPlan{stream: true}                      →
//!   StreamStart{header, every stage tensor}     →
//!                                               ← StreamStart{[], tensors still missing}
//!   TensorChunk{index, offset, data} …          →   (verify, write, record)
//! ```

use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Instant;

use baton_model::{ModelFile, StageSpan};
use baton_net::Link;
use baton_proto::auth::identity_hash;
use baton_proto::{Message, ModelRef, TensorEntry};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

use super::models::ModelDir;
use crate::NodeError;

/// Bytes per `TensorChunk`: large frames, few of them.
const CHUNK: usize = 8 << 20;

/// Worker side: receives what is missing of a stage; returns the sparse file's path and
/// the tensor bytes received.
pub fn receive_stage_tensors(
    models: &ModelDir,
    model: &ModelRef,
    link: &mut dyn Link,
) -> Result<(PathBuf, u64), NodeError> {
    let (header, entries) = match link.recv()? {
        Message::StreamStart { header, tensors } => (header, tensors),
        other => {
            return Err(NodeError::Protocol(format!(
                "expected StreamStart, got {}",
                other.kind()
            )))
        }
    };
    if identity_hash(&header) != model.identity {
        return Err(NodeError::Protocol(
            "the streamed header does not match the model's identity".into(),
        ));
    }
    for entry in &entries {
        let end = entry.offset.checked_add(entry.len);
        if entry.offset < header.len() as u64 || end.is_none_or(|end| end > model.size) {
            return Err(NodeError::Protocol(format!(
                "tensor {} lies outside the model file",
                entry.name
            )));
        }
    }
    let path = models.partial_path(&model.identity);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|source| NodeError::File {
            path: path.clone(),
            action: "open",
            source,
        })?;
    let io = |source| NodeError::File {
        path: path.clone(),
        action: "write",
        source,
    };
    if file.metadata().map_err(io)?.len() != model.size {
        file.set_len(model.size).map_err(io)?;
    }
    file.write_all_at(&header, 0).map_err(io)?;

    let mut have = models.partial_tensors(&model.identity);
    let missing: Vec<TensorEntry> = entries.iter().filter(|e| !have.contains(&e.name)).cloned().collect();
    link.send(Message::StreamStart {
        header: Vec::new(),
        tensors: missing.clone(),
    })?;

    let total: u64 = missing.iter().map(|e| e.len).sum();
    let mut received = 0u64;
    let started = Instant::now();
    let mut last_report = Instant::now();
    for entry in &missing {
        let mut hasher = Sha256::new();
        let mut done = 0u64;
        while done < entry.len {
            let (index, offset, data) = match link.recv()? {
                Message::TensorChunk { index, offset, data } => (index, offset, data),
                other => {
                    return Err(NodeError::Protocol(format!(
                        "expected TensorChunk, got {}",
                        other.kind()
                    )))
                }
            };
            let expected = entries.iter().position(|e| e.name == entry.name);
            if Some(index as usize) != expected || offset != done || done + data.len() as u64 > entry.len {
                return Err(NodeError::Protocol(format!(
                    "out-of-order or oversized chunk for tensor {}",
                    entry.name
                )));
            }
            hasher.update(&data);
            file.write_all_at(&data, entry.offset + done).map_err(io)?;
            done += data.len() as u64;
            received += data.len() as u64;
            if last_report.elapsed().as_secs_f32() >= 1.0 {
                last_report = Instant::now();
                log_progress(received, total, started);
            }
        }
        if <[u8; 32]>::from(hasher.finalize()) != entry.sha256 {
            return Err(NodeError::Protocol(format!(
                "tensor {} failed verification (SHA-256 mismatch)",
                entry.name
            )));
        }
        have.insert(entry.name.clone());
        models.record_partial(&model.identity, &have)?;
    }
    file.sync_data().map_err(io)?;
    if total > 0 {
        log_progress(received, total, started);
    }
    Ok((path, received))
}

fn log_progress(done: u64, total: u64, started: Instant) {
    let secs = started.elapsed().as_secs_f64().max(1e-3);
    let rate = done as f64 / secs;
    let eta = (total - done.min(total)) as f64 / rate.max(1.0);
    tracing::info!(
        "received {:.1} / {:.1} MiB of weights, {:.1} MiB/s, ETA {:.0} s",
        done as f64 / 1048576.0,
        total as f64 / 1048576.0,
        rate / 1048576.0,
        eta
    );
}

/// Head side: offers a stage's tensors and sends the ones the worker asks for; returns
/// the bytes sent. A progress bar (bytes, rate, ETA) shows on a terminal.
pub fn send_stage_tensors(
    file: &ModelFile,
    span: &StageSpan,
    link: &mut dyn Link,
    worker: &str,
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
    let bar = ProgressBar::new(total).with_message(format!("weights to {worker}"));
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

//! Streaming a stage's tensors to a worker that lacks the model file, once: the head's
//! side of the exchange the worker's `receive` module describes (header and tensor
//! index first, then the tensors the worker still lacks, in chunks).

use std::collections::BTreeSet;
use std::time::Instant;

use baton_model::{ModelFile, StageSpan};
use baton_net::{Link, LinkExt};
use baton_proto::auth::identity_hash;
use baton_proto::{Control, Conversation, Message, TensorEntry};
use baton_stage::NodeError;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

/// Bytes per `TensorChunk`: large frames, few of them.
const CHUNK: usize = 8 << 20;

/// Head side: offers a stage's tensors and sends the ones the worker asks for, sharing
/// them with `holders` (ring addresses of workers that hold the whole file): each
/// holder is given a share to send the worker itself (`FetchFrom`), balanced by bytes,
/// so the worker receives from every source at once. Returns the bytes the head sent.
/// A progress bar (bytes, rate, ETA) shows on a terminal, one line of `bars` per worker.
/// Tensor hashes are kept in `cache` (see `baton_stage::models::tensor_hashes`).
pub fn send_stage_tensors(
    file: &ModelFile,
    span: &StageSpan,
    link: &mut dyn Link,
    worker: &str,
    holders: &[String],
    bars: &MultiProgress,
    cache: &std::path::Path,
) -> Result<u64, NodeError> {
    let bytes = file.bytes();
    let header = bytes[..file.gguf().data_offset as usize].to_vec();
    let names: BTreeSet<String> = baton_model::stage_tensor_sources(file, span).into_iter().collect();
    let tensors: Vec<_> = file.gguf().tensors.iter().filter(|t| names.contains(&t.name)).collect();
    let places: Vec<(&str, u64, u64)> = tensors.iter().map(|t| (t.name.as_str(), t.offset, t.n_bytes)).collect();
    let identity = identity_hash(&header);
    let hashes = baton_stage::models::tensor_hashes(file.path(), &identity, cache, bytes, &places);
    let entries: Vec<TensorEntry> = tensors
        .iter()
        .zip(hashes)
        .map(|(t, sha256)| TensorEntry {
            name: t.name.clone(),
            offset: t.offset,
            len: t.n_bytes,
            sha256,
        })
        .collect();
    link.send(Message::StreamStart {
        header,
        tensors: entries.clone(),
    })?;
    let wanted = match link.recv_as::<Control>()? {
        Control::StreamStart { tensors, .. } => tensors,
        Control::Refused { code, reason } => {
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
    let index_of = |name: &str| {
        entries
            .iter()
            .position(|e| e.name == name)
            .ok_or_else(|| NodeError::Protocol(format!("worker asked for tensor {name} it was not offered")))
    };
    let wanted = wanted
        .iter()
        .map(|w| index_of(&w.name))
        .collect::<Result<Vec<usize>, NodeError>>()?;
    let shares = share_out(
        &wanted,
        |i| entries[i].len,
        1 + holders.len().min(baton_proto::MAX_FETCH_PEERS),
    );
    for (holder, share) in holders.iter().zip(&shares[1..]).filter(|(_, share)| !share.is_empty()) {
        link.send(Message::FetchFrom {
            peer: holder.clone(),
            tensors: share.iter().map(|&i| i as u32).collect(),
        })?;
        let bytes: u64 = share.iter().map(|&i| entries[i].len).sum();
        tracing::info!(%worker, %holder, bytes, "the worker fetches part of its weights from a holder");
    }
    let wanted = &shares[0];
    let total: u64 = wanted.iter().map(|&i| entries[i].len).sum();
    let bar = bars.add(ProgressBar::new(total).with_message(format!("weights to {worker}")));
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}")
            .expect("the template is valid")
            .progress_chars("=> "),
    );
    let started = Instant::now();
    let mut sent = 0u64;
    for &index in wanted {
        let entry = &entries[index];
        let data = &bytes[entry.offset as usize..(entry.offset + entry.len) as usize];
        for (i, chunk) in data.chunks(CHUNK).enumerate() {
            let offset = (i * CHUNK) as u64;
            let result = link.send(Message::TensorChunk {
                index: index as u32,
                offset,
                data: chunk.to_vec(),
            });
            if let Err(e) = result {
                return Err(refusal(link, worker).unwrap_or(e.into()));
            }
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

/// Why the worker refused, when a send failed because it did: a worker that finds a
/// fault in what it receives (a tensor that fails its hash, a header that is not the
/// model's) answers `Refused` and closes, while the head may still be sending.
fn refusal(link: &mut dyn Link, worker: &str) -> Option<NodeError> {
    // A send that failed on this side (the link still up) gets no answer: wait briefly.
    link.set_read_timeout(Some(std::time::Duration::from_secs(1))).ok()?;
    match link.recv_as::<Control>() {
        Ok(Control::Refused { code, reason }) => Some(NodeError::Refused {
            worker: worker.to_string(),
            code,
            reason,
        }),
        _ => None,
    }
}

/// `items` shared among `n` sources so that each sends about as many bytes (`len`):
/// the largest first, each to the source with the fewest bytes so far (the first on a
/// tie). Each share keeps the items' order.
fn share_out(items: &[usize], len: impl Fn(usize) -> u64, n: usize) -> Vec<Vec<usize>> {
    let mut by_size: Vec<usize> = items.to_vec();
    by_size.sort_by_key(|&i| std::cmp::Reverse(len(i)));
    let mut load = vec![0u64; n.max(1)];
    let mut owner = std::collections::BTreeMap::new();
    for i in by_size {
        let source = (0..load.len()).min_by_key(|&s| load[s]).expect("one source at least");
        load[source] += len(i);
        owner.insert(i, source);
    }
    let mut shares = vec![Vec::new(); load.len()];
    for &i in items {
        shares[owner[&i]].push(i);
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::{refusal, share_out};
    use baton_net::{local_pair, Link};
    use baton_proto::{Message, RefusalCode};

    /// A worker that finds a fault mid-stream refuses and closes while the head still
    /// sends: the head reports the worker's reason, not only the broken link; and a
    /// send that failed with the link up waits only a moment for an answer.
    #[test]
    fn a_worker_refusing_mid_stream_is_reported_with_its_reason() {
        let (mut head, mut worker) = local_pair("worker", "head");
        worker
            .send(Message::Refused {
                code: RefusalCode::LoadFailed,
                reason: "tensor b failed verification (SHA-256 mismatch)".into(),
            })
            .unwrap();
        drop(worker);
        assert!(head.send(Message::Shutdown).is_err(), "the worker is gone");
        let err = refusal(&mut head, "w:1").expect("the refusal is read").to_string();
        assert!(
            err.contains("w:1") && err.contains("tensor b failed verification"),
            "{err}"
        );

        let (mut head, _worker) = local_pair("worker", "head");
        let started = std::time::Instant::now();
        assert!(refusal(&mut head, "w:1").is_none());
        assert!(started.elapsed() < std::time::Duration::from_secs(3));
    }

    #[test]
    fn shares_are_balanced_by_bytes_and_keep_the_order() {
        let sizes = [10u64, 1, 7, 3, 3, 6];
        let shares = share_out(&[0, 1, 2, 3, 4, 5], |i| sizes[i], 2);
        let bytes: Vec<u64> = shares.iter().map(|s| s.iter().map(|&i| sizes[i]).sum()).collect();
        assert_eq!(bytes.iter().sum::<u64>(), 30);
        // Largest first to the lightest source: 10+3+3 and 7+6+1 (no source further
        // from another than one item).
        assert_eq!(bytes, [16, 14]);
        for share in &shares {
            assert!(share.windows(2).all(|w| w[0] < w[1]), "{shares:?}");
        }
        assert_eq!(share_out(&[0, 1], |i| sizes[i], 1), vec![vec![0, 1]], "the head alone");
        assert_eq!(share_out(&[], |i| sizes[i], 3), vec![Vec::<usize>::new(); 3]);
    }
}

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
//!   TensorChunk{index, offset, data} …          →   (verify, write, sync, record)
//! ```
//!
//! Nothing the head says is taken on trust (issue 16): where each tensor lies comes from
//! the tensor index in the header the worker parses itself (whose hash is the model's
//! identity), not from the head's list; a record of received tensors names each with
//! its place and hash, and a recorded tensor is hashed again before it is reused; data
//! is synced before it is recorded; and the caller checks that the stage's whole tensor
//! set is there before loading (a tensor never sent would read as zeros).

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::FileExt;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use baton_gguf::Gguf;
use baton_model::{ModelFile, StageSpan};
use baton_net::{Link, LinkExt};
use baton_proto::auth::identity_hash;
use baton_proto::{Control, Conversation, Fetch, Message, ModelRef, TensorEntry, MAX_FETCH_PEERS};
use sha2::{Digest, Sha256};

use baton_stage::models::{check_tensor_name, CachedTensor, ModelDir};
use baton_stage::NodeError;

/// Bytes hashed at a time when a recorded tensor is checked again.
const CHUNK: usize = 8 << 20;

/// Received bytes after which the data is synced and the record written, so that a
/// crash loses little and the record never runs ahead of the disk.
const RECORD_EVERY: u64 = 64 << 20;

/// What a worker received: the sparse file, the tensor bytes that crossed the wire,
/// and every tensor of the head's list now in the file and verified.
pub struct Received {
    /// The sparse copy, opened (its index read while the tensors arrived).
    pub model: Result<Arc<ModelFile>, NodeError>,
    /// Tensor bytes received now.
    pub bytes: u64,
    /// Names of the tensors verified in the file (received now, or recorded before and
    /// hashed again).
    pub verified: BTreeSet<String>,
    /// The last record of what was received, still being written.
    pub recording: Recording,
}

/// Syncs the copy's data and then writes the record of verified tensors, on a thread of
/// its own: the links are read on while the disk catches up, and a record never names
/// data that is not synced. Each map sent is a record to write (only the latest of those
/// waiting is written); closing the sender ends the thread after the last. It holds the
/// copy's lock until then.
fn start_recorder(
    models: &ModelDir,
    identity: [u8; 32],
    path: &std::path::Path,
    file: &std::fs::File,
    lock: std::fs::File,
) -> Result<(mpsc::Sender<BTreeMap<String, CachedTensor>>, Recording), NodeError> {
    let (tx, rx) = mpsc::channel::<BTreeMap<String, CachedTensor>>();
    let (models, path) = (models.clone(), path.to_path_buf());
    let file = file.try_clone().map_err(|e| file_error(&path, "open", e))?;
    let thread = std::thread::Builder::new()
        .name("record".into())
        .spawn(move || {
            let _lock = lock;
            while let Ok(mut have) = rx.recv() {
                while let Ok(newer) = rx.try_recv() {
                    have = newer;
                }
                file.sync_data().map_err(|e| file_error(&path, "sync", e))?;
                models.record_partial(&identity, &have)?;
            }
            Ok(())
        })
        .map_err(|e| NodeError::Protocol(format!("cannot start the thread recording received tensors: {e}")))?;
    Ok((tx, Recording(Some(thread))))
}

/// The thread writing the last record of received tensors.
pub struct Recording(Option<std::thread::JoinHandle<Result<(), NodeError>>>);

impl Recording {
    /// Waits until the received data is synced and recorded (at once when it was
    /// waited for before).
    pub fn wait(&mut self) -> Result<(), NodeError> {
        match self.0.take() {
            Some(thread) => thread.join().unwrap_or_else(|_| {
                Err(NodeError::Protocol(
                    "the thread recording received tensors panicked".into(),
                ))
            }),
            None => Ok(()),
        }
    }
}

/// Dials a worker that holds the model, for a fetch ([`Role::Fetch`](baton_proto::Role)).
pub type DialPeer<'a> = &'a (dyn Fn(&str) -> Result<Box<dyn Link>, NodeError> + Sync);

/// Worker side: receives what is missing of a stage into the sparse copy of the model,
/// from the head and from the peers it names (`FetchFrom`), all at once.
pub fn receive_stage_tensors(
    models: &ModelDir,
    model: &ModelRef,
    link: &mut dyn Link,
    dial: DialPeer<'_>,
) -> Result<Received, NodeError> {
    let (header, entries) = match link.recv_as::<Control>()? {
        Control::StreamStart { header, tensors } => (header, tensors),
        other => {
            return Err(NodeError::Protocol(format!(
                "expected StreamStart, got {}",
                other.kind()
            )))
        }
    };
    // One worker at a time receives into a copy (workers may share the directory).
    let lock = models.lock_partial(&model.identity)?;
    let path = models.partial_path(&model.identity);
    let recorded = models.partial_tensors(&model.identity);
    let answer = |link: &mut dyn Link, missing: &[TensorEntry]| {
        link.send(Message::StreamStart {
            header: Vec::new(),
            tensors: missing.to_vec(),
        })
    };
    // Nothing recorded, nothing to reuse: the head hears so at once, and the header is
    // checked and the copy made while the first chunks are on their way (none is
    // written before).
    let early = recorded.is_empty();
    if early {
        answer(link, &entries)?;
    }
    if identity_hash(&header) != model.identity {
        return Err(NodeError::Protocol(
            "the streamed header does not match the model's identity".into(),
        ));
    }
    let index = read_index(&header, model.size)?;
    check_entries(&index, &entries)?;
    let file = models.open_partial(&model.identity, model.size, &header)?;
    let (have, verified, missing) = match early {
        true => (BTreeMap::new(), BTreeSet::new(), entries.clone()),
        false => {
            let reused = reusable(models, &model.identity, &path, &file, &entries, recorded)?;
            answer(link, &reused.2)?;
            reused
        }
    };
    // Before its first chunk the head may name peers that hold the file, each with the
    // tensors to fetch from it; the head sends the rest (when nothing is left for it,
    // nothing more comes from it).
    let (fetches, mut first) = read_fetches(link, &entries, &missing)?;
    let from_head: Vec<&TensorEntry> = missing
        .iter()
        .filter(|e| !fetches.iter().flat_map(|(_, w)| w).any(|w| w.name == e.name))
        .collect();

    let (recorder, recording) = start_recorder(models, model.identity, &path, &file, lock)?;
    let sink = Sink {
        recorder: Mutex::new(recorder),
        path: &path,
        file: &file,
        progress: Mutex::new(Progress {
            total: missing.iter().map(|e| e.len).sum(),
            received: 0,
            unrecorded: 0,
            started: Instant::now(),
            reported: Instant::now(),
        }),
        have: Mutex::new(have),
        verified: Mutex::new(verified),
    };
    let (opened, received) = std::thread::scope(|scope| {
        // The copy's header is on disk: its index is read while the tensors arrive.
        let opened = scope.spawn(|| ModelFile::open(&path));
        let peers: Vec<_> = fetches
            .iter()
            .map(|(peer, wanted)| {
                let (sink, header) = (&sink, &header);
                scope.spawn(move || {
                    fetch_from(dial, peer, header, wanted, sink)
                        .map_err(|e| NodeError::Request(format!("fetching tensors from {peer}: {e}")))
                })
            })
            .collect();
        let mut next = || match first.take() {
            Some(message) => Ok(message),
            None => link.recv().map_err(NodeError::from),
        };
        let position = |entry: &TensorEntry| entries.iter().position(|e| e.name == entry.name);
        let from_head = receive_chunks(&mut next, &from_head, position, &sink);
        let received = peers
            .into_iter()
            .map(|thread| {
                thread
                    .join()
                    .unwrap_or_else(|_| Err(NodeError::Protocol("a fetch thread panicked".into())))
            })
            .fold(from_head, |all, one| all.and(one));
        (opened.join(), received)
    });
    received?;
    let model_file = opened
        .map_err(|_| NodeError::Protocol("reading the copy's index panicked".into()))
        .and_then(|opened| opened.map_err(NodeError::from));
    // The last record: written while the stage loads (`Recording::wait`).
    let have = sink.have.into_inner().unwrap_or_else(|p| p.into_inner());
    let recorder = sink.recorder.into_inner().unwrap_or_else(|p| p.into_inner());
    let _ = recorder.send(have);
    drop(recorder);
    let progress = sink.progress.into_inner().unwrap_or_else(|p| p.into_inner());
    let verified = sink.verified.into_inner().unwrap_or_else(|p| p.into_inner());
    if progress.total > 0 {
        log_progress(progress.received, progress.total, progress.started);
    }
    Ok(Received {
        model: model_file,
        bytes: progress.received,
        verified,
        recording,
    })
}

/// The `FetchFrom`s the head sends before its first chunk: the peers to fetch from, each
/// with the tensors (of `entries`, still `missing`, each named once) it holds; and the
/// first message after them, when one was read.
#[allow(clippy::type_complexity)]
fn read_fetches<'a>(
    link: &mut dyn Link,
    entries: &'a [TensorEntry],
    missing: &[TensorEntry],
) -> Result<(Vec<(String, Vec<&'a TensorEntry>)>, Option<Message>), NodeError> {
    let mut fetches: Vec<(String, Vec<&TensorEntry>)> = Vec::new();
    while fetches.iter().map(|(_, w)| w.len()).sum::<usize>() < missing.len() {
        let (peer, tensors) = match link.recv()? {
            Message::FetchFrom { peer, tensors } => (peer, tensors),
            chunk => return Ok((fetches, Some(chunk))),
        };
        if fetches.len() >= MAX_FETCH_PEERS || fetches.iter().any(|(p, _)| *p == peer) {
            return Err(NodeError::Protocol(format!(
                "the head names peer {peer} twice, or more than {MAX_FETCH_PEERS} peers"
            )));
        }
        let mut wanted = Vec::new();
        for i in tensors {
            let entry = entries
                .get(i as usize)
                .filter(|e| missing.iter().any(|m| m.name == e.name))
                .filter(|e| !fetches.iter().flat_map(|(_, w)| w).any(|w| w.name == e.name))
                .filter(|e| !wanted.iter().any(|w: &&TensorEntry| w.name == e.name))
                .ok_or_else(|| {
                    NodeError::Protocol(format!(
                        "FetchFrom {peer}: tensor {i} is not one still missing, or twice"
                    ))
                })?;
            wanted.push(entry);
        }
        fetches.push((peer, wanted));
    }
    Ok((fetches, None))
}

/// The tensors to keep recorded, those verified, and those missing.
type Reusable = (BTreeMap<String, CachedTensor>, BTreeSet<String>, Vec<TensorEntry>);

/// What of the recorded tensors can be reused: each listed by the head, recorded with
/// the head's hash, and hashing to it again (a tensor damaged on disk, or recorded with
/// another hash, is sent again). The record loses the missing ones now.
fn reusable(
    models: &ModelDir,
    identity: &[u8; 32],
    path: &std::path::Path,
    file: &std::fs::File,
    entries: &[TensorEntry],
    recorded: BTreeMap<String, CachedTensor>,
) -> Result<Reusable, NodeError> {
    let mut have: BTreeMap<String, CachedTensor> = BTreeMap::new();
    let mut verified = BTreeSet::new();
    let mut missing = Vec::new();
    for entry in entries {
        let reusable = recorded.get(&entry.name) == Some(&cached(entry))
            && hash_range(file, entry.offset, entry.len).map_err(|e| file_error(path, "read", e))? == entry.sha256;
        if reusable {
            have.insert(entry.name.clone(), cached(entry));
            verified.insert(entry.name.clone());
        } else {
            missing.push(entry.clone());
        }
    }
    // Tensors of other stages keep their records (each is checked when reused).
    for (name, tensor) in recorded {
        have.entry(name).or_insert(tensor);
    }
    let mut changed = false;
    for entry in &missing {
        changed |= have.remove(&entry.name).is_some();
    }
    if changed {
        models.record_partial(identity, &have)?;
    }
    Ok((have, verified, missing))
}

fn cached(entry: &TensorEntry) -> CachedTensor {
    CachedTensor {
        offset: entry.offset,
        len: entry.len,
        sha256: entry.sha256,
    }
}

fn file_error(path: &std::path::Path, action: &'static str, source: std::io::Error) -> NodeError {
    NodeError::File {
        path: path.to_path_buf(),
        action,
        source,
    }
}

/// Where received tensors go, from any source: the sparse copy, the record of verified
/// tensors (handed to the recorder thread every [`RECORD_EVERY`] bytes), progress.
struct Sink<'a> {
    recorder: Mutex<mpsc::Sender<BTreeMap<String, CachedTensor>>>,
    path: &'a std::path::Path,
    file: &'a std::fs::File,
    progress: Mutex<Progress>,
    have: Mutex<BTreeMap<String, CachedTensor>>,
    verified: Mutex<BTreeSet<String>>,
}

struct Progress {
    total: u64,
    received: u64,
    unrecorded: u64,
    started: Instant,
    reported: Instant,
}

impl Sink<'_> {
    fn write(&self, entry: &TensorEntry, offset: u64, data: &[u8]) -> Result<(), NodeError> {
        self.file
            .write_all_at(data, entry.offset + offset)
            .map_err(|e| file_error(self.path, "write", e))?;
        let mut progress = self.progress.lock().unwrap_or_else(|p| p.into_inner());
        progress.received += data.len() as u64;
        progress.unrecorded += data.len() as u64;
        if progress.reported.elapsed().as_secs_f32() >= 1.0 {
            progress.reported = Instant::now();
            log_progress(progress.received, progress.total, progress.started);
        }
        Ok(())
    }

    /// Records `entry`, whose bytes were all written and hashed to `sha256`.
    fn verified(&self, entry: &TensorEntry, sha256: [u8; 32]) -> Result<(), NodeError> {
        if sha256 != entry.sha256 {
            return Err(NodeError::Protocol(format!(
                "tensor {} failed verification (SHA-256 mismatch)",
                entry.name
            )));
        }
        let mut have = self.have.lock().unwrap_or_else(|p| p.into_inner());
        have.insert(entry.name.clone(), cached(entry));
        self.verified
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(entry.name.clone());
        let mut progress = self.progress.lock().unwrap_or_else(|p| p.into_inner());
        if progress.unrecorded >= RECORD_EVERY {
            // A recorder that stopped has its error waiting in `Recording::wait`.
            let _ = self
                .recorder
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .send(have.clone());
            progress.unrecorded = 0;
        }
        Ok(())
    }
}

/// Receives `wanted` in order, each in chunks numbered by `index_of` (its place in the
/// list the sender was given), from `next`.
fn receive_chunks(
    next: &mut dyn FnMut() -> Result<Message, NodeError>,
    wanted: &[&TensorEntry],
    index_of: impl Fn(&TensorEntry) -> Option<usize>,
    sink: &Sink<'_>,
) -> Result<(), NodeError> {
    for entry in wanted {
        let mut hasher = Sha256::new();
        let mut done = 0u64;
        while done < entry.len {
            let (index, offset, data) = match next()? {
                Message::TensorChunk { index, offset, data } => (index, offset, data),
                other => {
                    return Err(NodeError::Protocol(format!(
                        "expected TensorChunk, got {}",
                        other.kind()
                    )))
                }
            };
            // An empty chunk would let a sender keep a worker busy for ever.
            if Some(index as usize) != index_of(entry)
                || offset != done
                || data.is_empty()
                || done + data.len() as u64 > entry.len
            {
                return Err(NodeError::Protocol(format!(
                    "out-of-order, empty or oversized chunk for tensor {}",
                    entry.name
                )));
            }
            hasher.update(&data);
            sink.write(entry, done, &data)?;
            done += data.len() as u64;
        }
        sink.verified(entry, hasher.finalize().into())?;
    }
    Ok(())
}

/// Fetches `wanted` from the worker at `peer`, which holds the model whose header is
/// `header`: the peer answers chunks numbered by their place in `wanted`.
fn fetch_from(
    dial: DialPeer<'_>,
    peer: &str,
    header: &[u8],
    wanted: &[&TensorEntry],
    sink: &Sink<'_>,
) -> Result<(), NodeError> {
    let mut link = dial(peer)?;
    link.send(Message::StreamStart {
        header: header.to_vec(),
        tensors: wanted.iter().map(|e| (*e).clone()).collect(),
    })?;
    let position = |entry: &TensorEntry| wanted.iter().position(|w| w.name == entry.name);
    // The holder sends chunks only: anything else of a fetch is out of place, and a
    // frame of another conversation breaks the protocol.
    let mut next = || link.recv_as::<Fetch>().map(Message::from).map_err(NodeError::from);
    receive_chunks(&mut next, wanted, position, sink)?;
    tracing::info!(%peer, tensors = wanted.len(), "fetched tensors from a peer");
    Ok(())
}

/// Holder side of a fetch: another worker sends the model's header and the tensors it
/// wants (`StreamStart`); this worker sends them from its complete copy, in chunks
/// numbered by their place in that list. Each must be a tensor of the copy's own index,
/// at its place, listed once.
pub fn serve_fetch(models: &ModelDir, link: &mut dyn Link) -> Result<(), NodeError> {
    let (header, wanted) = match link.recv_as::<Fetch>()? {
        Fetch::StreamStart { header, tensors } => (header, tensors),
        other => {
            return Err(NodeError::Protocol(format!(
                "a fetch starts with StreamStart, not {}",
                other.kind()
            )))
        }
    };
    let identity = identity_hash(&header);
    let path = models
        .find_by_identity(&identity)
        .ok_or_else(|| NodeError::Request("this worker holds no complete copy of that model".into()))?;
    let file = std::fs::File::open(&path).map_err(|e| file_error(&path, "open", e))?;
    let size = file.metadata().map_err(|e| file_error(&path, "read", e))?.len();
    // The header hashes to this copy's identity: it is this copy's own index.
    check_entries(&read_index(&header, size)?, &wanted)?;
    for (i, entry) in wanted.iter().enumerate() {
        let mut done = 0u64;
        while done < entry.len {
            let n = CHUNK.min((entry.len - done) as usize);
            let mut data = vec![0u8; n];
            file.read_exact_at(&mut data, entry.offset + done)
                .map_err(|e| file_error(&path, "read", e))?;
            link.send(Message::TensorChunk {
                index: i as u32,
                offset: done,
                data,
            })?;
            done += n as u64;
        }
    }
    tracing::info!(tensors = wanted.len(), "sent tensors to a peer");
    Ok(())
}

/// The tensor index of a streamed header, for a file of `size` bytes: parsed here, so
/// that where each tensor lies is what the header (whose hash is the model's identity)
/// says, not what the head's list says. A size far past the last tensor would make a
/// huge sparse file.
fn read_index(header: &[u8], size: u64) -> Result<Gguf, NodeError> {
    let index = Gguf::parse_index(header, size)
        .map_err(|e| NodeError::Protocol(format!("the streamed header is not a GGUF index: {e}")))?;
    let end = index
        .tensors
        .iter()
        .map(|t| t.offset + t.n_bytes)
        .max()
        .unwrap_or(index.data_offset);
    if size > end.saturating_add(index.alignment) {
        return Err(NodeError::Protocol(format!(
            "the model is announced as {size} bytes, but its last tensor ends at byte {end}"
        )));
    }
    Ok(index)
}

/// Checks the head's list of tensors against the index: each name printable, listed
/// once, and at the place and of the length the index gives it.
fn check_entries(index: &Gguf, entries: &[TensorEntry]) -> Result<(), NodeError> {
    let mut seen = BTreeSet::new();
    for entry in entries {
        check_tensor_name(&entry.name)?;
        if !seen.insert(entry.name.as_str()) {
            return Err(NodeError::Protocol(format!("tensor {} is listed twice", entry.name)));
        }
        let tensor = index
            .tensor(&entry.name)
            .ok_or_else(|| NodeError::Protocol(format!("tensor {} is not in the model's tensor index", entry.name)))?;
        if (entry.offset, entry.len) != (tensor.offset, tensor.n_bytes) {
            return Err(NodeError::Protocol(format!(
                "tensor {} is announced at bytes {}..{}, but the model's index puts it at {}..{}",
                entry.name,
                entry.offset,
                entry.offset.saturating_add(entry.len),
                tensor.offset,
                tensor.offset + tensor.n_bytes
            )));
        }
    }
    Ok(())
}

/// SHA-256 of `len` bytes of `file` from `offset`.
fn hash_range(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<[u8; 32]> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK.min(len as usize).max(1)];
    let mut done = 0u64;
    while done < len {
        let n = buf.len().min((len - done) as usize);
        file.read_exact_at(&mut buf[..n], offset + done)?;
        hasher.update(&buf[..n]);
        done += n as u64;
    }
    Ok(hasher.finalize().into())
}

/// Checks that the file holds every tensor the stage reads: `verified` are those this
/// worker received and verified; any other would be a hole that reads as zeros.
pub fn check_stage_complete(file: &ModelFile, span: &StageSpan, verified: &BTreeSet<String>) -> Result<(), NodeError> {
    let missing: Vec<String> = baton_model::stage_tensor_sources(file, span)
        .into_iter()
        .filter(|name| !verified.contains(name))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(NodeError::Protocol(format!(
        "the head did not send {} tensor(s) the stage needs ({}{}): they would read as zeros",
        missing.len(),
        missing[..missing.len().min(3)].join(", "),
        if missing.len() > 3 { ", ..." } else { "" }
    )))
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

#[cfg(test)]
mod tests {
    use baton_gguf::GgufWriter;
    use baton_net::{local_pair, Link, LocalLink};
    use baton_proto::auth::hex;

    use std::path::PathBuf;

    use super::*;

    /// A small GGUF (two f32 tensors), its identity, and a fresh models directory.
    struct Fixture {
        bytes: Vec<u8>,
        index: Gguf,
        model: ModelRef,
        dir: PathBuf,
        models: ModelDir,
    }

    fn fixture(tag: &str, alignment: Option<u32>) -> Fixture {
        let mut writer = GgufWriter::new().kv_str("general.architecture", "llama");
        if let Some(alignment) = alignment {
            writer = writer.kv_u32("general.alignment", alignment);
        }
        let bytes = writer
            .tensor_f32("a", &[8], &[1.5; 8])
            .tensor_f32("b", &[4], &[-2.0; 4])
            .to_bytes();
        let index = Gguf::parse(&bytes).unwrap();
        let header = &bytes[..index.data_offset as usize];
        let model = ModelRef {
            file_name: "tiny.gguf".into(),
            identity: identity_hash(header),
            size: bytes.len() as u64,
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!("baton-stream-{tag}-{}-{nanos}", std::process::id()));
        let models = ModelDir::new(&dir).unwrap();
        Fixture {
            bytes,
            index,
            model,
            dir,
            models,
        }
    }

    impl Fixture {
        fn header(&self) -> Vec<u8> {
            self.bytes[..self.index.data_offset as usize].to_vec()
        }

        /// The true entry of tensor `name`.
        fn entry(&self, name: &str) -> TensorEntry {
            let t = self.index.tensor(name).unwrap();
            TensorEntry {
                name: name.into(),
                offset: t.offset,
                len: t.n_bytes,
                sha256: identity_hash(&self.bytes[t.offset as usize..(t.offset + t.n_bytes) as usize]),
            }
        }

        /// Runs a head that offers `entries` and sends whatever is asked for (from the
        /// real file), against the worker side; returns the worker's result and the
        /// names the worker asked for.
        fn stream(&self, model: &ModelRef, entries: Vec<TensorEntry>) -> (Result<Received, NodeError>, Vec<String>) {
            let (mut head, mut worker): (LocalLink, LocalLink) = local_pair("worker", "head");
            let bytes = self.bytes.clone();
            let header = self.header();
            let offered = entries.clone();
            let head_side = std::thread::spawn(move || {
                let Some(wanted) = offer(&mut head, header, &offered) else {
                    return Vec::new();
                };
                for want in &wanted {
                    let index = offered.iter().position(|e| e.name == want.name).unwrap();
                    let data = bytes[want.offset as usize..(want.offset + want.len) as usize].to_vec();
                    let _ = head.send(Message::TensorChunk {
                        index: index as u32,
                        offset: 0,
                        data,
                    });
                }
                wanted.into_iter().map(|e| e.name).collect()
            });
            let no_peers = |peer: &str| -> Result<Box<dyn Link>, NodeError> { panic!("dialed {peer}") };
            // The record is written before the next stream reads it, as the worker
            // waits for it before it reports the stage loaded.
            let result = receive_stage_tensors(&self.models, model, &mut worker, &no_peers)
                .and_then(|mut got| got.recording.wait().map(|()| got));
            // Wakes the head if the worker gave up before answering.
            worker.closer().unwrap().close();
            (result, head_side.join().unwrap())
        }
    }

    /// The head's offer of `offered`; what the worker asks for, unless it gave up.
    fn offer(head: &mut LocalLink, header: Vec<u8>, offered: &[TensorEntry]) -> Option<Vec<TensorEntry>> {
        head.send(Message::StreamStart {
            header,
            tensors: offered.to_vec(),
        })
        .unwrap();
        match head.recv() {
            Ok(Message::StreamStart { tensors, .. }) => Some(tensors),
            _ => None,
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn tensors_land_where_the_header_puts_them_and_nowhere_else() {
        let f = fixture("offsets", None);
        let (a, b) = (f.entry("a"), f.entry("b"));
        // `a` announced over `b`'s bytes, or over the header: refused before writing.
        let over_b = TensorEntry {
            offset: b.offset,
            ..a.clone()
        };
        let (result, _) = f.stream(&f.model, vec![over_b]);
        let err = result.err().unwrap().to_string();
        assert!(
            err.contains("tensor a is announced at bytes") && err.contains("index puts it at"),
            "{err}"
        );
        let over_header = TensorEntry { offset: 0, ..a.clone() };
        assert!(f.stream(&f.model, vec![over_header]).0.is_err());
        let unknown = TensorEntry {
            name: "c".into(),
            ..a.clone()
        };
        let err = f.stream(&f.model, vec![unknown]).0.err().unwrap().to_string();
        assert!(err.contains("not in the model's tensor index"), "{err}");
        let err = f
            .stream(&f.model, vec![a.clone(), a.clone()])
            .0
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("listed twice"), "{err}");
        // A size the index cannot fit in, or far past the last tensor.
        for size in [b.offset + b.len - 1, f.model.size + 4096] {
            let model = ModelRef {
                size,
                ..f.model.clone()
            };
            assert!(f.stream(&model, vec![a.clone()]).0.is_err(), "size {size}");
        }
        // The true entries go through, and the copy holds the true bytes.
        let (result, asked) = f.stream(&f.model, vec![a.clone(), b.clone()]);
        let received = result.unwrap();
        assert_eq!(asked, ["a", "b"]);
        assert_eq!(received.verified.len(), 2);
        let copy = std::fs::read(f.models.partial_path(&f.model.identity)).unwrap();
        assert_eq!(copy, f.bytes);
    }

    /// Runs a head that offers `a` and `b` and names a peer for `fetched` (indices into
    /// its list), sending the rest itself; the peer serves from a complete copy.
    fn stream_with_peer(f: &Fixture, fetched: Vec<u32>) -> Result<Received, NodeError> {
        let holder_dir = f.dir.join("holder");
        std::fs::create_dir_all(&holder_dir).unwrap();
        std::fs::write(holder_dir.join("copy.gguf"), &f.bytes).unwrap();
        let (mut head, mut worker): (LocalLink, LocalLink) = local_pair("worker", "head");
        let (bytes, header, offered) = (f.bytes.clone(), f.header(), vec![f.entry("a"), f.entry("b")]);
        let head_side = std::thread::spawn(move || {
            let Some(wanted) = offer(&mut head, header, &offered) else {
                return;
            };
            let _ = head.send(Message::FetchFrom {
                peer: "peer:1".into(),
                tensors: fetched.clone(),
            });
            for (i, e) in offered.iter().enumerate() {
                if wanted.iter().any(|w| w.name == e.name) && !fetched.contains(&(i as u32)) {
                    let data = bytes[e.offset as usize..(e.offset + e.len) as usize].to_vec();
                    let _ = head.send(Message::TensorChunk {
                        index: i as u32,
                        offset: 0,
                        data,
                    });
                }
            }
        });
        let dial = |peer: &str| -> Result<Box<dyn Link>, NodeError> {
            assert_eq!(peer, "peer:1");
            let (mine, mut theirs): (LocalLink, LocalLink) = local_pair("peer", "worker");
            let dir = holder_dir.clone();
            std::thread::spawn(move || serve_fetch(&ModelDir::new(&dir).unwrap(), &mut theirs));
            Ok(Box::new(mine))
        };
        let result = receive_stage_tensors(&f.models, &f.model, &mut worker, &dial)
            .and_then(|mut got| got.recording.wait().map(|()| got));
        worker.closer().unwrap().close();
        head_side.join().unwrap();
        result
    }

    #[test]
    fn tensors_the_head_names_come_from_a_peer_holding_the_file_the_rest_from_the_head() {
        let f = fixture("fetch", None);
        let received = stream_with_peer(&f, vec![1]).unwrap();
        assert_eq!(received.verified.len(), 2);
        assert_eq!(
            std::fs::read(f.models.partial_path(&f.model.identity)).unwrap(),
            f.bytes
        );
        assert_eq!(received.bytes, f.entry("a").len + f.entry("b").len);

        // A tensor the worker does not miss, or one out of the list, is refused.
        let f = fixture("fetch-bad", None);
        let err = stream_with_peer(&f, vec![7]).err().unwrap().to_string();
        assert!(err.contains("is not one still missing"), "{err}");
        let err = stream_with_peer(&f, vec![0, 0]).err().unwrap().to_string();
        assert!(err.contains("is not one still missing, or twice"), "{err}");
    }

    #[test]
    fn a_peer_sends_only_tensors_of_its_own_copy_at_their_place() {
        let f = fixture("serve", None);
        std::fs::write(f.dir.join("copy.gguf"), &f.bytes).unwrap();
        let ask = |tensors: Vec<TensorEntry>, header: Vec<u8>| {
            let (mut asker, mut holder): (LocalLink, LocalLink) = local_pair("holder", "asker");
            asker.send(Message::StreamStart { header, tensors }).unwrap();
            serve_fetch(&f.models, &mut holder)
        };
        let (a, b) = (f.entry("a"), f.entry("b"));
        assert!(ask(vec![b.clone(), a.clone()], f.header()).is_ok());
        let moved = TensorEntry {
            offset: b.offset,
            ..a.clone()
        };
        assert!(ask(vec![moved], f.header())
            .err()
            .unwrap()
            .to_string()
            .contains("index puts it at"));
        assert!(ask(vec![a.clone(), a.clone()], f.header())
            .err()
            .unwrap()
            .to_string()
            .contains("twice"));
        let other = ask(vec![a], b"not this model".to_vec()).err().unwrap().to_string();
        assert!(other.contains("no complete copy"), "{other}");
    }

    /// A byte changed on the way fails its tensor's hash, wherever in the stream it
    /// comes: the worker stops with the tensor's name (the session refuses the head
    /// with it), and the tensor is never recorded. The record is written on a thread
    /// of its own; the copy's lock is free once that thread is done.
    #[test]
    fn a_tensor_that_fails_its_hash_is_refused_and_never_recorded() {
        let f = fixture("corrupt", None);
        let (a, b) = (f.entry("a"), f.entry("b"));
        let mut bytes = f.bytes.clone();
        bytes[b.offset as usize + 1] ^= 0x01;
        let (mut head, mut worker): (LocalLink, LocalLink) = local_pair("worker", "head");
        let (header, offered) = (f.header(), vec![a.clone(), b.clone()]);
        let head_side = std::thread::spawn(move || {
            let wanted = offer(&mut head, header, &offered).unwrap();
            for (index, entry) in offered.iter().enumerate() {
                if wanted.iter().any(|w| w.name == entry.name) {
                    let _ = head.send(Message::TensorChunk {
                        index: index as u32,
                        offset: 0,
                        data: bytes[entry.offset as usize..(entry.offset + entry.len) as usize].to_vec(),
                    });
                }
            }
        });
        let no_peers = |peer: &str| -> Result<Box<dyn Link>, NodeError> { panic!("dialed {peer}") };
        let err = receive_stage_tensors(&f.models, &f.model, &mut worker, &no_peers)
            .err()
            .expect("a changed byte is refused")
            .to_string();
        worker.closer().unwrap().close();
        head_side.join().unwrap();
        assert!(err.contains("tensor b failed verification"), "{err}");
        let _lock = f.models.lock_partial(&f.model.identity).unwrap();
        assert!(!f.models.partial_tensors(&f.model.identity).contains_key("b"));
    }

    #[test]
    fn names_with_control_characters_are_refused() {
        let f = fixture("names", None);
        for name in ["a\nv2 0000 0 8 b", "a\r", "", "\u{7f}"] {
            let entry = TensorEntry {
                name: name.into(),
                ..f.entry("a")
            };
            let err = f.stream(&f.model, vec![entry]).0.err().unwrap().to_string();
            assert!(err.contains("control characters"), "{name:?}: {err}");
        }
        assert!(
            !f.models.partial_path(&f.model.identity).exists()
                || f.models.partial_tensors(&f.model.identity).is_empty()
        );
    }

    /// Issue 16: a tensor recorded as received was reused on the record's word; damage
    /// on disk (or a record naming a tensor it did not hold) went straight into the
    /// stage.
    #[test]
    fn a_recorded_tensor_is_hashed_again_before_it_is_reused() {
        let f = fixture("reuse", None);
        let (a, b) = (f.entry("a"), f.entry("b"));
        let (result, asked) = f.stream(&f.model, vec![a.clone(), b.clone()]);
        result.unwrap();
        let path = f.models.partial_path(&f.model.identity);
        assert_eq!(asked, ["a", "b"]);
        let (result, asked) = f.stream(&f.model, vec![a.clone(), b.clone()]);
        assert!(asked.is_empty(), "nothing is sent twice: {asked:?}");
        assert_eq!(result.unwrap().verified.len(), 2);

        // One byte of `a` flips on disk: `a` is sent again, and only `a`.
        let mut copy = std::fs::read(&path).unwrap();
        copy[a.offset as usize + 3] ^= 0x10;
        std::fs::write(&path, &copy).unwrap();
        let (result, asked) = f.stream(&f.model, vec![a.clone(), b.clone()]);
        assert_eq!(asked, ["a"]);
        result.unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), f.bytes);

        // The record names every tensor with its place and hash, one line each.
        let record =
            std::fs::read_to_string(f.dir.join(".baton").join(format!("{}.have", hex(&f.model.identity)))).unwrap();
        assert_eq!(
            record,
            format!(
                "v2 {} {} {} a\nv2 {} {} {} b\n",
                hex(&a.sha256),
                a.offset,
                a.len,
                hex(&b.sha256),
                b.offset,
                b.len
            )
        );
        // An old record (names only) counts for nothing.
        std::fs::write(
            f.dir.join(".baton").join(format!("{}.have", hex(&f.model.identity))),
            "a\nb\n",
        )
        .unwrap();
        let (_, asked) = f.stream(&f.model, vec![a, b]);
        assert_eq!(asked, ["a", "b"]);
    }

    /// Issue 16: a copy of another size was cut to the head's size in place; a worker
    /// sharing the directory that had the copy mapped died of SIGBUS reading it.
    #[test]
    fn a_copy_another_worker_maps_is_never_cut_under_it() {
        // Tensors aligned to 8 KiB: the file ends two pages past its last tensor's data.
        let f = fixture("mapped", Some(8192));
        let (a, b) = (f.entry("a"), f.entry("b"));
        let (result, _) = f.stream(&f.model, vec![a.clone(), b.clone()]);
        result.unwrap();
        let path = f.models.partial_path(&f.model.identity);
        let mapped = baton_ggml::MappedFile::open(&path).unwrap();
        assert_eq!(mapped.bytes().len() as u64, f.model.size);

        // A head announcing the size where the last tensor ends (valid, and smaller).
        let end = b.offset + b.len;
        assert!(f.model.size - end > 4096, "a page past the new end");
        let model = ModelRef {
            size: end,
            ..f.model.clone()
        };
        let (result, asked) = f.stream(&model, vec![a, b]);
        assert_eq!(asked, ["a", "b"], "the replaced copy's record went with it");
        result.unwrap();
        assert_eq!(
            std::fs::metadata(f.models.partial_path(&f.model.identity))
                .unwrap()
                .len(),
            end
        );
        // The old mapping still reads to its end (a cut file would raise SIGBUS here).
        let last = mapped.bytes()[mapped.bytes().len() - 1];
        assert_eq!(last, f.bytes[f.bytes.len() - 1]);
        assert_eq!(mapped.bytes(), &f.bytes[..]);
    }
}

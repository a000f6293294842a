//! A worker's models directory: which GGUF files it holds, their identity, partial
//! files received by streaming, and cached speed measurements. Names from the network
//! are resolved only inside the directory.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::UNIX_EPOCH;

use baton_gguf::Gguf;
use baton_proto::auth::{hex, identity_hash};
use baton_proto::HeldModel;
use sha2::{Digest, Sha256};

use crate::NodeError;

/// Hidden folder inside the models directory for baton's own files.
const STATE_DIR: &str = ".baton";

/// Opens a file of baton's own under `.baton/`, never through a symbolic link: the
/// names there are predictable, and whoever else can write to a shared models
/// directory could otherwise point one at a file this process may write (a node often
/// runs as root) and have it truncated or overwritten.
fn open_state(path: &Path, options: &mut fs::OpenOptions) -> std::io::Result<fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    options.custom_flags(libc::O_NOFOLLOW).open(path)
}

/// A new temporary file of baton's own. Whatever had the name (a leftover of a process
/// that died, a planted link) is removed first, and the file is created only if the
/// name is then free, so nothing is written through a link.
fn create_state(path: &Path) -> std::io::Result<fs::File> {
    let _ = fs::remove_file(path);
    open_state(path, fs::OpenOptions::new().read(true).write(true).create_new(true))
}

/// The text of a file of baton's own, read without following a link.
fn read_state(path: &Path) -> std::io::Result<String> {
    let mut text = String::new();
    std::io::Read::read_to_string(&mut open_state(path, fs::OpenOptions::new().read(true))?, &mut text)?;
    Ok(text)
}

/// The identity of a GGUF: SHA-256 of its header and tensor index (everything before
/// the tensor data). Cheap, and it changes whenever a tensor, its type or its place
/// changes.
pub fn identity_of(path: &Path) -> Result<([u8; 32], u64), NodeError> {
    let file = baton_ggml::MappedFile::open(path).map_err(|source| NodeError::File {
        path: path.to_path_buf(),
        action: "map",
        source,
    })?;
    let bytes = file.bytes();
    let gguf = Gguf::parse(bytes).map_err(|source| NodeError::Gguf {
        path: path.to_path_buf(),
        source,
    })?;
    Ok((identity_hash(&bytes[..gguf.data_offset as usize]), bytes.len() as u64))
}

/// Files being hashed in the background now (each is hashed by one thread at a time).
static HASHING: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());

/// SHA-256 of the whole file at `path`, when known. The result is kept in
/// `cache/<identity>.content` with the file's size and modification time, and read from
/// there while both are unchanged. When it is not known, a background thread computes
/// and stores it, and this returns `None`: hashing gigabytes takes a while, and nothing
/// waits for it (the cheap identity already tells models apart; the content hash finds
/// a copy whose tensor data differs, e.g. a corrupted one).
pub fn content_hash(path: &Path, identity: &[u8; 32], cache: &Path) -> Option<[u8; 32]> {
    let record = cache.join(format!("{}.content", hex(identity)));
    let stamp = file_stamp(path)?;
    if let Some(hash) = read_state(&record).ok().and_then(|text| parse_record(&text, &stamp)) {
        return Some(hash);
    }
    if !HASHING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(path.to_path_buf())
    {
        return None;
    }
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        match hash_file(&path) {
            // Stored only if the file did not change while it was read.
            Ok(hash) if file_stamp(&path).as_ref() == Some(&stamp) => {
                let text = format!("{stamp} {}\n", hex(&hash));
                if let Err(e) = store_record(&record, &text) {
                    tracing::warn!(
                        "cannot store the content hash of {} in {}: {e}",
                        path.display(),
                        record.display()
                    );
                }
            }
            Ok(_) => tracing::debug!("{} changed while it was hashed", path.display()),
            Err(e) => tracing::warn!("cannot hash {}: {e}", path.display()),
        }
        HASHING.lock().unwrap_or_else(|e| e.into_inner()).remove(&path);
    });
    None
}

/// SHA-256 of each of `tensors` (name, offset, length) of the file at `path`, whose
/// header hash is `identity`, as it is now. Known hashes are kept in
/// `cache/<identity>.tensors` under the file's size and modification time, so a head
/// that streams the same model again hashes nothing (hashing a stage's tensors before
/// sending any took most of a second on two cores); the others are computed from
/// `bytes` (the file's mapped contents) and added to the record.
pub fn tensor_hashes(
    path: &Path,
    identity: &[u8; 32],
    cache: &Path,
    bytes: &[u8],
    tensors: &[(&str, u64, u64)],
) -> Vec<[u8; 32]> {
    let record = cache.join(format!("{}.tensors", hex(identity)));
    let stamp = file_stamp(path);
    let mut known: BTreeMap<(String, u64, u64), [u8; 32]> = BTreeMap::new();
    if let (Some(stamp), Ok(text)) = (&stamp, read_state(&record)) {
        let mut lines = text.lines();
        if lines.next() == Some(stamp.as_str()) {
            for line in lines {
                let mut fields = line.splitn(4, ' ');
                let (Some(hash), Some(offset), Some(len), Some(name)) =
                    (fields.next(), fields.next(), fields.next(), fields.next())
                else {
                    continue;
                };
                let hash: Option<[u8; 32]> = baton_proto::auth::unhex(hash).and_then(|h| h.try_into().ok());
                if let (Some(hash), Ok(offset), Ok(len)) = (hash, offset.parse(), len.parse()) {
                    known.insert((name.to_string(), offset, len), hash);
                }
            }
        }
    }
    let mut added = false;
    let hashes = tensors
        .iter()
        .map(|&(name, offset, len)| {
            *known.entry((name.to_string(), offset, len)).or_insert_with(|| {
                added = true;
                identity_hash(&bytes[offset as usize..(offset + len) as usize])
            })
        })
        .collect();
    // Stored only if the file has not changed since its stamp was taken.
    if let Some(stamp) = stamp.filter(|stamp| added && file_stamp(path).as_ref() == Some(stamp)) {
        let mut text = format!("{stamp}\n");
        for ((name, offset, len), hash) in known.iter().filter(|((name, ..), _)| !name.contains(char::is_control)) {
            text += &format!("{} {offset} {len} {name}\n", hex(hash));
        }
        if let Err(e) = store_record(&record, &text) {
            tracing::warn!("cannot store tensor hashes in {}: {e}", record.display());
        }
    }
    hashes
}

/// Writes `text` to `record` atomically. Several processes may store the same record at
/// once (`--local-workers` start workers sharing one models directory, each hashing the
/// same files), so each writes a temporary file of its own before the rename
/// (regression: a shared temporary name made all but one rename fail with "No such
/// file or directory").
fn store_record(record: &Path, text: &str) -> std::io::Result<()> {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = record.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.{n}.tmp", std::process::id()));
    let temp = record.with_file_name(name);
    create_state(&temp)
        .and_then(|mut file| file.write_all(text.as_bytes()))
        .and_then(|()| fs::rename(&temp, record))
        .inspect_err(|_| {
            let _ = fs::remove_file(&temp);
        })
}

/// `size mtime_ns` of a file: what must stay the same for a stored hash to hold.
fn file_stamp(path: &Path) -> Option<String> {
    let meta = fs::metadata(path).ok()?;
    let mtime = meta.modified().ok()?.duration_since(UNIX_EPOCH).ok()?.as_nanos();
    Some(format!("{} {mtime}", meta.len()))
}

/// The hash in a `size mtime_ns hex` record, if the stamp matches.
fn parse_record(text: &str, stamp: &str) -> Option<[u8; 32]> {
    let hex_hash = text.trim().strip_prefix(stamp)?.strip_prefix(' ')?;
    if hex_hash.len() != 64 {
        return None;
    }
    let mut hash = [0u8; 32];
    for (byte, pair) in hash.iter_mut().zip(hex_hash.as_bytes().chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(hash)
}

fn hash_file(path: &Path) -> std::io::Result<[u8; 32]> {
    let mut hasher = Sha256::new();
    std::io::copy(&mut fs::File::open(path)?, &mut hasher)?;
    Ok(hasher.finalize().into())
}

/// Makes a rename in `dir` durable.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

/// A tensor received into a partial copy: where it lies, and the SHA-256 it was
/// verified against when it arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedTensor {
    /// Absolute offset in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// SHA-256 of its bytes.
    pub sha256: [u8; 32],
}

impl CachedTensor {
    /// One record line: `v2 HASH OFFSET LEN NAME`, the name last (names never hold
    /// control characters: see [`check_tensor_name`], so a line ends where it should).
    fn line(&self, name: &str) -> String {
        format!("v2 {} {} {} {name}\n", hex(&self.sha256), self.offset, self.len)
    }

    fn parse_line(line: &str) -> Option<(String, CachedTensor)> {
        let mut fields = line.splitn(5, ' ');
        if fields.next()? != "v2" {
            return None;
        }
        let hash = fields.next()?;
        let offset = fields.next()?.parse().ok()?;
        let len = fields.next()?.parse().ok()?;
        let name = fields.next()?;
        if hash.len() != 64 || check_tensor_name(name).is_err() {
            return None;
        }
        let mut sha256 = [0u8; 32];
        for (byte, pair) in sha256.iter_mut().zip(hash.as_bytes().chunks(2)) {
            *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
        }
        Some((name.to_string(), CachedTensor { offset, len, sha256 }))
    }
}

/// Refuses a tensor name from the network that could not be recorded as one line, or
/// printed as itself: empty, or holding a control character (a newline would add a
/// line of its own to the record of received tensors).
pub fn check_tensor_name(name: &str) -> Result<(), NodeError> {
    if name.is_empty() || name.chars().any(char::is_control) {
        return Err(NodeError::Protocol(format!(
            "tensor name {name:?} is empty or holds control characters"
        )));
    }
    Ok(())
}

/// A worker's view of its models directory.
#[derive(Clone)]
pub struct ModelDir {
    root: PathBuf,
}

impl ModelDir {
    /// Opens (and creates) the directory.
    pub fn new(root: &Path) -> Result<ModelDir, NodeError> {
        let state = root.join(STATE_DIR);
        fs::create_dir_all(&state).map_err(|source| NodeError::File {
            path: root.to_path_buf(),
            action: "use models directory",
            source,
        })?;
        // Its files are opened without following links; the folder itself must not be one.
        let is_dir = fs::symlink_metadata(&state).map_err(|source| NodeError::File {
            path: state.clone(),
            action: "use models directory",
            source,
        })?;
        if !is_dir.is_dir() {
            return Err(NodeError::File {
                path: state,
                action: "use models directory",
                source: std::io::Error::other("it is a symbolic link or not a folder; baton keeps its own files there"),
            });
        }
        Ok(ModelDir {
            root: root.to_path_buf(),
        })
    }

    /// Every complete GGUF file directly in the directory, plus streamed partial files.
    pub fn list(&self) -> Vec<HeldModel> {
        let mut held = Vec::new();
        for (dir, partial) in [(self.root.clone(), false), (self.root.join(STATE_DIR), true)] {
            let Ok(entries) = fs::read_dir(&dir) else { continue };
            for entry in entries.flatten() {
                let path = entry.path();
                if path.extension().is_some_and(|e| e == "gguf") && path.is_file() {
                    if let Ok((identity, size)) = identity_of(&path) {
                        let file_name = path
                            .file_name()
                            .map(|n| n.to_string_lossy().into_owned())
                            .unwrap_or_default();
                        let content = (!partial)
                            .then(|| content_hash(&path, &identity, &self.root.join(STATE_DIR)))
                            .flatten();
                        held.push(HeldModel {
                            file_name,
                            identity,
                            size,
                            complete: !partial,
                            content,
                        });
                    }
                }
            }
        }
        held
    }

    /// The complete file with this name and identity, if the directory has it.
    pub fn find_complete(&self, file_name: &str, identity: &[u8; 32]) -> Option<PathBuf> {
        let path = self.resolve(file_name).ok()?;
        match identity_of(&path) {
            Ok((id, _)) if &id == identity => Some(path),
            _ => None,
        }
    }

    /// A complete file with this identity, whatever its name (a worker serving another
    /// worker's fetch knows the model by its header only).
    pub fn find_by_identity(&self, identity: &[u8; 32]) -> Option<PathBuf> {
        let entries = fs::read_dir(&self.root).ok()?;
        entries.flatten().map(|e| e.path()).find(|path| {
            path.extension().is_some_and(|e| e == "gguf")
                && path.is_file()
                && identity_of(path).is_ok_and(|(id, _)| &id == identity)
        })
    }

    /// `file_name` inside the directory; anything that could escape it is refused.
    pub fn resolve(&self, file_name: &str) -> Result<PathBuf, NodeError> {
        let plain = !file_name.is_empty()
            && !file_name.starts_with('.')
            && !file_name.contains(['/', '\\', '\0'])
            && Path::new(file_name).components().count() == 1;
        if !plain {
            return Err(NodeError::Request(format!(
                "model name {file_name:?} is not a plain file name"
            )));
        }
        Ok(self.root.join(file_name))
    }

    /// Path of the streamed (partial) copy of a model.
    pub fn partial_path(&self, identity: &[u8; 32]) -> PathBuf {
        self.root.join(STATE_DIR).join(format!("{}.gguf", hex(identity)))
    }

    fn record_path(&self, identity: &[u8; 32]) -> PathBuf {
        self.root.join(STATE_DIR).join(format!("{}.have", hex(identity)))
    }

    /// Tensors recorded as received into the partial copy: where each lies and the
    /// SHA-256 it was verified against. What the record claims is checked again before
    /// it is used (see `stream.rs`); lines that do not parse (an older record that
    /// listed names only, damage) are left out, so those tensors are streamed again.
    pub fn partial_tensors(&self, identity: &[u8; 32]) -> BTreeMap<String, CachedTensor> {
        read_state(&self.record_path(identity))
            .map(|text| text.lines().filter_map(CachedTensor::parse_line).collect())
            .unwrap_or_default()
    }

    /// Records that the partial copy holds `tensors`, replacing the record at once
    /// (a new file renamed over the old, then synced: a crash leaves the old record or
    /// the new one). The caller has synced the tensors' data first, so the record never
    /// claims bytes that are not on disk.
    pub fn record_partial(
        &self,
        identity: &[u8; 32],
        tensors: &BTreeMap<String, CachedTensor>,
    ) -> Result<(), NodeError> {
        let record = self.record_path(identity);
        let text: String = tensors.iter().map(|(name, t)| t.line(name)).collect();
        let error = |source| NodeError::File {
            path: record.clone(),
            action: "write",
            source,
        };
        let temp = record.with_extension(format!("have.{}.tmp", std::process::id()));
        let written = create_state(&temp)
            .and_then(|mut file| {
                file.write_all(text.as_bytes())?;
                file.sync_all()
            })
            .and_then(|()| fs::rename(&temp, &record));
        if let Err(e) = written {
            let _ = fs::remove_file(&temp);
            return Err(error(e));
        }
        sync_dir(&self.root.join(STATE_DIR)).map_err(error)
    }

    /// Opens the partial copy of a model of `size` bytes whose header is `header`, for
    /// writing received tensors into. A copy of another size is never cut or grown in
    /// place, since another worker sharing this directory may have it mapped (a mapped
    /// file cut under a process kills it with SIGBUS): a new sparse file replaces it
    /// under the same name, and its record goes with it; mappings of the old one stay
    /// valid.
    pub fn open_partial(&self, identity: &[u8; 32], size: u64, header: &[u8]) -> Result<fs::File, NodeError> {
        use std::os::unix::fs::FileExt as _;
        let path = self.partial_path(identity);
        let error = |action, source| NodeError::File {
            path: path.clone(),
            action,
            source,
        };
        if let Ok(file) = open_state(&path, fs::OpenOptions::new().read(true).write(true)) {
            if file.metadata().map_err(|e| error("read", e))?.len() == size {
                // The same identity means the same header; rewrite it only if damaged.
                let mut on_disk = vec![0u8; header.len()];
                if file.read_exact_at(&mut on_disk, 0).is_err() || on_disk != header {
                    file.write_all_at(header, 0).map_err(|e| error("write", e))?;
                }
                return Ok(file);
            }
            tracing::info!(
                "{} has another size than the head's model: replacing it",
                path.display()
            );
        }
        let temp = path.with_extension(format!("gguf.{}.tmp", std::process::id()));
        // Not synced here: the first sync of received data (before any record names it)
        // takes the header with it, and a header lost in a crash is written again above.
        let made = create_state(&temp).and_then(|file| {
            file.set_len(size)?;
            file.write_all_at(header, 0)?;
            Ok(file)
        });
        let file = match made {
            Ok(file) => file,
            Err(e) => {
                let _ = fs::remove_file(&temp);
                return Err(error("create", e));
            }
        };
        let _ = fs::remove_file(self.record_path(identity));
        fs::rename(&temp, &path).map_err(|e| error("replace", e))?;
        Ok(file)
    }

    /// Holds the partial copy of a model for this process until dropped: workers that
    /// share the directory receive into it one at a time.
    pub fn lock_partial(&self, identity: &[u8; 32]) -> Result<fs::File, NodeError> {
        let path = self.root.join(STATE_DIR).join(format!("{}.lock", hex(identity)));
        let error = |source| NodeError::File {
            path: path.clone(),
            action: "lock",
            source,
        };
        let file = open_state(&path, fs::OpenOptions::new().write(true).create(true).truncate(false)).map_err(error)?;
        file.lock().map_err(error)?;
        Ok(file)
    }

    /// A cached speed measurement (seconds per layer per token) for a model.
    pub fn cached_speed(&self, identity: &[u8; 32], threads: usize, device: &str) -> Option<f32> {
        let path = self.speed_path(identity, threads, device);
        read_state(&path).ok()?.trim().parse().ok()
    }

    /// Stores a speed measurement.
    pub fn store_speed(&self, identity: &[u8; 32], threads: usize, device: &str, secs: f32) {
        let path = self.speed_path(identity, threads, device);
        let _ = open_state(&path, fs::OpenOptions::new().write(true).create(true).truncate(true))
            .and_then(|mut file| file.write_all(format!("{secs}\n").as_bytes()));
    }

    /// Measurements on the CPU keep the name they had before devices; others name theirs.
    fn speed_path(&self, identity: &[u8; 32], threads: usize, device: &str) -> PathBuf {
        let device = if device.eq_ignore_ascii_case("CPU") {
            String::new()
        } else {
            format!(".{device}")
        };
        self.root
            .join(STATE_DIR)
            .join(format!("{}{device}.t{threads}.speed", hex(identity)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_hashes_are_kept_while_the_file_is_unchanged() {
        let dir = std::env::temp_dir().join(format!("baton-tensor-hashes-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.gguf");
        let bytes: Vec<u8> = (0..64u8).collect();
        fs::write(&path, &bytes).unwrap();
        let identity = [7u8; 32];
        let places = [("a", 0, 16), ("b w", 16, 32)];
        let hashes = tensor_hashes(&path, &identity, &dir, &bytes, &places);
        assert_eq!(hashes, vec![identity_hash(&bytes[..16]), identity_hash(&bytes[16..48])]);
        // Kept: other bytes given for the same file give the recorded hashes.
        let other = vec![0u8; 64];
        assert_eq!(tensor_hashes(&path, &identity, &dir, &other, &places), hashes);
        // A tensor not recorded yet is computed and added.
        let more = tensor_hashes(&path, &identity, &dir, &bytes, &[("c", 48, 16), ("a", 0, 16)]);
        assert_eq!(more, vec![identity_hash(&bytes[48..]), hashes[0]]);
        // The file changes (its size here): nothing recorded holds.
        fs::write(&path, [&bytes[..], &[1]].concat()).unwrap();
        assert_eq!(
            tensor_hashes(&path, &identity, &dir, &other, &places),
            vec![identity_hash(&other[..16]), identity_hash(&other[16..48])]
        );
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn names_from_the_network_stay_inside_the_directory() {
        let dir = std::env::temp_dir().join(format!("baton-models-{}", std::process::id()));
        let models = ModelDir::new(&dir).unwrap();
        assert!(models.resolve("model.gguf").is_ok());
        for bad in [
            "",
            "../etc/passwd",
            "/etc/passwd",
            "a/b.gguf",
            ".baton",
            "..",
            "x\0y",
            "a\\b",
        ] {
            let err = models.resolve(bad).unwrap_err().to_string();
            assert!(err.contains("not a plain file name"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn records_stored_by_many_writers_at_once_all_succeed() {
        let dir = std::env::temp_dir().join(format!("baton-records-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let record = dir.join("x.content");
        let barrier = std::sync::Barrier::new(8);
        std::thread::scope(|scope| {
            for i in 0..8 {
                let (record, barrier) = (&record, &barrier);
                scope.spawn(move || {
                    barrier.wait();
                    for round in 0..50 {
                        store_record(record, &format!("{i} {round}\n")).unwrap();
                    }
                });
            }
        });
        assert!(fs::read_to_string(&record).unwrap().ends_with(" 49\n"));
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1, "no temporary file is left");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn content_hash_is_computed_in_the_background_and_kept_while_the_file_is_unchanged() {
        let dir = std::env::temp_dir().join(format!("baton-content-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let file = dir.join("m.gguf");
        let data: Vec<u8> = (0..(9u32 << 20)).map(|i| (i % 251) as u8).collect();
        fs::write(&file, &data).unwrap();
        let identity = [7u8; 32];
        let wait = || {
            for _ in 0..200 {
                if let Some(hash) = content_hash(&file, &identity, &dir) {
                    return hash;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            panic!("the content hash never arrived");
        };
        let expected: [u8; 32] = Sha256::digest(&data).into();
        assert_eq!(wait(), expected);
        let record = dir.join(format!("{}.content", hex(&identity)));
        assert!(record.exists(), "the hash is stored");
        assert_eq!(
            content_hash(&file, &identity, &dir),
            Some(expected),
            "and read back at once"
        );

        // A changed file (other size) is hashed again, not taken from the record.
        fs::write(&file, &data[1..]).unwrap();
        let expected: [u8; 32] = Sha256::digest(&data[1..]).into();
        assert_eq!(wait(), expected);

        // A damaged record is ignored.
        fs::write(&record, "garbage").unwrap();
        assert_eq!(wait(), expected);
        fs::remove_dir_all(&dir).unwrap();
    }

    /// Names under `.baton/` are predictable: links planted there by whoever else can
    /// write to a shared models directory must not make a node write through them.
    #[test]
    fn links_planted_under_the_state_folder_are_never_written_through() {
        use std::os::unix::fs::symlink;
        let dir = std::env::temp_dir().join(format!("baton-links-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let models = ModelDir::new(&dir).unwrap();
        let victim = dir.join("victim");
        fs::write(&victim, "precious").unwrap();
        let identity = [3u8; 32];
        let state = dir.join(STATE_DIR);
        for name in [
            format!("{}.t2.speed", hex(&identity)),
            format!("{}.gguf", hex(&identity)),
            format!("{}.gguf.{}.tmp", hex(&identity), std::process::id()),
            format!("{}.have.{}.tmp", hex(&identity), std::process::id()),
            format!("{}.lock", hex(&identity)),
        ] {
            symlink(&victim, state.join(name)).unwrap();
        }
        models.store_speed(&identity, 2, "CPU", 0.5);
        assert_eq!(
            models.cached_speed(&identity, 2, "CPU"),
            None,
            "a link is not read either"
        );
        let header = b"GGUF-header";
        models.open_partial(&identity, 64, header).unwrap();
        models.record_partial(&identity, &BTreeMap::new()).unwrap();
        assert!(
            models.lock_partial(&identity).is_err(),
            "a lock file that is a link is refused"
        );
        assert_eq!(fs::read_to_string(&victim).unwrap(), "precious");
        // The partial copy replaced the link with a file of its own.
        assert!(fs::symlink_metadata(models.partial_path(&identity)).unwrap().is_file());

        // A state folder that is itself a link is refused with the reason.
        let other = std::env::temp_dir().join(format!("baton-links2-{}", std::process::id()));
        let _ = fs::remove_dir_all(&other);
        fs::create_dir_all(&other).unwrap();
        symlink(&dir, other.join(STATE_DIR)).unwrap();
        let err = ModelDir::new(&other).err().unwrap().to_string();
        assert!(err.contains("symbolic link"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
        fs::remove_dir_all(&other).unwrap();
    }
}

//! A worker's models directory: which GGUF files it holds, their identity, partial
//! files received by streaming, and cached speed measurements. Names from the network
//! are resolved only inside the directory.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use baton_gguf::Gguf;
use baton_proto::auth::{hex, identity_hash};
use baton_proto::HeldModel;

use crate::NodeError;

/// Hidden folder inside the models directory for baton's own files.
const STATE_DIR: &str = ".baton";

/// The identity of a GGUF: SHA-256 of its header and tensor index (everything before
/// the tensor data). Cheap, and it changes whenever a tensor, its type or its place
/// changes.
pub fn identity_of(path: &Path) -> Result<([u8; 32], u64), NodeError> {
    let file =
        baton_ggml::MappedFile::open(path).map_err(|e| NodeError::Request(format!("{}: {e}", path.display())))?;
    let bytes = file.bytes();
    let gguf = Gguf::parse(bytes).map_err(|e| NodeError::Request(format!("{}: {e}", path.display())))?;
    Ok((identity_hash(&bytes[..gguf.data_offset as usize]), bytes.len() as u64))
}

/// A worker's view of its models directory.
pub struct ModelDir {
    root: PathBuf,
}

impl ModelDir {
    /// Opens (and creates) the directory.
    pub fn new(root: &Path) -> Result<ModelDir, NodeError> {
        fs::create_dir_all(root.join(STATE_DIR))
            .map_err(|e| NodeError::Request(format!("cannot use models directory {}: {e}", root.display())))?;
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
                        held.push(HeldModel {
                            file_name,
                            identity,
                            size,
                            complete: !partial,
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

    /// Tensors already received (and verified) into the partial copy.
    pub fn partial_tensors(&self, identity: &[u8; 32]) -> BTreeSet<String> {
        let list = self.root.join(STATE_DIR).join(format!("{}.have", hex(identity)));
        fs::read_to_string(list)
            .map(|s| s.lines().map(str::to_string).collect())
            .unwrap_or_default()
    }

    /// Records that the partial copy now holds `tensors`.
    pub fn record_partial(&self, identity: &[u8; 32], tensors: &BTreeSet<String>) -> Result<(), NodeError> {
        let list = self.root.join(STATE_DIR).join(format!("{}.have", hex(identity)));
        let text: String = tensors.iter().map(|t| format!("{t}\n")).collect();
        fs::write(&list, text).map_err(|e| NodeError::Request(format!("cannot write {}: {e}", list.display())))
    }

    /// A cached speed measurement (seconds per layer per token) for a model.
    pub fn cached_speed(&self, identity: &[u8; 32], threads: usize) -> Option<f32> {
        let path = self.speed_path(identity, threads);
        fs::read_to_string(path).ok()?.trim().parse().ok()
    }

    /// Stores a speed measurement.
    pub fn store_speed(&self, identity: &[u8; 32], threads: usize, secs: f32) {
        let _ = fs::write(self.speed_path(identity, threads), format!("{secs}\n"));
    }

    fn speed_path(&self, identity: &[u8; 32], threads: usize) -> PathBuf {
        self.root
            .join(STATE_DIR)
            .join(format!("{}.t{threads}.speed", hex(identity)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

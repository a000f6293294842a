//! `baton cert`: make a cluster certificate, and the `--tls-cert`/`--tls-key` arguments
//! that give one to a node.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context as _};
use baton_net::TlsConfig;
use clap::Args;

/// Arguments of `baton cert`.
#[derive(Args, Debug)]
pub struct CertArgs {
    /// Directory to write cluster.crt and cluster.key into (created if missing).
    #[arg(long)]
    out: PathBuf,
    /// Replace a certificate or key already there.
    #[arg(long)]
    force: bool,
}

/// TLS on every link with the cluster certificate (both or neither).
#[derive(Args, Clone, Debug, Default)]
pub struct TlsArgs {
    /// Cluster certificate (PEM), the same file on every node; links use TLS and accept
    /// only peers presenting this certificate (make one with `baton cert`).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Private key of the cluster certificate (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl TlsArgs {
    /// Loads the certificate and key, if given; bad files are errors naming the file.
    pub fn load(&self) -> anyhow::Result<Option<Arc<TlsConfig>>> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Ok(Some(Arc::new(TlsConfig::from_pem_files(cert, key)?))),
            (None, None) => Ok(None),
            _ => bail!("--tls-cert and --tls-key go together"),
        }
    }

    /// The same files as arguments for a child `baton worker`.
    pub fn to_args(&self) -> Vec<std::ffi::OsString> {
        let mut args = Vec::new();
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            args.extend(["--tls-cert".into(), cert.clone().into_os_string()]);
            args.extend(["--tls-key".into(), key.clone().into_os_string()]);
        }
        args
    }
}

/// Writes a new self-signed cluster certificate and its key.
pub fn cert(args: CertArgs) -> anyhow::Result<()> {
    let cert_path = args.out.join("cluster.crt");
    let key_path = args.out.join("cluster.key");
    if !args.force {
        for path in [&cert_path, &key_path] {
            if path.exists() {
                bail!(
                    "{} already exists: every node must hold the same certificate, so replacing it \
                     means copying the new one everywhere. Pass --force to replace it.",
                    path.display()
                );
            }
        }
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?;
    let mut params = rcgen::CertificateParams::new(vec!["baton-cluster".to_string()])?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "baton cluster");
    let key = rcgen::KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    write_file(&key_path, key.serialize_pem().as_bytes(), 0o600)?;
    write_file(&cert_path, cert.pem().as_bytes(), 0o644)?;
    println!("wrote {} and {}", cert_path.display(), key_path.display());
    println!(
        "copy both to every node and start each with --tls-cert {} --tls-key {}",
        cert_path.display(),
        key_path.display()
    );
    Ok(())
}

/// Writes `bytes` to `path` with permissions `mode`, also when replacing a file that had
/// others (the key must not stay readable by others after `--force`).
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> anyhow::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot set the permissions of {}", path.display()))?;
    file.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

//! The cluster token's arguments: from a file, the environment, or (discouraged) the
//! command line, where every user of the machine can read it (`ps`).

use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Args;

/// Where the cluster secret comes from.
#[derive(Args, Clone, Debug, Default)]
pub struct TokenArgs {
    /// File holding the cluster secret (surrounding whitespace is ignored); readable
    /// only by you, like an SSH key. Overrides BATON_TOKEN and --token.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Cluster secret. Prefer --token-file or the BATON_TOKEN environment variable: a
    /// command line is visible to every user of the machine.
    #[arg(long, env = "BATON_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

impl TokenArgs {
    /// The token, if one is given; an empty or short one is an error, and so is a file
    /// that cannot be read.
    pub fn load(&self) -> anyhow::Result<Option<String>> {
        let token = match &self.token_file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read the token file {}", path.display()))?;
                if let Ok(meta) = std::fs::metadata(path) {
                    if meta.permissions().mode() & 0o077 != 0 {
                        tracing::warn!(
                            "{} can be read by other users: `chmod 600 {}`",
                            path.display(),
                            path.display()
                        );
                    }
                }
                Some(text.trim().to_string())
            }
            None => self.token.clone(),
        };
        if let Some(token) = &token {
            baton_proto::auth::check_token(token.as_bytes()).map_err(|e| {
                let from = match &self.token_file {
                    Some(path) => format!("the token in {}", path.display()),
                    None => "--token (or BATON_TOKEN)".to_string(),
                };
                anyhow::anyhow!("{from}: {e}")
            })?;
        }
        Ok(token)
    }
}

//! `baton invite`, and the worker's side of `baton worker --join CODE`: a machine on
//! any network that reaches the head's API joins the cluster without being given the
//! token by hand (see `baton_proto::invite`).

use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use base64::Engine as _;
use baton_proto::invite::{join_proof, open_grant, Invite};
use clap::Args;
use serde_json::{json, Value};

/// Arguments of `baton invite`.
#[derive(Args, Debug)]
pub struct InviteArgs {
    /// The head's API, where this command asks for the invite.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The head's API as the joining machine reaches it (default: --url).
    #[arg(long)]
    public_url: Option<String>,
    /// The server's API key, if it has one (or BATON_API_KEY).
    #[arg(long, env = "BATON_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Seconds the invite stays valid (it is spent by its first join).
    #[arg(long, default_value_t = 600)]
    ttl: u64,
}

/// A client of a head's API: its error answers are read, not raised.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into()
}

/// POSTs `body` to `url`; the JSON answer, or the server's error message.
fn post(url: &str, key: Option<&str>, body: &Value) -> anyhow::Result<Value> {
    let mut request = agent().post(url);
    if let Some(key) = key {
        request = request.header("Authorization", format!("Bearer {key}"));
    }
    let mut response = request.send_json(body).with_context(|| format!("cannot reach {url}"))?;
    let status = response.status().as_u16();
    let answer: Value = response
        .body_mut()
        .read_json()
        .with_context(|| format!("{url} answered {status} without JSON"))?;
    if status != 200 {
        let why = answer["error"]["message"].as_str().unwrap_or("no reason given");
        anyhow::bail!("{url} refused ({status}): {why}");
    }
    Ok(answer)
}

/// Asks the head for an invite and prints its code.
pub fn invite(args: InviteArgs) -> anyhow::Result<()> {
    let url = args.url.trim_end_matches('/');
    let public = args.public_url.as_deref().unwrap_or(url);
    let answer = post(
        &format!("{url}/v1/cluster/invites"),
        args.api_key.as_deref(),
        &json!({ "url": public, "ttl_seconds": args.ttl }),
    )?;
    let code = answer["code"].as_str().context("the head's answer has no code")?;
    eprintln!(
        "an invite to the cluster at {public}, valid {} s, spent by its first join; on the joining machine:\n  \
         BATON_JOIN=<the code> baton worker --models DIR",
        answer["expires_in"]
    );
    println!("{code}");
    Ok(())
}

/// What a worker that joined was given.
pub struct Joined {
    /// The cluster token (also kept in `DIR/.baton/cluster.token`).
    pub token: String,
    /// The cluster's TLS certificate and key, kept next to the token.
    pub tls: Option<(PathBuf, PathBuf)>,
}

/// Joins the cluster with the invite `code` for a worker listening on `port` (reached
/// at `advertise` when given): proves the secret, opens the grant, and keeps the token
/// (and TLS files) under `models/.baton`, readable by this user only, for restarts.
pub fn join(code: &str, port: u16, advertise: Option<&str>, models: &Path) -> anyhow::Result<Joined> {
    let invite = Invite::parse(code)?;
    let nonce = baton_proto::auth::new_nonce();
    let proof = join_proof(&invite.secret, &nonce, port);
    let mut body = json!({
        "invite": invite.id,
        "nonce": baton_proto::auth::hex(&nonce),
        "port": port,
        "proof": baton_proto::auth::hex(&proof),
    });
    if let Some(addr) = advertise {
        body["address"] = json!(addr);
    }
    let answer = post(&format!("{}/cluster/join", invite.url), None, &body)?;
    let sealed = base64::engine::general_purpose::STANDARD
        .decode(answer["grant"].as_str().context("the head's answer has no grant")?)
        .context("the head's grant is not base64")?;
    let grant = open_grant(&invite.secret, &nonce, &sealed)
        .context("the head's grant does not open with this invite: it was changed on the way")?;
    let grant: Value = serde_json::from_slice(&grant).context("the head's grant is not JSON")?;
    let token = grant["token"].as_str().context("the grant has no token")?.to_string();
    baton_proto::auth::check_token(token.as_bytes())?;
    let dir = models.join(".baton");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let token_file = dir.join("cluster.token");
    write_private(&token_file, &token)?;
    let tls = match (grant["tls_cert"].as_str(), grant["tls_key"].as_str()) {
        (Some(cert), Some(key)) => {
            anyhow::ensure!(
                invite.fingerprint.as_deref() == Some(baton_proto::invite::fingerprint(cert).as_str()),
                "the head's TLS certificate is not the one the invite names"
            );
            let (cert_file, key_file) = (dir.join("cluster.crt"), dir.join("cluster.key"));
            write_private(&cert_file, cert)?;
            write_private(&key_file, key)?;
            Some((cert_file, key_file))
        }
        _ => {
            anyhow::ensure!(
                invite.fingerprint.is_none(),
                "the invite names a TLS certificate, but the head sent none"
            );
            None
        }
    };
    eprintln!(
        "joined the cluster at {} as {}; the token is kept in {} (restart with --token-file {0})",
        invite.url,
        answer["address"].as_str().unwrap_or("?"),
        token_file.display()
    );
    Ok(Joined { token, tls })
}

/// Writes `text` to `path`, readable and writable by this user only.
fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let _ = std::fs::remove_file(path);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.write_all(text.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

//! Joining the cluster through the API (see `baton_proto::invite`):
//! `POST /v1/cluster/invites` (behind the API key, like every `/v1` path) makes an
//! invite and answers its code; `POST /cluster/join` (no key: the invite is the
//! credential) takes a joining worker's proof, spends the invite, adds the worker to the
//! cluster and answers the cluster token (and TLS files) sealed for it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use axum::extract::ConnectInfo;
use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use baton_proto::auth::unhex;
use baton_proto::invite::{seal_grant, verify_join, Invite};

use super::*;

/// Invites outstanding at once; one more is refused until some are spent or expire.
pub const MAX_INVITES: usize = 64;
/// Longest an invite may live.
pub const MAX_INVITE_SECS: u64 = 7 * 24 * 3600;

/// What a joining worker is given and how it is taken in.
pub struct Joining {
    /// The cluster token.
    pub token: String,
    /// The cluster's TLS certificate and key (PEM), when it runs TLS.
    pub tls: Option<(String, String)>,
    /// Adds a worker (`host:port`) to the cluster; false when it is already a member or
    /// the cluster is full.
    pub join: Arc<dyn Fn(&str) -> bool + Send + Sync>,
    invites: Mutex<BTreeMap<String, Pending>>,
}

struct Pending {
    secret: [u8; 32],
    expires: Instant,
}

impl Joining {
    /// Invites for a cluster of `token` (and `tls`), whose workers `join` adds.
    pub fn new(token: String, tls: Option<(String, String)>, join: Arc<dyn Fn(&str) -> bool + Send + Sync>) -> Joining {
        Joining {
            token,
            tls,
            join,
            invites: Mutex::default(),
        }
    }

    fn fingerprint(&self) -> Option<String> {
        self.tls
            .as_ref()
            .map(|(cert, _)| baton_proto::invite::fingerprint(cert))
    }

    fn invites(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Pending>> {
        let mut invites = self.invites.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        invites.retain(|_, pending| pending.expires > now);
        invites
    }
}

fn joining(state: &AppState) -> Result<&Joining, ApiError> {
    state.joining.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("not_a_cluster"),
            "this server takes no workers: it runs with workers and a cluster token (--workers, --discover)",
        )
    })
}

/// `POST /v1/cluster/invites {"url", "ttl_seconds"?}`: a one-time invite to join the
/// cluster through this server at `url` (as the joining machine reaches it); answers
/// `{"code", "expires_in"}`.
pub(super) async fn invite(State(state): State<Arc<AppState>>, body: Body) -> Result<Json<Value>, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct InviteRequest {
        url: String,
        #[serde(default = "ten_minutes")]
        ttl_seconds: u64,
    }
    fn ten_minutes() -> u64 {
        600
    }
    let joining = joining(&state)?;
    let body = read_body(&state, body).await?;
    let req: InviteRequest = request::parse_json(&body)?;
    if !(1..=MAX_INVITE_SECS).contains(&req.ttl_seconds) {
        return Err(
            ApiError::invalid(format!("ttl_seconds must be between 1 and {MAX_INVITE_SECS}")).param("ttl_seconds"),
        );
    }
    let invite = Invite::new(&req.url, joining.fingerprint());
    // The code must read back: a URL it cannot carry is refused here, not at the join.
    Invite::parse(&invite.code()).map_err(|e| ApiError::invalid(format!("url: {e}")).param("url"))?;
    let mut invites = joining.invites();
    if invites.len() >= MAX_INVITES {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "invalid_request_error",
            Some("too_many_invites"),
            format!("{MAX_INVITES} invites are outstanding: use or let some expire first"),
        ));
    }
    invites.insert(
        invite.id.clone(),
        Pending {
            secret: invite.secret,
            expires: Instant::now() + Duration::from_secs(req.ttl_seconds),
        },
    );
    tracing::info!(invite = %invite.id, ttl = req.ttl_seconds, "made an invite to join the cluster");
    Ok(Json(json!({ "code": invite.code(), "expires_in": req.ttl_seconds })))
}

/// `POST /cluster/join {"invite", "nonce", "port", "proof", "address"?}`: a worker
/// listening on `port` (at the address it connects from, or `address`) joins with an
/// invite; answers `{"grant", "address"}`, the grant sealed for the invite's holder.
pub(super) async fn join(
    State(state): State<Arc<AppState>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct JoinRequest {
        invite: String,
        nonce: String,
        port: u16,
        proof: String,
        #[serde(default)]
        address: Option<String>,
    }
    let joining = joining(&state)?;
    let body = read_body(&state, body).await?;
    let req: JoinRequest = request::parse_json(&body)?;
    let unknown = || {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            Some("bad_invite"),
            "no such invite, or it was used, expired, or the proof is wrong",
        )
    };
    let nonce: [u8; 32] = unhex(&req.nonce).and_then(|n| n.try_into().ok()).ok_or_else(unknown)?;
    let proof = unhex(&req.proof).filter(|p| p.len() == 32).ok_or_else(unknown)?;
    if req.port == 0 {
        return Err(ApiError::invalid("port 0 is not a port a head can dial").param("port"));
    }
    let address = match &req.address {
        Some(addr) => {
            baton_net::Addr::parse(addr)
                .ok()
                .filter(|a| matches!(a, baton_net::Addr::Tcp(_)))
                .ok_or_else(|| ApiError::invalid(format!("address {addr:?} is not host:port")).param("address"))?;
            addr.clone()
        }
        None => SocketAddr::new(peer.ip(), req.port).to_string(),
    };
    let secret = {
        let mut invites = joining.invites();
        let pending = invites.get(&req.invite).ok_or_else(unknown)?;
        if !verify_join(&pending.secret, &nonce, req.port, &proof) {
            tracing::warn!(%peer, invite = %req.invite, "a join with a wrong proof");
            return Err(unknown());
        }
        // Spent by this join, whatever follows.
        invites.remove(&req.invite).expect("just found").secret
    };
    let mut grant = json!({ "token": joining.token });
    if let Some((cert, key)) = &joining.tls {
        grant["tls_cert"] = json!(cert);
        grant["tls_key"] = json!(key);
    }
    let sealed = seal_grant(&secret, &nonce, grant.to_string().as_bytes());
    let added = (joining.join)(&address);
    tracing::info!(%peer, worker = %address, added, "a worker joined with an invite");
    Ok(Json(json!({ "grant": STANDARD.encode(sealed), "address": address })))
}

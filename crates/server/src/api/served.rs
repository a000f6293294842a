//! A server of one model or several, each with its own engine: which model answers a
//! request, and the routes that answer for all of them (`/v1/models`, `/health`,
//! `/stats`).

use std::future::Future;

use axum::extract::Query;

use super::*;

/// The models a server serves, in the order given; the first answers requests that
/// name none.
pub(crate) struct Served {
    models: Vec<Arc<AppState>>,
}

impl Served {
    pub(super) fn new(models: Vec<Arc<AppState>>) -> Served {
        Served { models }
    }

    pub(crate) fn models(&self) -> &[Arc<AppState>] {
        &self.models
    }

    /// The model clients call `id`.
    fn named(&self, id: &str) -> Result<&Arc<AppState>, ApiError> {
        self.models.iter().find(|m| m.config.model_id == id).ok_or_else(|| {
            let ids: Vec<String> = self.models.iter().map(|m| format!("'{}'", m.config.model_id)).collect();
            ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model_not_found"),
                format!(
                    "The model '{id}' does not exist; this server serves {}.",
                    ids.join(", ")
                ),
            )
            .param("model")
        })
    }

    /// Answers a request with `handler` of the model its body's `model` field names (the
    /// first model when the body names none, or is no JSON object: that model's
    /// handler then says what is wrong with it). A server of one model hands the body
    /// on unread.
    pub(super) async fn route<F, Fut, R>(self: Arc<Self>, body: Body, handler: F) -> Response
    where
        F: FnOnce(State<Arc<AppState>>, Body) -> Fut,
        Fut: Future<Output = R>,
        R: IntoResponse,
    {
        let first = self.models[0].clone();
        if self.models.len() == 1 {
            return handler(State(first), body).await.into_response();
        }
        let chosen = async {
            let bytes = read_body(&first, body).await?;
            // Parsing scans the whole body: off the async threads, as every other parse.
            let scanned = bytes.clone();
            let named = first.off_runtime(move |_| Ok(model_field(&scanned))).await?;
            let state = match named {
                Some(id) => self.named(&id)?.clone(),
                None => first.clone(),
            };
            Ok::<_, ApiError>((state, bytes))
        };
        match chosen.await {
            Ok((state, bytes)) => handler(State(state), Body::from(bytes)).await.into_response(),
            Err(e) => e.into_response(),
        }
    }
}

/// The `model` field of a JSON request body, when it is a string.
fn model_field(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        #[serde(default)]
        model: Option<Value>,
    }
    match serde_json::from_slice::<Named>(body).ok()?.model? {
        Value::String(id) => Some(id),
        _ => None,
    }
}

/// `GET /v1/models`: every model served, in the order given.
pub(super) async fn models(State(served): State<Arc<Served>>) -> Json<Value> {
    let data: Vec<Value> = served
        .models
        .iter()
        .map(|state| {
            let slot_ctx = state.engine.slot_ctx();
            json!({
                "id": state.config.model_id,
                "object": "model",
                "created": state.created,
                "owned_by": "baton",
                // Tokens one request may hold (prompt plus generated): the cache per slot.
                "context_length": slot_ctx,
                "meta": { "slot_ctx": slot_ctx, "n_vocab": state.vocab.n_vocab() },
            })
        })
        .collect();
    Json(json!({ "object": "list", "data": data }))
}

/// One model's health: `ok` while its ring computes, with its stages and the workers
/// lost from it; `recovering` while a new ring is formed after a worker was lost
/// (requests wait); `waiting` while no ring can be formed until a lost worker returns
/// (requests are refused); `error` when the ring is gone for good.
fn health_of(state: &AppState) -> Value {
    let counters = state.engine.counters();
    let active = counters.active.load(Ordering::Relaxed);
    let queued = counters.queued.load(Ordering::Relaxed);
    let unavailable =
        |status: &str, reason: String| json!({ "status": status, "error": reason, "active": active, "queued": queued });
    match state.engine.health() {
        Health::Serving { stages, lost } => json!({
            "status": "ok",
            "active": active,
            "queued": queued,
            "stages": stages,
            "lost": lost.iter().map(|(node, why)| json!({ "node": node, "why": why })).collect::<Vec<_>>(),
            "rings_formed": counters.rings_formed.load(Ordering::Relaxed),
        }),
        Health::Recovering { reason } => unavailable("recovering", reason),
        Health::Waiting { reason } => unavailable("waiting", reason),
        Health::Failed { reason } => unavailable("error", reason),
    }
}

/// `GET /health`: 200 while every model serves, else 503. A server of one model answers
/// with that model's health; a server of several with the worst status, the requests
/// active and queued over all, and each model's health under `models`.
pub(super) async fn health(State(served): State<Arc<Served>>) -> Response {
    let each: Vec<Value> = served.models.iter().map(|state| health_of(state)).collect();
    let ok = each.iter().all(|h| h["status"] == "ok");
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    if let [one] = each.as_slice() {
        return (status, Json(one.clone())).into_response();
    }
    // The worst first: a ring gone for good, then one that cannot form, then one forming.
    let worst = ["error", "waiting", "recovering"]
        .into_iter()
        .find(|&bad| each.iter().any(|h| h["status"] == bad))
        .unwrap_or("ok");
    let sum = |key: &str| each.iter().filter_map(|h| h[key].as_u64()).sum::<u64>();
    let models: Vec<Value> = served
        .models
        .iter()
        .zip(&each)
        .map(|(state, health)| {
            let mut health = health.clone();
            health["id"] = json!(state.config.model_id);
            health
        })
        .collect();
    let body = json!({ "status": worst, "active": sum("active"), "queued": sum("queued"), "models": models });
    (status, Json(body)).into_response()
}

#[derive(serde::Deserialize)]
pub(super) struct StatsQuery {
    model: Option<String>,
}

/// `GET /stats[?model=ID]`: the engine's counters and each stage's figures for one model
/// (the first when none is named), with the ids of every model served.
pub(super) async fn stats(
    State(served): State<Arc<Served>>,
    Query(query): Query<StatsQuery>,
) -> Result<Json<Value>, ApiError> {
    let state = match &query.model {
        Some(id) => served.named(id)?,
        None => &served.models[0],
    };
    let stages = tokio::time::timeout(Duration::from_secs(10), state.engine.stage_stats())
        .await
        .map_err(|_| ApiError::server("the stages did not answer within 10 s"))?
        .map_err(|e| ApiError::server(e.to_string()))?;
    let c = state.engine.counters();
    let load = |v: &AtomicU64| v.load(Ordering::Relaxed);
    let names = match state.engine.health() {
        Health::Serving { stages, .. } => stages,
        _ => Vec::new(),
    };
    Ok(Json(json!({
        "model": state.config.model_id,
        "models": served.models.iter().map(|m| m.config.model_id.clone()).collect::<Vec<_>>(),
        "prompt_tokens_computed": load(&c.prompt_tokens_computed),
        "prompt_tokens_reused": load(&c.prompt_tokens_reused),
        "completion_tokens": load(&c.completion_tokens),
        "requests_finished": load(&c.requests_finished),
        "requests_cancelled": load(&c.requests_cancelled),
        "requests_failed": load(&c.requests_failed),
        "steps": load(&c.steps),
        "active": c.active.load(Ordering::Relaxed),
        "queued": c.queued.load(Ordering::Relaxed),
        "draft_tokens": c.draft_tokens.load(Ordering::Relaxed),
        "draft_accepted": c.draft_accepted.load(Ordering::Relaxed),
        "slot_ctx": state.engine.slot_ctx(),
        "round_trip_seconds": load(&c.round_trip_us) as f64 / 1e6,
        "workers_lost": load(&c.workers_lost),
        "workers_returned": load(&c.workers_returned),
        "workers_joined": load(&c.workers_joined),
        "stages": stages.ring.resident.iter().enumerate()
            .map(|(i, resident)| json!({
                "name": names.get(i),
                "resident_bytes": resident,
                "kv_cells_used": stages.ring.kv_used.get(i),
                "busy_seconds": stages.ring.busy_us.get(i).map(|&us| us as f64 / 1e6),
                "rows": stages.ring.rows.get(i),
                "link_bytes_sent": stages.ring.link_sent.get(i),
                "link_round_trip_seconds": stages.ring.link_rtt_us.get(i).copied().and_then(seconds),
            }))
            .collect::<Vec<_>>(),
        "head_link_round_trip_seconds": seconds(stages.head_link_rtt_us),
        "workers": state.engine.heartbeats().into_iter()
            .map(|(addr, round_trip)| json!({
                "addr": addr,
                "heartbeat_round_trip_seconds": round_trip.map(|d| d.as_secs_f64()),
            }))
            .collect::<Vec<_>>(),
    })))
}

/// Microseconds as seconds; 0 (not measured) as nothing.
fn seconds(micros: u64) -> Option<f64> {
    (micros > 0).then(|| micros as f64 / 1e6)
}

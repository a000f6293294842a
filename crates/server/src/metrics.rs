//! `GET /metrics`: Prometheus figures in the OpenMetrics text format, written by
//! `prometheus-client`. The server keeps what only it sees (request outcomes, time to
//! first token, time between tokens); the rest is read at scrape time from the engine's
//! counters and, through the ring, from every stage.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use baton_engine::Health;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::api::AppState;

type Labels = Vec<(String, String)>;

/// What the server measures itself.
#[derive(Debug)]
pub(crate) struct Metrics {
    /// Requests by endpoint and outcome.
    requests: Family<Labels, Counter>,
    /// Seconds from a request's arrival to its first generated token.
    time_to_first_token: Histogram,
    /// Seconds between consecutive tokens of one request.
    inter_token: Histogram,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            requests: Family::default(),
            // 5 ms .. ~80 s
            time_to_first_token: Histogram::new(exponential_buckets(0.005, 2.0, 15)),
            // 1 ms .. ~16 s
            inter_token: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
        }
    }
}

/// How a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Answered in full.
    Ok,
    /// Refused: the client's fault (4xx).
    ClientError,
    /// Refused or failed: the server's fault (5xx, a failure mid-stream).
    ServerError,
    /// The client went away first.
    Cancelled,
}

impl Metrics {
    pub(crate) fn request(&self, endpoint: &str, outcome: Outcome) {
        let outcome = match outcome {
            Outcome::Ok => "ok",
            Outcome::ClientError => "client_error",
            Outcome::ServerError => "server_error",
            Outcome::Cancelled => "cancelled",
        };
        self.requests
            .get_or_create(&vec![
                ("endpoint".to_string(), endpoint.to_string()),
                ("outcome".to_string(), outcome.to_string()),
            ])
            .inc();
    }
}

/// Token timing of one request.
#[derive(Debug)]
pub(crate) struct Timing {
    arrived: Instant,
    last: Option<Instant>,
}

impl Timing {
    pub(crate) fn new(arrived: Instant) -> Timing {
        Timing { arrived, last: None }
    }

    /// A token arrived now.
    pub(crate) fn token(&mut self, metrics: &Metrics) {
        let now = Instant::now();
        match self.last {
            None => metrics
                .time_to_first_token
                .observe(now.duration_since(self.arrived).as_secs_f64()),
            Some(last) => metrics.inter_token.observe(now.duration_since(last).as_secs_f64()),
        }
        self.last = Some(now);
    }
}

/// The exposition, OpenMetrics text.
pub(crate) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let mut registry = Registry::with_prefix("baton");
    let m = &state.metrics;
    registry.register("requests", "HTTP generation requests by outcome", m.requests.clone());
    registry.register(
        "time_to_first_token_seconds",
        "Time from a request's arrival to its first generated token",
        m.time_to_first_token.clone(),
    );
    registry.register(
        "inter_token_latency_seconds",
        "Time between consecutive generated tokens of a request",
        m.inter_token.clone(),
    );

    let counters = state.engine().counters();
    let load = |v: &AtomicU64| v.load(Ordering::Relaxed);
    let counter = |registry: &mut Registry, name: &str, help: &str, value: u64| {
        registry.register(name, help, ConstCounter::new(value));
    };
    let prompt = Family::<Labels, Counter>::default();
    prompt
        .get_or_create(&vec![("source".into(), "computed".into())])
        .inc_by(load(&counters.prompt_tokens_computed));
    prompt
        .get_or_create(&vec![("source".into(), "cache".into())])
        .inc_by(load(&counters.prompt_tokens_reused));
    registry.register("prompt_tokens", "Prompt tokens, computed or reused from cache", prompt);
    counter(
        &mut registry,
        "generated_tokens",
        "Tokens generated",
        load(&counters.completion_tokens),
    );
    let ended = Family::<Labels, Counter>::default();
    for (outcome, value) in [
        ("finished", &counters.requests_finished),
        ("cancelled", &counters.requests_cancelled),
        ("failed", &counters.requests_failed),
    ] {
        ended
            .get_or_create(&vec![("outcome".into(), outcome.into())])
            .inc_by(load(value));
    }
    registry.register("sequences", "Sequences the engine ended, by how", ended);
    counter(
        &mut registry,
        "steps",
        "Micro-batches sent into the ring",
        load(&counters.steps),
    );
    counter(
        &mut registry,
        "draft_tokens",
        "Drafted tokens sent through the ring",
        load(&counters.draft_tokens),
    );
    counter(
        &mut registry,
        "draft_accepted_tokens",
        "Drafted tokens accepted",
        load(&counters.draft_accepted),
    );
    counter(
        &mut registry,
        "rings_formed",
        "Rings formed after the first",
        load(&counters.rings_formed),
    );
    counter(
        &mut registry,
        "workers_lost",
        "Times a worker of the ring was lost",
        load(&counters.workers_lost),
    );
    counter(
        &mut registry,
        "workers_returned",
        "Times a lost worker came back and the ring was formed again with it",
        load(&counters.workers_returned),
    );
    counter(
        &mut registry,
        "workers_joined",
        "Times a worker joined the cluster and the ring was formed again with it",
        load(&counters.workers_joined),
    );
    let round_trip = prometheus_client::metrics::counter::ConstCounter::new(load(&counters.round_trip_us) as f64 / 1e6);
    registry.register(
        "ring_round_trip_seconds",
        "Seconds from sending each micro-batch into the ring to its answer, summed (per step: divide by steps)",
        round_trip,
    );
    let gauge = |registry: &mut Registry, name: &str, help: &str, value: i64| {
        registry.register(name, help, ConstGauge::new(value));
    };
    gauge(
        &mut registry,
        "queue_depth",
        "Requests waiting for a slot",
        counters.queued.load(Ordering::Relaxed) as i64,
    );
    gauge(
        &mut registry,
        "active_sequences",
        "Sequences being computed",
        counters.active.load(Ordering::Relaxed) as i64,
    );
    let (serving, lost) = match state.engine().health() {
        Health::Serving { lost, .. } => (1, lost.len()),
        _ => (0, 0),
    };
    gauge(&mut registry, "serving", "1 while a ring computes", serving);
    gauge(
        &mut registry,
        "workers_out",
        "Workers lost and not back in the ring",
        lost as i64,
    );

    if let Ok(Ok(stages)) = tokio::time::timeout(Duration::from_secs(2), state.engine().stage_stats()).await {
        let kv = Family::<Labels, prometheus_client::metrics::gauge::Gauge>::default();
        let resident = Family::<Labels, prometheus_client::metrics::gauge::Gauge>::default();
        let busy = Family::<Labels, prometheus_client::metrics::counter::Counter<f64>>::default();
        let rows = Family::<Labels, Counter>::default();
        let link = Family::<Labels, Counter>::default();
        let link_rtt = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        let stage_label = |stage: String| vec![("stage".to_string(), stage)];
        if stages.head_link_rtt_us > 0 {
            link_rtt
                .get_or_create(&stage_label("head".into()))
                .set(stages.head_link_rtt_us as f64 / 1e6);
        }
        for (i, &micros) in stages.link_rtt_us.iter().enumerate() {
            if micros > 0 {
                link_rtt
                    .get_or_create(&stage_label(i.to_string()))
                    .set(micros as f64 / 1e6);
            }
        }
        for (i, cells) in stages.kv_used.iter().enumerate() {
            let stage = stage_label(i.to_string());
            kv.get_or_create(&stage).set(i64::from(*cells));
            if let Some(&bytes) = stages.resident.get(i) {
                resident.get_or_create(&stage).set(bytes as i64);
            }
            if let Some(&micros) = stages.busy_us.get(i) {
                busy.get_or_create(&stage).inc_by(micros as f64 / 1e6);
            }
            if let Some(&n) = stages.rows.get(i) {
                rows.get_or_create(&stage).inc_by(n);
            }
            if let Some(&bytes) = stages.link_sent.get(i) {
                link.get_or_create(&stage).inc_by(bytes);
            }
        }
        registry.register(
            "link_bytes_sent",
            "Bytes each stage sent to the next hop (the last stage: to the head; 0 in process)",
            link,
        );
        registry.register(
            "link_round_trip_seconds",
            "Latest round trip of each stage's link to the next hop (stage=head: the head's link into the first \
             stage), timed on that link's path; one-way latency is about half. Links in process or not measured \
             have no sample",
            link_rtt,
        );
        registry.register("kv_cells_used", "KV cache cells holding a token, per stage", kv);
        registry.register("stage_resident_bytes", "Bytes resident per stage", resident);
        registry.register(
            "stage_busy_seconds",
            "Seconds each stage spent computing micro-batches (step time = rate of this / rate of steps)",
            busy,
        );
        registry.register("stage_rows", "Token rows each stage computed", rows);
    }

    let heartbeat = Family::<Labels, Gauge<f64, AtomicU64>>::default();
    for (worker, round_trip) in state.engine().heartbeats() {
        if let Some(round_trip) = round_trip {
            heartbeat
                .get_or_create(&vec![("worker".to_string(), worker)])
                .set(round_trip.as_secs_f64());
        }
    }
    registry.register(
        "heartbeat_round_trip_seconds",
        "Latest round trip of the head's heartbeat to each worker of the ring",
        heartbeat,
    );

    let mut text = String::new();
    if let Err(e) = encode(&mut text, &registry) {
        return (StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}")).into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

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
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::api::{AppState, Served};

type Labels = Vec<(String, String)>;

/// What the server measures itself. A server of several models keeps one set of
/// families for all of them, each model's samples labelled with its id; a server of one
/// model labels nothing (its exposition reads as it always has).
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    families: Arc<Families>,
    /// `model="<id>"` on a server of several models; empty otherwise.
    labels: Labels,
}

type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

#[derive(Debug)]
struct Families {
    /// Requests by endpoint and outcome.
    requests: Family<Labels, Counter>,
    /// Seconds from a request's arrival to its first generated token.
    time_to_first_token: HistogramFamily,
    /// Seconds between consecutive tokens of one request.
    inter_token: HistogramFamily,
}

impl Default for Families {
    fn default() -> Families {
        Families {
            requests: Family::default(),
            // 5 ms .. ~80 s
            time_to_first_token: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.005, 2.0, 15))),
            // 1 ms .. ~16 s
            inter_token: Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 15))),
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
    /// The metrics of model `id` among several, in the families of `shared`.
    pub(crate) fn of_model(shared: &Metrics, id: &str) -> Metrics {
        Metrics {
            families: shared.families.clone(),
            labels: model_label(id),
        }
    }

    pub(crate) fn request(&self, endpoint: &str, outcome: Outcome) {
        let outcome = match outcome {
            Outcome::Ok => "ok",
            Outcome::ClientError => "client_error",
            Outcome::ServerError => "server_error",
            Outcome::Cancelled => "cancelled",
        };
        let mut labels = self.labels.clone();
        labels.push(("endpoint".to_string(), endpoint.to_string()));
        labels.push(("outcome".to_string(), outcome.to_string()));
        self.families.requests.get_or_create(&labels).inc();
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
        let families = &metrics.families;
        match self.last {
            None => families
                .time_to_first_token
                .get_or_create(&metrics.labels)
                .observe(now.duration_since(self.arrived).as_secs_f64()),
            Some(last) => families
                .inter_token
                .get_or_create(&metrics.labels)
                .observe(now.duration_since(last).as_secs_f64()),
        }
        self.last = Some(now);
    }
}

/// `model="<id>"`.
fn model_label(id: &str) -> Labels {
    vec![("model".to_string(), id.to_string())]
}

/// `base` and one more label.
fn with(base: &Labels, key: &str, value: impl Into<String>) -> Labels {
    let mut labels = base.clone();
    labels.push((key.to_string(), value.into()));
    labels
}

type Counters = Family<Labels, Counter>;
type SecondsCounters = Family<Labels, Counter<f64, AtomicU64>>;
type Gauges = Family<Labels, Gauge>;
type SecondsGauges = Family<Labels, Gauge<f64, AtomicU64>>;

/// The figures read from each model's engine and ring at scrape time, one family per
/// name whatever the number of models.
#[derive(Default)]
struct EngineFamilies {
    prompt: Counters,
    generated: Counters,
    sequences: Counters,
    steps: Counters,
    draft_tokens: Counters,
    draft_accepted: Counters,
    rings_formed: Counters,
    workers_lost: Counters,
    workers_returned: Counters,
    workers_joined: Counters,
    round_trip: SecondsCounters,
    queue_depth: Gauges,
    active: Gauges,
    serving: Gauges,
    workers_out: Gauges,
    link_sent: Counters,
    link_rtt: SecondsGauges,
    kv: Gauges,
    resident: Gauges,
    busy: SecondsCounters,
    rows: Counters,
    heartbeat: SecondsGauges,
}

impl EngineFamilies {
    fn register(&self, registry: &mut Registry) {
        let f = self;
        registry.register(
            "prompt_tokens",
            "Prompt tokens, computed or reused from cache",
            f.prompt.clone(),
        );
        registry.register("generated_tokens", "Tokens generated", f.generated.clone());
        registry.register("sequences", "Sequences the engine ended, by how", f.sequences.clone());
        registry.register("steps", "Micro-batches sent into the ring", f.steps.clone());
        registry.register(
            "draft_tokens",
            "Drafted tokens sent through the ring",
            f.draft_tokens.clone(),
        );
        registry.register(
            "draft_accepted_tokens",
            "Drafted tokens accepted",
            f.draft_accepted.clone(),
        );
        registry.register("rings_formed", "Rings formed after the first", f.rings_formed.clone());
        registry.register(
            "workers_lost",
            "Times a worker of the ring was lost",
            f.workers_lost.clone(),
        );
        registry.register(
            "workers_returned",
            "Times a lost worker came back and the ring was formed again with it",
            f.workers_returned.clone(),
        );
        registry.register(
            "workers_joined",
            "Times a worker joined the cluster and the ring was formed again with it",
            f.workers_joined.clone(),
        );
        registry.register(
            "ring_round_trip_seconds",
            "Seconds from sending each micro-batch into the ring to its answer, summed (per step: divide by steps)",
            f.round_trip.clone(),
        );
        registry.register("queue_depth", "Requests waiting for a slot", f.queue_depth.clone());
        registry.register("active_sequences", "Sequences being computed", f.active.clone());
        registry.register("serving", "1 while a ring computes", f.serving.clone());
        registry.register(
            "workers_out",
            "Workers lost and not back in the ring",
            f.workers_out.clone(),
        );
        registry.register(
            "link_bytes_sent",
            "Bytes each stage sent to the next hop (the last stage: to the head; 0 in process)",
            f.link_sent.clone(),
        );
        registry.register(
            "link_round_trip_seconds",
            "Latest round trip of each stage's link to the next hop (stage=head: the head's link into the first \
             stage), timed on that link's path; one-way latency is about half. Links in process or not measured \
             have no sample",
            f.link_rtt.clone(),
        );
        registry.register(
            "kv_cells_used",
            "KV cache cells holding a token, per stage",
            f.kv.clone(),
        );
        registry.register("stage_resident_bytes", "Bytes resident per stage", f.resident.clone());
        registry.register(
            "stage_busy_seconds",
            "Seconds each stage spent computing micro-batches (step time = rate of this / rate of steps)",
            f.busy.clone(),
        );
        registry.register("stage_rows", "Token rows each stage computed", f.rows.clone());
        registry.register(
            "heartbeat_round_trip_seconds",
            "Latest round trip of the head's heartbeat to each worker of the ring",
            f.heartbeat.clone(),
        );
    }

    /// Adds the samples of one model's engine, labelled `model`.
    async fn add(&self, state: &AppState, model: &Labels) {
        let f = self;
        let counters = state.engine().counters();
        let load = |v: &AtomicU64| v.load(Ordering::Relaxed);
        f.prompt
            .get_or_create(&with(model, "source", "computed"))
            .inc_by(load(&counters.prompt_tokens_computed));
        f.prompt
            .get_or_create(&with(model, "source", "cache"))
            .inc_by(load(&counters.prompt_tokens_reused));
        for (outcome, value) in [
            ("finished", &counters.requests_finished),
            ("cancelled", &counters.requests_cancelled),
            ("failed", &counters.requests_failed),
        ] {
            f.sequences
                .get_or_create(&with(model, "outcome", outcome))
                .inc_by(load(value));
        }
        for (family, value) in [
            (&f.generated, &counters.completion_tokens),
            (&f.steps, &counters.steps),
            (&f.draft_tokens, &counters.draft_tokens),
            (&f.draft_accepted, &counters.draft_accepted),
            (&f.rings_formed, &counters.rings_formed),
            (&f.workers_lost, &counters.workers_lost),
            (&f.workers_returned, &counters.workers_returned),
            (&f.workers_joined, &counters.workers_joined),
        ] {
            family.get_or_create(model).inc_by(load(value));
        }
        f.round_trip
            .get_or_create(model)
            .inc_by(load(&counters.round_trip_us) as f64 / 1e6);
        f.queue_depth
            .get_or_create(model)
            .set(counters.queued.load(Ordering::Relaxed) as i64);
        f.active
            .get_or_create(model)
            .set(counters.active.load(Ordering::Relaxed) as i64);
        let (serving, lost) = match state.engine().health() {
            Health::Serving { lost, .. } => (1, lost.len()),
            _ => (0, 0),
        };
        f.serving.get_or_create(model).set(serving);
        f.workers_out.get_or_create(model).set(lost as i64);

        if let Ok(Ok(stages)) = tokio::time::timeout(Duration::from_secs(2), state.engine().stage_stats()).await {
            let stage = |stage: String| with(model, "stage", stage);
            if stages.head_link_rtt_us > 0 {
                f.link_rtt
                    .get_or_create(&stage("head".into()))
                    .set(stages.head_link_rtt_us as f64 / 1e6);
            }
            for (i, &micros) in stages.ring.link_rtt_us.iter().enumerate() {
                if micros > 0 {
                    f.link_rtt.get_or_create(&stage(i.to_string())).set(micros as f64 / 1e6);
                }
            }
            for (i, cells) in stages.ring.kv_used.iter().enumerate() {
                let stage = stage(i.to_string());
                f.kv.get_or_create(&stage).set(i64::from(*cells));
                if let Some(&bytes) = stages.ring.resident.get(i) {
                    f.resident.get_or_create(&stage).set(bytes as i64);
                }
                if let Some(&micros) = stages.ring.busy_us.get(i) {
                    f.busy.get_or_create(&stage).inc_by(micros as f64 / 1e6);
                }
                if let Some(&n) = stages.ring.rows.get(i) {
                    f.rows.get_or_create(&stage).inc_by(n);
                }
                if let Some(&bytes) = stages.ring.link_sent.get(i) {
                    f.link_sent.get_or_create(&stage).inc_by(bytes);
                }
            }
        }
        for (worker, round_trip) in state.engine().heartbeats() {
            if let Some(round_trip) = round_trip {
                f.heartbeat
                    .get_or_create(&with(model, "worker", worker))
                    .set(round_trip.as_secs_f64());
            }
        }
    }
}

/// The exposition, OpenMetrics text: every model's figures, labelled `model` when the
/// server has several.
pub(crate) async fn metrics(State(served): State<Arc<Served>>) -> Response {
    let mut registry = Registry::with_prefix("baton");
    let models = served.models();
    // Every model's state shares the families of the first.
    let m = &models[0].metrics.families;
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
    let engines = EngineFamilies::default();
    engines.register(&mut registry);
    for state in models {
        engines.add(state, &state.metrics.labels).await;
    }

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

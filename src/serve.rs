//! `baton serve`: the OpenAI-compatible API on the head of a ring.

use std::net::ToSocketAddrs;
use std::sync::Arc;

use anyhow::Context as _;
use baton_cluster::Members;
use baton_engine::{EngineConfig, Health, Pooling};
use baton_server::template::ChatTemplate;
use baton_server::{AppState, Joining, ServerConfig};
use clap::Args;

use crate::draft::DraftArgs;
use crate::ring::{ClusterArgs, Ring};
use crate::StageArgs;

/// Arguments of `baton serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    stages: StageArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    draft: DraftArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (or the BATON_API_KEY variable).
    #[arg(long, env = "BATON_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Serve on a non-loopback address without --api-key.
    #[arg(long)]
    insecure: bool,
    /// Sequences computed at once; --ctx-size is shared among them (by default each
    /// gets the model's trained context, or what memory holds).
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Most prompt tokens per micro-batch (longer prompts go in pipelined chunks).
    #[arg(long, default_value_t = 128)]
    chunk: usize,
    /// Requests that may wait for a free sequence before new ones are refused.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Model id for clients (default: the file name without .gguf).
    #[arg(long)]
    alias: Option<String>,
    /// How /v1/embeddings pools a sequence's rows: mean, cls or last (default: the
    /// GGUF's `<arch>.pooling_type`; without either, /v1/embeddings refuses requests).
    #[arg(long)]
    pooling: Option<String>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 8 << 20)]
    max_body: usize,
    /// HTTP connections open at once; the next is answered 503 and closed.
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// HTTP connections open at once from one address (an IPv6 /64 counts as one), so
    /// that one address cannot hold every connection (default: half of
    /// --max-connections).
    #[arg(long)]
    max_connections_per_source: Option<usize>,
    /// Seconds a client may leave a response unread before its connection is closed.
    #[arg(long, default_value_t = 60.0)]
    write_timeout: f64,
    /// Seconds a client may take to send a request's headers.
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a client may take to send a request's body.
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// An origin (e.g. http://localhost:3000) whose web pages may call a server without
    /// --api-key; repeat for several. The server's own page is always allowed.
    #[arg(long = "allow-origin")]
    allow_origins: Vec<String>,
    /// Seconds running requests wait for a new ring after a worker is lost before they
    /// fail (they fail at once when the workers left cannot hold the model).
    #[arg(long, default_value_t = 30.0)]
    recovery_timeout: f64,
    /// Seconds the ring may take to answer one micro-batch before it counts as broken
    /// (a stage stuck in its computation; a dead or hung worker is noticed sooner, by
    /// its heartbeat).
    #[arg(long, default_value_t = 60.0)]
    step_timeout: f64,
}

/// Starts the ring and serves until interrupted.
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let loopback = (args.host.as_str(), args.port)
        .to_socket_addrs()
        .with_context(|| format!("bad --host {}", args.host))?
        .all(|a| a.ip().is_loopback());
    // An empty key would turn authentication and the Host/Origin guard off unnoticed.
    let empty_env = args.api_key.is_none() && std::env::var_os("BATON_API_KEY").is_some_and(|v| v.is_empty());
    if empty_env || args.api_key.as_deref().is_some_and(|key| key.trim().is_empty()) {
        anyhow::bail!(
            "the API key (--api-key or BATON_API_KEY) is empty: set a key, or leave both unset \
             to serve without one"
        );
    }
    if !loopback && args.api_key.is_none() && !args.insecure {
        anyhow::bail!(
            "refusing to serve on {} without --api-key: anyone who can reach it could use the cluster. \
             Set an API key (--api-key or BATON_API_KEY), or pass --insecure to accept that.",
            args.host
        );
    }
    anyhow::ensure!(args.parallel > 0, "--parallel must be at least 1");
    anyhow::ensure!(args.max_connections > 0, "--max-connections must be at least 1");
    let per_source = args
        .max_connections_per_source
        .unwrap_or(args.max_connections.div_ceil(2));
    anyhow::ensure!(per_source > 0, "--max-connections-per-source must be at least 1");
    for (flag, secs) in [
        ("--recovery-timeout", args.recovery_timeout),
        ("--step-timeout", args.step_timeout),
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
        ("--write-timeout", args.write_timeout),
    ] {
        anyhow::ensure!(
            secs.is_finite() && secs > 0.0 && secs <= 86_400.0,
            "{flag} must be between 0 and 86400 seconds"
        );
    }
    if let Some(ctx_size) = args.stages.ctx_size {
        anyhow::ensure!(
            ctx_size / args.parallel >= 16,
            "--ctx-size {ctx_size} shared by --parallel {} leaves under 16 tokens per sequence",
            args.parallel
        );
    }
    let model_path = args.stages.model.clone();
    // One reading of the model's header, for the head and for forming the first ring.
    let file =
        baton_model::ModelFile::open(&model_path).with_context(|| format!("loading {}", model_path.display()))?;
    let hp = file.hparams().clone();
    let pooling = embedding_pooling(&file, args.pooling.as_deref())?;
    // libllama reads the whole vocabulary (0.3 to 0.5 s for 150k to 260k tokens): it
    // loads on a thread of its own while the ring forms. The engine looks tokens up only
    // for requests, and none comes before the join below.
    let late = Arc::new(LateVocab::default());
    let tokenizer = {
        let (path, late) = (model_path.clone(), late.clone());
        std::thread::Builder::new()
            .name("tokenizer".into())
            .spawn(move || load_vocab_and_template(&path, &late))
            .context("starting the tokenizer's thread")?
    };

    let mut ring = Ring::start_supervised(&model_path, file, &args.stages, &args.cluster, args.parallel)?;
    // A supervised ring is formed by the engine; it tells its own number of stages.
    let ranges = ring.ranges();
    // A supervised ring's context is chosen when it forms: the engine takes it then
    // (the draft model is sized for the most it can be).
    let n_ctx = ring
        .n_ctx()
        .or(args.stages.ctx_size)
        .unwrap_or(hp.n_ctx_train.max(1).saturating_mul(args.parallel));
    let config = EngineConfig {
        n_slots: args.parallel,
        slot_ctx: n_ctx / args.parallel,
        chunk: args.chunk.max(1),
        n_stages: ranges.len().max(1),
        max_decode_seqs: baton_engine::MAX_DECODE_SEQS,
        max_queue: args.max_queue,
        recovery_timeout: std::time::Duration::from_secs_f64(args.recovery_timeout),
        step_timeout: std::time::Duration::from_secs_f64(args.step_timeout),
        prefix_reuse: baton_engine::prefix_reuse(&hp),
        max_draft: baton_engine::max_draft(&hp),
        n_embd: hp.n_embd,
    };
    let draft = args.draft.settings()?;
    let draft_model = args.draft.load_model(
        hp.n_vocab,
        config.n_slots,
        config.slot_ctx,
        config.chunk,
        args.stages.threads(),
        !args.stages.no_repack,
    )?;
    let has_draft_model = draft_model.is_some();
    let engine = ring.engine(late, config, draft_model)?;
    let (vocab, template) = tokenizer
        .join()
        .map_err(|_| anyhow::anyhow!("the tokenizer's thread panicked"))??;
    let stages = match engine.health() {
        Health::Serving { stages, .. } if !stages.is_empty() => stages,
        _ => ranges
            .iter()
            .map(|r| format!("layers {}..{}", r.start, r.end))
            .collect(),
    };
    let model_id = args.alias.clone().unwrap_or_else(|| {
        model_path
            .file_stem()
            .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
    });
    let joining = match ring.joinable() {
        Some((members, token)) => Some(joining(members, token, &args.cluster.tls)?),
        None => None,
    };
    let state = AppState::new(
        engine,
        vocab,
        template,
        ServerConfig {
            api_key: args.api_key.clone(),
            max_body: args.max_body,
            draft,
            has_draft_model,
            body_timeout: std::time::Duration::from_secs_f64(args.body_timeout),
            loopback,
            allowed_origins: args
                .allow_origins
                .iter()
                .map(|o| o.trim_end_matches('/').to_string())
                .collect(),
            prepare_concurrency: std::thread::available_parallelism().map_or(2, |n| n.get()),
            pooling,
            ..ServerConfig::new(model_id)
        },
    );
    let state = Arc::new(match joining {
        Some(joining) => state.with_joining(joining),
        None => state,
    });

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        eprintln!(
            "serving {} on {} stage(s) [{}]",
            model_path.display(),
            stages.len(),
            stages.join(", ")
        );
        // The first stdout line is the address: scripts and tests read it.
        println!("listening on http://{addr}");
        let limits = baton_server::listen::Limits {
            max_connections: args.max_connections,
            per_source,
            header_timeout: std::time::Duration::from_secs_f64(args.header_timeout),
            write_timeout: std::time::Duration::from_secs_f64(args.write_timeout),
            shutdown_grace: std::time::Duration::from_secs(5),
        };
        baton_server::listen::serve(listener, baton_server::router(state.clone()), limits, stop_signal())
            .await
            .context("serving HTTP")
    })?;
    // The engine stops the ring before the ring's owner (and any local workers) go.
    drop(state);
    drop(ring);
    Ok(())
}

/// Loads the tokenizer and the chat template of the model at `path`, and hands the
/// tokenizer to `late` (the engine's view of it).
fn load_vocab_and_template(
    path: &std::path::Path,
    late: &LateVocab,
) -> anyhow::Result<(Arc<baton_ggml::LlamaModel>, ChatTemplate)> {
    let vocab = Arc::new(crate::load_tokenizer(path)?);
    let token_text = |token: Option<u32>| {
        token
            .map(|t| String::from_utf8_lossy(&vocab.token_bytes(t, true)).into_owned())
            .unwrap_or_default()
    };
    let template = ChatTemplate::new(
        vocab.chat_template().as_deref(),
        &token_text(vocab.bos_token()),
        &token_text(vocab.eos_token()),
    )
    .context("the model's chat template")?;
    if template.is_default() {
        tracing::warn!("the model has no chat template: using ChatML");
    }
    let _ = late.0.set(vocab.clone());
    Ok((vocab, template))
}

/// The tokenizer as the engine sees it, while it still loads: the engine forms the ring
/// meanwhile and looks tokens up only for requests, which come once it is set (a lookup
/// before would wait for it).
#[derive(Default)]
struct LateVocab(std::sync::OnceLock<Arc<baton_ggml::LlamaModel>>);

impl baton_engine::Vocab for LateVocab {
    fn is_end_of_generation(&self, token: u32) -> bool {
        self.0.wait().is_end_of_generation(token)
    }

    fn token_bytes(&self, token: u32) -> Vec<u8> {
        self.0.wait().token_bytes(token, false)
    }

    fn special_bytes(&self, token: u32) -> Vec<u8> {
        self.0.wait().token_bytes(token, true)
    }

    fn n_vocab(&self) -> usize {
        self.0.wait().n_vocab()
    }
}

/// Invites for the cluster of `token`: a worker that joins is added to `members`, and
/// given the token and the TLS files.
fn joining(members: Members, token: String, tls: &crate::cert::TlsArgs) -> anyhow::Result<Joining> {
    let tls = match (&tls.tls_cert, &tls.tls_key) {
        (Some(cert), Some(key)) => {
            let read = |path: &std::path::Path| {
                std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
            };
            Some((read(cert)?, read(key)?))
        }
        _ => None,
    };
    Ok(Joining::new(token, tls, Arc::new(move |addr: &str| members.join(addr))))
}

/// SIGINT or SIGTERM.
async fn stop_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// How /v1/embeddings pools: `--pooling` (refused at start when it names a pooling
/// the endpoint cannot serve), else the GGUF's `<arch>.pooling_type` as llama.cpp numbers
/// it (1 mean, 2 cls, 3 last); `Err` holds why every embeddings request is refused.
fn embedding_pooling(file: &baton_model::ModelFile, flag: Option<&str>) -> anyhow::Result<Result<Pooling, String>> {
    let named = |name: &str| Pooling::ALL.into_iter().find(|p| p.name() == name);
    if let Some(flag) = flag {
        return match named(flag) {
            Some(pooling) => Ok(Ok(pooling)),
            None => anyhow::bail!(
                "--pooling {flag}: /v1/embeddings pools with mean, cls or last (none gives no single vector, \
                 rank is a reranker's)"
            ),
        };
    }
    let arch = file.gguf().architecture()?.to_string();
    let key = format!("{arch}.pooling_type");
    let why = |what: String| {
        Ok(Err(format!(
            "{what}: /v1/embeddings needs mean, cls or last pooling; start the server with --pooling mean|cls|last"
        )))
    };
    match file.gguf().opt_u32(&key) {
        Ok(Some(1)) => Ok(Ok(Pooling::Mean)),
        Ok(Some(2)) => Ok(Ok(Pooling::Cls)),
        Ok(Some(3)) => Ok(Ok(Pooling::Last)),
        Ok(Some(0)) => why(format!("the model's GGUF says {key} = 0 (none)")),
        Ok(Some(4)) => why(format!("the model's GGUF says {key} = 4 (rank: a reranker)")),
        Ok(Some(n)) => why(format!(
            "the model's GGUF says {key} = {n}, which is no pooling llama.cpp knows"
        )),
        Ok(None) => why(format!("the model's GGUF names no pooling ({key} is absent)")),
        Err(e) => why(format!("the model's GGUF key {key} cannot be read ({e})")),
    }
}

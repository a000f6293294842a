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
use crate::local_workers::LocalWorkers;
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
    /// Model id for clients (default: the file name without .gguf); with several
    /// --model, the n-th --alias names the n-th model.
    #[arg(long)]
    alias: Vec<String>,
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
    let models = &args.stages.model;
    anyhow::ensure!(
        args.alias.len() <= models.len(),
        "{} --alias for {} --model: give at most one alias per model",
        args.alias.len(),
        models.len()
    );
    let ids: Vec<String> = models
        .iter()
        .enumerate()
        .map(|(i, path)| {
            args.alias.get(i).cloned().unwrap_or_else(|| {
                path.file_stem()
                    .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
            })
        })
        .collect();
    if let Some(twice) = ids
        .iter()
        .enumerate()
        .find_map(|(i, id)| ids[..i].contains(id).then_some(id))
    {
        anyhow::bail!("two models are called '{twice}': give each its own --alias");
    }
    // Several models share one set of local workers, as they would share --workers.
    let (cluster, _shared_workers) = shared_local_workers(&args)?;
    let mut rings = Vec::new();
    let mut states = Vec::new();
    let mut described = Vec::new();
    for (i, (path, id)) in models.iter().zip(&ids).enumerate() {
        let mut stages = args.stages.clone();
        stages.model = vec![path.clone()];
        // The draft model drafts for the first model (its vocabulary must be that one's).
        let (state, ring, on) = serve_model(&args, &stages, &cluster, id.clone(), loopback, i == 0)?;
        described.push(format!("{} as '{id}' on {on}", path.display()));
        states.push(state);
        rings.push(ring);
    }
    let joinable: Vec<(Members, String)> = rings.iter().filter_map(Ring::joinable).collect();
    if let Some((_, token)) = joinable.first() {
        let members = joinable.iter().map(|(m, _)| m.clone()).collect();
        let joining = joining(members, token.clone(), &cluster.tls)?;
        let first = states.remove(0).with_joining(joining);
        states.insert(0, first);
    }
    let router = baton_server::router_for(states);

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
        for line in &described {
            eprintln!("serving {line}");
        }
        // The first stdout line is the address: scripts and tests read it.
        println!("listening on http://{addr}");
        let limits = baton_server::listen::Limits {
            max_connections: args.max_connections,
            per_source,
            header_timeout: std::time::Duration::from_secs_f64(args.header_timeout),
            write_timeout: std::time::Duration::from_secs_f64(args.write_timeout),
            shutdown_grace: std::time::Duration::from_secs(5),
        };
        baton_server::listen::serve(listener, router, limits, stop_signal())
            .await
            .context("serving HTTP")
    })?;
    // The router (and with it each engine, which stops its ring) went when serving
    // ended; the rings' owners and any local workers go after.
    drop(rings);
    Ok(())
}

/// With several models and --local-workers: starts the workers once, holding every
/// model (they must share a directory), and gives the arguments that reach them as
/// --workers would; otherwise the arguments as they are.
fn shared_local_workers(args: &ServeArgs) -> anyhow::Result<(ClusterArgs, Option<LocalWorkers>)> {
    let mut cluster = args.cluster.clone();
    let models = &args.stages.model;
    let Some(n) = cluster.local_workers.filter(|_| models.len() > 1) else {
        return Ok((cluster, None));
    };
    let dir = |path: &std::path::Path| path.parent().map(std::path::Path::to_path_buf).unwrap_or_default();
    if let Some(other) = models.iter().find(|m| dir(m) != dir(&models[0])) {
        anyhow::bail!(
            "--local-workers serve one directory: {} is not beside {} (move them together, or start \
             `baton worker`s and give --workers)",
            other.display(),
            models[0].display()
        );
    }
    let threads = args.stages.threads_for(n + usize::from(!cluster.no_head_stage));
    let local = LocalWorkers::start(n, &models[0], threads, &cluster.tls)?;
    cluster.local_workers = None;
    cluster.workers = local.addrs.clone();
    cluster.token = crate::token::TokenArgs {
        token_file: None,
        token: Some(local.token.clone()),
    };
    Ok((cluster, Some(local)))
}

/// One model's ring, engine and API state; also where its stages run, for people.
fn serve_model(
    args: &ServeArgs,
    stages: &StageArgs,
    cluster: &ClusterArgs,
    model_id: String,
    loopback: bool,
    with_draft: bool,
) -> anyhow::Result<(AppState, Ring, String)> {
    let model_path = stages.one_model()?;
    // One reading of the model's header, for the head and for forming the first ring.
    let file = baton_model::ModelFile::open(model_path).with_context(|| format!("loading {}", model_path.display()))?;
    let hp = file.hparams().clone();
    let pooling = embedding_pooling(&file, args.pooling.as_deref())?;
    // libllama reads the whole vocabulary (0.3 to 0.5 s for 150k to 260k tokens): it
    // loads on a thread of its own while the ring forms. The engine looks tokens up only
    // for requests, and none comes before the join below.
    let late = Arc::new(LateVocab::default());
    let tokenizer = {
        let (path, late) = (model_path.to_path_buf(), late.clone());
        std::thread::Builder::new()
            .name("tokenizer".into())
            .spawn(move || load_vocab_and_template(&path, &late))
            .context("starting the tokenizer's thread")?
    };

    // Sliding-window layers keep a window and one batch of rows per sequence.
    anyhow::ensure!(
        args.chunk <= baton_model::DEFAULT_UBATCH || !(0..hp.n_layer).any(|l| hp.is_swa(l)),
        "--chunk {} is more than the {} rows per sequence the stages' sliding-window caches take in one batch",
        args.chunk,
        baton_model::DEFAULT_UBATCH
    );
    let mut ring = Ring::start_supervised(model_path, file, stages, cluster, args.parallel)?;
    // A supervised ring is formed by the engine; it tells its own number of stages.
    let ranges = ring.ranges();
    // A supervised ring's context is chosen when it forms: the engine takes it then
    // (the draft model is sized for the most it can be).
    let n_ctx = ring
        .n_ctx()
        .or(stages.ctx_size)
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
    // Made once the ring's context is known (a supervised ring's is chosen as it forms).
    let has_draft_model = with_draft && args.draft.has_model();
    let (draft_args, n_vocab, threads, repack) = (args.draft.clone(), hp.n_vocab, stages.threads(), !stages.no_repack);
    let (n_slots, chunk) = (config.n_slots, config.chunk);
    let draft_model = move |slot_ctx| match with_draft {
        true => draft_args.load_model(n_vocab, n_slots, slot_ctx, chunk, threads, repack),
        false => Ok(None),
    };
    let engine = ring.engine(late, config, draft_model)?;
    let (vocab, template) = tokenizer
        .join()
        .map_err(|_| anyhow::anyhow!("the tokenizer's thread panicked"))??;
    let on = match engine.health() {
        Health::Serving { stages, .. } if !stages.is_empty() => stages,
        _ => ranges
            .iter()
            .map(|r| format!("layers {}..{}", r.start, r.end))
            .collect(),
    };
    let on = format!("{} stage(s) [{}]", on.len(), on.join(", "));
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
    Ok((state, ring, on))
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
    .with_context(|| format!("the chat template of {}", path.display()))?;
    if template.is_default() {
        tracing::warn!("{} has no chat template: using ChatML", path.display());
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

/// Invites for the cluster of `token`: a worker that joins is added to every model's
/// `members`, and given the token and the TLS files.
fn joining(members: Vec<Members>, token: String, tls: &crate::cert::TlsArgs) -> anyhow::Result<Joining> {
    let tls = match (&tls.tls_cert, &tls.tls_key) {
        (Some(cert), Some(key)) => {
            let read = |path: &std::path::Path| {
                std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
            };
            Some((read(cert)?, read(key)?))
        }
        _ => None,
    };
    // `|` and not `||`: every model's ring gets the worker.
    let join = move |addr: &str| members.iter().fold(false, |added, m| m.join(addr) | added);
    Ok(Joining::new(token, tls, Arc::new(join)))
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

//! `baton status`: what a running `baton serve` is doing, from its API: the ring's
//! state, each stage's node, layers and memory, link round trips, throughput, and the
//! workers that joined, were lost or came back.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use serde_json::Value;

/// Arguments of `baton status`.
#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The head's address (what `baton serve` printed).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The server's API key, if it has one (or BATON_API_KEY).
    #[arg(long, env = "BATON_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Seconds between the two samples tokens per second are measured over.
    #[arg(long, default_value_t = 1.0)]
    interval: f64,
    /// Print the head's answers as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// On a server of several models, the one whose figures to show (default: the
    /// first).
    #[arg(long)]
    model: Option<String>,
}

/// Prints the status of the server at `args.url`.
pub fn status(args: StatusArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.interval.is_finite() && args.interval > 0.0 && args.interval <= 60.0,
        "--interval must be between 0 and 60 seconds"
    );
    let base = args.url.trim_end_matches('/').to_string();
    let agent = crate::invite::agent();
    let get = |path: &str| -> anyhow::Result<(u16, Value)> {
        let mut request = agent.get(format!("{base}{path}"));
        if let (Some(model), "/stats") = (&args.model, path) {
            request = request.query("model", model);
        }
        if let Some(key) = &args.api_key {
            request = request.header("Authorization", format!("Bearer {key}"));
        }
        let mut response = request.call().with_context(|| format!("cannot reach {base}{path}"))?;
        let status = response.status().as_u16();
        let body = response
            .body_mut()
            .read_json::<Value>()
            .with_context(|| format!("{base}{path} answered {status} without JSON"))?;
        Ok((status, body))
    };
    let (_, health) = get("/health")?;
    let models = get("/v1/models").map(|(_, m)| m).unwrap_or(Value::Null);
    let first = get("/stats").ok();
    if let Some((404, body)) = &first {
        anyhow::bail!("{}", body["error"]["message"].as_str().unwrap_or("no such model"));
    }
    let first = first.filter(|(code, _)| *code == 200).map(|(_, s)| s);
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(args.interval));
    let second = get("/stats").ok().filter(|(code, _)| *code == 200).map(|(_, s)| s);
    let elapsed = started.elapsed().as_secs_f64();
    if args.json {
        let all = serde_json::json!({ "health": health, "models": models, "stats": second });
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    print!(
        "{}",
        report(&base, &health, &models, first.as_ref(), second.as_ref(), elapsed)
    );
    Ok(())
}

/// The table `baton status` prints.
fn report(
    base: &str,
    health: &Value,
    models: &Value,
    first: Option<&Value>,
    stats: Option<&Value>,
    secs: f64,
) -> String {
    let mut out = String::new();
    let state = health["status"].as_str().unwrap_or("unknown");
    out += &format!("{base}: {state}");
    if let Some(why) = health["error"].as_str() {
        out += &format!(" ({why})");
    }
    out += "\n";
    let names: Vec<&str> = models["data"]
        .as_array()
        .map(|m| m.iter().filter_map(|m| m["id"].as_str()).collect())
        .unwrap_or_default();
    match (names.as_slice(), stats.and_then(|s| s["model"].as_str())) {
        ([], _) => {}
        ([_, _, ..], Some(shown)) => out += &format!("models: {} (figures below: {shown})\n", names.join(", ")),
        _ => out += &format!("model: {}\n", names.join(", ")),
    }
    let count = |v: &Value, key: &str| v[key].as_u64().unwrap_or(0);
    out += &format!(
        "requests: {} running, {} waiting",
        count(health, "active"),
        count(health, "queued")
    );
    let Some(stats) = stats else {
        out += "\n(no statistics: the ring is not serving)\n";
        return out;
    };
    let tokens = |s: &Value| count(s, "completion_tokens");
    let rate = first.map_or(0.0, |first| tokens(stats).saturating_sub(tokens(first)) as f64 / secs);
    out += &format!(
        "; {} finished, {} failed, {} cancelled\ntokens: {} generated, {:.1}/s now; prompt tokens {} computed, {} reused\n",
        count(stats, "requests_finished"),
        count(stats, "requests_failed"),
        count(stats, "requests_cancelled"),
        tokens(stats),
        rate,
        count(stats, "prompt_tokens_computed"),
        count(stats, "prompt_tokens_reused"),
    );
    out += &format!(
        "cluster: {} joined, {} lost, {} returned, rings formed after the first: {}\n",
        count(stats, "workers_joined"),
        count(stats, "workers_lost"),
        count(stats, "workers_returned"),
        count(health, "rings_formed"),
    );
    let busy_now = |i: usize, s: &Value| s["stages"][i]["busy_seconds"].as_f64();
    let mut rows = vec![[
        "stage".to_string(),
        "node, layers, devices".to_string(),
        "resident".to_string(),
        "busy now".to_string(),
        "next hop rtt".to_string(),
    ]];
    for (i, stage) in stats["stages"].as_array().into_iter().flatten().enumerate() {
        let busy = match (first.and_then(|f| busy_now(i, f)), busy_now(i, stats)) {
            (Some(a), Some(b)) if secs > 0.0 => format!("{:.0}%", 100.0 * (b - a).max(0.0) / secs),
            _ => "-".into(),
        };
        rows.push([
            i.to_string(),
            stage["name"].as_str().unwrap_or("?").to_string(),
            stage["resident_bytes"].as_u64().map_or("-".into(), mib),
            busy,
            stage["link_round_trip_seconds"].as_f64().map_or("-".into(), millis),
        ]);
    }
    out += &table(&rows);
    if let Some(workers) = stats["workers"].as_array().filter(|w| !w.is_empty()) {
        out += "heartbeats:\n";
        for worker in workers {
            out += &format!(
                "  {}: {}\n",
                worker["addr"].as_str().unwrap_or("?"),
                worker["round_trip_seconds"].as_f64().map_or("-".into(), millis)
            );
        }
    }
    if let Some(lost) = health["lost"].as_array().filter(|l| !l.is_empty()) {
        out += "out of the ring:\n";
        for node in lost {
            out += &format!(
                "  {}: {}\n",
                node["node"].as_str().unwrap_or("?"),
                node["why"].as_str().unwrap_or("?")
            );
        }
    }
    out
}

fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn millis(secs: f64) -> String {
    format!("{:.2} ms", secs * 1e3)
}

/// Columns padded to their widest cell.
fn table(rows: &[[String; 5]]) -> String {
    let widths: Vec<usize> = (0..5)
        .map(|c| rows.iter().map(|r| r[c].len()).max().unwrap_or(0))
        .collect();
    rows.iter()
        .map(|row| {
            let cells: Vec<String> = row.iter().zip(&widths).map(|(cell, w)| format!("{cell:<w$}")).collect();
            format!("  {}\n", cells.join("  ").trim_end())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_shows_stages_rates_and_the_nodes_out_of_the_ring() {
        let health = serde_json::json!({
            "status": "ok", "active": 1, "queued": 0, "rings_formed": 2,
            "stages": ["10.0.0.2:7070 layers 0..12", "10.0.0.3:7070 layers 12..24"],
            "lost": [{ "node": "10.0.0.4:7070", "why": "this worker is leaving the cluster" }],
        });
        let models = serde_json::json!({ "data": [{ "id": "qwen" }] });
        let stage = |busy: f64| {
            serde_json::json!({
                "name": "10.0.0.2:7070 layers 0..12", "resident_bytes": 300u64 << 20,
                "busy_seconds": busy, "link_round_trip_seconds": 0.00025,
            })
        };
        let first = serde_json::json!({ "completion_tokens": 100, "stages": [stage(1.0)] });
        let second = serde_json::json!({
            "completion_tokens": 120, "requests_finished": 3, "workers_joined": 1, "workers_lost": 1,
            "stages": [stage(1.5)],
            "workers": [{ "addr": "10.0.0.2:7070", "round_trip_seconds": 0.0004 }],
        });
        let text = report("http://h:8080", &health, &models, Some(&first), Some(&second), 1.0);
        assert!(text.starts_with("http://h:8080: ok\n"), "{text}");
        assert!(text.contains("model: qwen"), "{text}");
        assert!(text.contains("20.0/s now"), "{text}");
        assert!(
            text.contains("1 joined, 1 lost, 0 returned, rings formed after the first: 2"),
            "{text}"
        );
        assert!(text.contains("300 MiB   50%       0.25 ms"), "{text}");
        assert!(text.contains("10.0.0.2:7070: 0.40 ms"), "{text}");
        assert!(
            text.contains("10.0.0.4:7070: this worker is leaving the cluster"),
            "{text}"
        );
        let waiting = serde_json::json!({ "status": "waiting", "error": "no ring" });
        let text = report("u", &waiting, &Value::Null, None, None, 1.0);
        assert!(
            text.contains("u: waiting (no ring)") && text.contains("not serving"),
            "{text}"
        );
    }
}

//! Who may call the API: the Host and Origin checks for keyless servers, and the API key.

use super::*;

/// Keeps web pages from driving a keyless server: on loopback the `Host` must be a
/// loopback name (DNS rebinding gives an attacker's name), and a request that a browser
/// marks with an `Origin` must come from the server's own page or an allowed origin
/// (a form or `fetch` from another site). With an API key neither applies: a page
/// cannot send the key.
pub(super) async fn guard(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if state.config.api_key.is_some() {
        return next.run(request).await;
    }
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()))
        .unwrap_or_default()
        .to_string();
    let forbidden = |message: String| {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            Some("forbidden"),
            message,
        )
        .into_response()
    };
    if state.config.loopback && !is_loopback_host(&host) {
        return forbidden(format!(
            "Host '{host}' is not a loopback name: this server answers requests for localhost only"
        ));
    }
    if let Some(origin) = request.headers().get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("null").trim_end_matches('/');
        let own = [format!("http://{host}"), format!("https://{host}")];
        let allowed = own.iter().any(|o| o == origin) || state.config.allowed_origins.iter().any(|o| o == origin);
        if !allowed {
            return forbidden(format!(
                "requests from pages at {origin} are not allowed (serve with --api-key, or --allow-origin {origin})"
            ));
        }
    }
    next.run(request).await
}

/// `localhost`, `127.x.y.z` or `[::1]`, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or_default()
    } else {
        host.rsplit_once(':').map_or(host, |(name, port)| {
            if port.chars().all(|c| c.is_ascii_digit()) {
                name
            } else {
                host
            }
        })
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Every path but the page itself and a worker's join (whose invite is its
/// credential) needs the key, when there is one.
pub(super) async fn authenticate(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(key) = state.config.api_key.as_deref() else {
        return next.run(request).await;
    };
    if matches!(request.uri().path(), "/" | "/cluster/join") {
        return next.run(request).await;
    }
    // OpenAI's clients send `Authorization: Bearer KEY`, Anthropic's `x-api-key: KEY`.
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let given = bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
    match given {
        Some(given) if constant_time_eq(given.as_bytes(), key.as_bytes()) => next.run(request).await,
        Some(_) => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
            "Incorrect API key provided.",
        )
        .into_response(),
        None => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
            "You didn't provide an API key: send it as 'Authorization: Bearer KEY' (or 'x-api-key: KEY').",
        )
        .into_response(),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

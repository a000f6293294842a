//! `GET /`: a page to chat with the model and watch the ring, served from the binary
//! (no script, style or font from anywhere else).

use axum::http::header;
use axum::response::IntoResponse;

const PAGE: &str = include_str!("page.html");

pub(crate) async fn index() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // Everything comes from this server; nothing may be loaded from elsewhere.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'",
            ),
        ],
        PAGE,
    )
}

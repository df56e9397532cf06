//! The web console at `GET /`: a chat playground and a live view of the deployment, as static HTML, CSS
//! and JavaScript compiled into the binary, so a server needs no files beside it, no build step and
//! nothing from the internet.
//!
//! The page holds no data: everything it shows comes from `/v1/cluster` and `/v1/chat/completions`,
//! which keep their API-key check. So the page itself is served without the key (a browser cannot send a
//! bearer token on a navigation); when a fetch answers 401 it asks for the key, keeps it in the tab's
//! `sessionStorage` and sends it as `Authorization: Bearer` from then on.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// Path of the page's script.
pub const SCRIPT_PATH: &str = "/console/console.js";
/// Path of the page's style sheet.
pub const STYLE_PATH: &str = "/console/console.css";

const INDEX_HTML: &str = include_str!("console/index.html");
const CONSOLE_JS: &str = include_str!("console/console.js");
const CONSOLE_CSS: &str = include_str!("console/console.css");

/// Only the page's own script and style, fetches only to this origin, no framing: a page that holds an
/// API key must not run or load anything else.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The console's routes (the page and its two assets), for any state type.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            SCRIPT_PATH,
            get(|| async { asset("text/javascript; charset=utf-8", CONSOLE_JS) }),
        )
        .route(
            STYLE_PATH,
            get(|| async { asset("text/css; charset=utf-8", CONSOLE_CSS) }),
        )
}

/// One embedded file with the headers every console answer carries. `no-cache` makes a browser
/// revalidate, so a restarted server with a new binary never runs yesterday's script.
fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CONTENT_SECURITY_POLICY),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
            (
                header::REFERRER_POLICY,
                HeaderValue::from_static("no-referrer"),
            ),
        ],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_exactly_its_embedded_assets() {
        assert!(INDEX_HTML.contains(&format!("src=\"{SCRIPT_PATH}\"")));
        assert!(INDEX_HTML.contains(&format!("href=\"{STYLE_PATH}\"")));
        // Nothing from elsewhere: every src/href is this origin's (the CSP would block it anyway).
        for page in [INDEX_HTML, CONSOLE_JS, CONSOLE_CSS] {
            assert!(!page.contains("http://") && !page.contains("https://"));
        }
    }
}

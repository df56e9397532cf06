//! Request ids: the client's `X-Request-Id` when acceptable, else a minted one, echoed on every response
//! and carried into every log line about the request, on the head and on the workers it calls.

use http::{HeaderName, HeaderValue};

/// Header that correlates a request across client, proxy, head and worker logs.
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest client-given request id kept; a longer one is replaced by a minted id.
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// Whether a client-given id can go into logs and headers as it is: 1 to 128 printable ASCII
/// characters without spaces (so a text log line still splits on whitespace).
pub fn is_valid_request_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_REQUEST_ID_LEN && id.bytes().all(|b| b.is_ascii_graphic())
}

/// A fresh request id, `req-` and 32 hex digits of a random UUID.
pub fn new_request_id() -> String {
    format!("req-{}", uuid::Uuid::new_v4().simple())
}

/// The id a request goes by: the header's when it is a valid id, else a minted one.
pub fn request_id_from(header: Option<&HeaderValue>) -> String {
    header
        .and_then(|v| v.to_str().ok())
        .filter(|id| is_valid_request_id(id))
        .map_or_else(new_request_id, str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ids_are_kept_only_when_printable_and_short() {
        assert!(is_valid_request_id("abc"));
        assert!(is_valid_request_id("0af7651916cd43dd8448eb211c80319c"));
        assert!(is_valid_request_id(&"x".repeat(MAX_REQUEST_ID_LEN)));
        assert!(!is_valid_request_id(""));
        assert!(!is_valid_request_id(&"x".repeat(MAX_REQUEST_ID_LEN + 1)));
        assert!(!is_valid_request_id("two words"));
        assert!(!is_valid_request_id("tab\there"));
        assert!(!is_valid_request_id("naïve"));
        let kept = HeaderValue::from_static("abc-1");
        assert_eq!(request_id_from(Some(&kept)), "abc-1");
        let spaced = HeaderValue::from_static("a b");
        let opaque = HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap();
        for replaced in [None, Some(&spaced), Some(&opaque)] {
            let id = request_id_from(replaced);
            assert!(id.starts_with("req-") && id.len() == 36, "{id}");
            assert!(is_valid_request_id(&id));
        }
        assert_ne!(new_request_id(), new_request_id());
    }
}

//! What a serving process reports about its requests, in one place both the HTTP API (`tandem-api`) and
//! the cluster's workers (`tandem-cluster`) reach: the request id that correlates one request's log
//! lines across client, head and workers ([`request_id`]), and the Prometheus registry of the engine's
//! gauges and the request latencies ([`metrics`]). Neither needs the other's HTTP surface for it.

pub mod metrics;
pub mod request_id;

pub use metrics::{HistogramView, LatencyView, Metrics, MetricsError, FINISH_REASONS};
pub use request_id::{
    is_valid_request_id, new_request_id, request_id_from, MAX_REQUEST_ID_LEN, X_REQUEST_ID,
};

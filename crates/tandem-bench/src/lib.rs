//! `tandem bench`: a serving benchmark for any OpenAI-compatible `/v1/completions` endpoint, modelled on
//! vLLM's `benchmark_serving` so that tandem and its peers are measured by one tool with one set of
//! definitions.
//!
//! The pieces: [`workload`] builds token-exact requests (random, shared-prefix, bursty, JSONL),
//! [`arrival`] decides when each is sent (Poisson or all at once), [`client`] streams one request and
//! times every chunk, [`runner`] drives a run under a concurrency limit with a progress bar,
//! [`metrics`] turns the recorded timings into throughput, latency percentiles and goodput, [`report`]
//! writes the JSON file and the tables, and [`plot`] draws the PNG charts.

pub mod arrival;
pub mod client;
pub mod error;
pub mod metrics;
pub mod multiturn;
pub mod plot;
pub mod report;
pub mod runner;
pub mod workload;

pub use client::{Client, Endpoint};
pub use error::BenchError;
pub use metrics::{RequestRecord, Slo, Summary};
pub use report::{BenchFile, RunConfig, RunResult};
pub use runner::{run_plan, BenchPlan, SweepPoint};
pub use workload::{BurstySpec, PromptBuilder, PromptFormat, WorkloadSpec};

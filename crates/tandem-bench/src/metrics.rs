//! Metrics over recorded request timings, with the definitions of vLLM's `benchmark_serving`:
//! TTFT is the time to the first chunk carrying text; TPOT is `(e2e − ttft) / (output_tokens − 1)` per
//! request with more than one output token; ITL is every gap between consecutive token-carrying chunks
//! of every request, pooled; throughputs divide totals over successful requests by the run's duration;
//! percentiles interpolate linearly between order statistics (NumPy's default).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::workload::RequestClass;

/// What happened to one request: the raw material of every metric, kept in the result file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Which part of the workload it belongs to.
    pub class: RequestClass,
    /// When it was sent, in seconds after the run started.
    pub start_s: f64,
    /// Whether the stream completed without an error.
    pub success: bool,
    /// Prompt tokens as built by the benchmark.
    pub prompt_len: usize,
    /// Prompt tokens as the server's `usage` counted them (a BOS it adds makes this one more).
    pub server_prompt_tokens: Option<usize>,
    /// Output tokens: the server's `usage.completion_tokens`, else the number of token-carrying chunks.
    pub output_len: usize,
    /// Time to the first token-carrying chunk, seconds.
    pub ttft_s: f64,
    /// Gaps between consecutive token-carrying chunks, seconds.
    pub itl_s: Vec<f64>,
    /// Time from sending to the end of the stream, seconds.
    pub e2e_s: f64,
    /// Why it failed.
    pub error: Option<String>,
}

impl RequestRecord {
    /// `(e2e − ttft) / (output − 1)` in seconds; `None` for failed requests or a single output token.
    pub fn tpot_s(&self) -> Option<f64> {
        (self.success && self.output_len > 1)
            .then(|| (self.e2e_s - self.ttft_s) / (self.output_len - 1) as f64)
    }
}

/// Service-level objectives for goodput, in milliseconds; a request is good when it meets all given.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Time-to-first-token bound.
    pub ttft_ms: Option<f64>,
    /// Time-per-output-token bound.
    pub tpot_ms: Option<f64>,
    /// End-to-end latency bound.
    pub e2el_ms: Option<f64>,
}

impl Slo {
    /// Parses `ttft:500 tpot:50 e2el:2000` items (milliseconds), as vLLM's `--goodput` does.
    pub fn parse(items: &[String]) -> Result<Slo, String> {
        let mut slo = Slo::default();
        for item in items {
            let (key, value) = item
                .split_once(':')
                .ok_or_else(|| format!("goodput item `{item}` is not KEY:MS"))?;
            let ms: f64 = value
                .parse()
                .ok()
                .filter(|v: &f64| *v > 0.0)
                .ok_or_else(|| {
                    format!("goodput item `{item}`: `{value}` is not a positive number of ms")
                })?;
            match key {
                "ttft" => slo.ttft_ms = Some(ms),
                "tpot" => slo.tpot_ms = Some(ms),
                "e2el" => slo.e2el_ms = Some(ms),
                _ => {
                    return Err(format!(
                        "goodput key `{key}` is not one of ttft, tpot, e2el"
                    ))
                }
            }
        }
        Ok(slo)
    }

    /// Whether any objective is set.
    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.tpot_ms.is_some() || self.e2el_ms.is_some()
    }

    /// Whether a successful request met every objective (vLLM counts TPOT as 0 for one output token).
    pub fn met_by(&self, r: &RequestRecord) -> bool {
        let within = |bound: Option<f64>, seconds: f64| bound.is_none_or(|b| seconds * 1e3 <= b);
        r.success
            && within(self.ttft_ms, r.ttft_s)
            && within(self.tpot_ms, r.tpot_s().unwrap_or(0.0))
            && within(self.e2el_ms, r.e2e_s)
    }
}

/// Mean, median and tail of one latency, in milliseconds (all 0 when there are no samples, as in vLLM).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Arithmetic mean.
    pub mean: f64,
    /// 50th percentile.
    pub median: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
    /// Number of samples.
    pub count: usize,
}

impl Stats {
    /// Statistics of samples given in seconds, reported in milliseconds.
    pub fn of_seconds(samples: impl IntoIterator<Item = f64>) -> Stats {
        let mut ms: Vec<f64> = samples.into_iter().map(|s| s * 1e3).collect();
        if ms.is_empty() {
            return Stats::default();
        }
        ms.sort_by(f64::total_cmp);
        Stats {
            mean: ms.iter().sum::<f64>() / ms.len() as f64,
            median: percentile(&ms, 50.0),
            p90: percentile(&ms, 90.0),
            p99: percentile(&ms, 99.0),
            max: ms[ms.len() - 1],
            count: ms.len(),
        }
    }
}

/// The `p`-th percentile of ascending `sorted` samples, interpolating linearly between neighbours.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let rank = (p / 100.0).clamp(0.0, 1.0) * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = rank.ceil() as usize;
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

/// One distinct error message and how often it occurred.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorCount {
    /// The message.
    pub message: String,
    /// Occurrences.
    pub count: usize,
}

/// The figures of one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests that completed.
    pub completed: usize,
    /// Requests that failed.
    pub failed: usize,
    /// Seconds from the first send to the last response's end.
    pub duration_s: f64,
    /// Prompt tokens of the completed requests.
    pub total_input_tokens: usize,
    /// Output tokens of the completed requests.
    pub total_output_tokens: usize,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens per second.
    pub output_throughput: f64,
    /// Prompt plus output tokens per second.
    pub total_token_throughput: f64,
    /// Requests per second that met every SLO; `None` without `--goodput`.
    pub goodput: Option<f64>,
    /// Requests that met every SLO; `None` without `--goodput`.
    pub good_requests: Option<usize>,
    /// Time to first token.
    pub ttft_ms: Stats,
    /// Time per output token after the first.
    pub tpot_ms: Stats,
    /// Inter-token latency.
    pub itl_ms: Stats,
    /// End-to-end latency.
    pub e2el_ms: Stats,
    /// Completed requests whose server-side prompt count differed from the benchmark's.
    pub prompt_len_mismatches: usize,
    /// Distinct error messages, most frequent first.
    pub errors: Vec<ErrorCount>,
}

/// Computes a run's summary from its records and its duration.
pub fn summarize(records: &[RequestRecord], duration_s: f64, slo: &Slo) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
    let total_input_tokens: usize = ok.iter().map(|r| r.prompt_len).sum();
    let total_output_tokens: usize = ok.iter().map(|r| r.output_len).sum();
    let per_second = |x: f64| {
        if duration_s > 0.0 {
            x / duration_s
        } else {
            0.0
        }
    };
    let good_requests = slo
        .is_set()
        .then(|| ok.iter().filter(|r| slo.met_by(r)).count());
    let mut errors: BTreeMap<&str, usize> = BTreeMap::new();
    for r in records.iter().filter(|r| !r.success) {
        *errors
            .entry(r.error.as_deref().unwrap_or("unknown error"))
            .or_default() += 1;
    }
    let mut errors: Vec<ErrorCount> = errors
        .into_iter()
        .map(|(message, count)| ErrorCount {
            message: message.to_string(),
            count,
        })
        .collect();
    errors.sort_by_key(|e| std::cmp::Reverse(e.count));
    Summary {
        completed: ok.len(),
        failed: records.len() - ok.len(),
        duration_s,
        total_input_tokens,
        total_output_tokens,
        request_throughput: per_second(ok.len() as f64),
        output_throughput: per_second(total_output_tokens as f64),
        total_token_throughput: per_second((total_input_tokens + total_output_tokens) as f64),
        goodput: good_requests.map(|g| per_second(g as f64)),
        good_requests,
        ttft_ms: Stats::of_seconds(ok.iter().map(|r| r.ttft_s)),
        tpot_ms: Stats::of_seconds(ok.iter().filter_map(|r| r.tpot_s())),
        itl_ms: Stats::of_seconds(ok.iter().flat_map(|r| r.itl_s.iter().copied())),
        e2el_ms: Stats::of_seconds(ok.iter().map(|r| r.e2e_s)),
        prompt_len_mismatches: ok
            .iter()
            .filter(|r| r.server_prompt_tokens.is_some_and(|n| n != r.prompt_len))
            .count(),
        errors,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(ttft: f64, itl: &[f64], output_len: usize) -> RequestRecord {
        RequestRecord {
            class: RequestClass::Main,
            start_s: 0.0,
            success: true,
            prompt_len: 10,
            server_prompt_tokens: Some(10),
            output_len,
            ttft_s: ttft,
            itl_s: itl.to_vec(),
            e2e_s: ttft + itl.iter().sum::<f64>(),
            error: None,
        }
    }

    fn failed(message: &str) -> RequestRecord {
        RequestRecord {
            success: false,
            output_len: 0,
            error: Some(message.to_string()),
            ..record(0.0, &[], 0)
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let s = [1.0, 2.0, 3.0, 4.0];
        // numpy.percentile([1, 2, 3, 4], [50, 90, 99]) = [2.5, 3.7, 3.97]
        assert!(close(percentile(&s, 50.0), 2.5));
        assert!(close(percentile(&s, 90.0), 3.7));
        assert!(close(percentile(&s, 99.0), 3.97));
        assert!(close(percentile(&s, 0.0), 1.0));
        assert!(close(percentile(&s, 100.0), 4.0));
        assert_eq!(percentile(&[], 50.0), 0.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }

    #[test]
    fn tpot_excludes_the_first_token() {
        // ttft 100 ms, then 3 more tokens 20, 30, 40 ms apart: e2e 190 ms, tpot 90/3 = 30 ms.
        let r = record(0.1, &[0.02, 0.03, 0.04], 4);
        assert!(close(r.tpot_s().unwrap(), 0.03));
        assert_eq!(record(0.1, &[], 1).tpot_s(), None);
        assert_eq!(failed("x").tpot_s(), None);
    }

    #[test]
    fn summary_of_recorded_timings() {
        let records = vec![
            record(0.1, &[0.02, 0.03, 0.04], 4), // tpot 30 ms, e2e 190 ms
            record(0.3, &[0.05, 0.05], 3),       // tpot 50 ms, e2e 400 ms
            record(0.2, &[], 1),                 // no tpot, e2e 200 ms
            failed("HTTP 503: queue full"),
            failed("HTTP 503: queue full"),
            failed("connection refused"),
        ];
        let slo = Slo::parse(&["ttft:250".into(), "tpot:40".into()]).unwrap();
        let s = summarize(&records, 2.0, &slo);
        assert_eq!((s.completed, s.failed), (3, 3));
        assert_eq!(s.total_input_tokens, 30);
        assert_eq!(s.total_output_tokens, 8);
        assert!(close(s.request_throughput, 1.5));
        assert!(close(s.output_throughput, 4.0));
        assert!(close(s.total_token_throughput, 19.0));
        // Good: the first (ttft 100, tpot 30) and the third (ttft 200, tpot counted as 0).
        assert_eq!(s.good_requests, Some(2));
        assert!(close(s.goodput.unwrap(), 1.0));
        assert!(close(s.ttft_ms.mean, 200.0));
        assert!(close(s.ttft_ms.median, 200.0));
        assert!(close(s.ttft_ms.p90, 280.0));
        assert_eq!(s.tpot_ms.count, 2);
        assert!(close(s.tpot_ms.mean, 40.0));
        assert_eq!(s.itl_ms.count, 5);
        assert!(close(s.itl_ms.median, 40.0));
        assert!(close(s.itl_ms.max, 50.0));
        assert!(close(s.e2el_ms.median, 200.0));
        assert_eq!(s.errors.len(), 2);
        assert_eq!(s.errors[0].message, "HTTP 503: queue full");
        assert_eq!(s.errors[0].count, 2);
        assert_eq!(s.prompt_len_mismatches, 0);
    }

    #[test]
    fn no_slo_means_no_goodput_and_empty_runs_are_zero() {
        let s = summarize(&[], 0.0, &Slo::default());
        assert_eq!(s.goodput, None);
        assert_eq!(s.completed, 0);
        assert_eq!(s.request_throughput, 0.0);
        assert_eq!(s.ttft_ms, Stats::default());
    }

    #[test]
    fn slo_parsing_rejects_unknown_keys_and_bad_values() {
        let slo = Slo::parse(&["e2el:1000".into()]).unwrap();
        assert_eq!(slo.e2el_ms, Some(1000.0));
        assert!(Slo::parse(&["ttfb:10".into()]).is_err());
        assert!(Slo::parse(&["ttft".into()]).is_err());
        assert!(Slo::parse(&["ttft:-1".into()]).is_err());
    }
}

//! The scaling signals from the head's `/metrics`: two scrapes a window apart become one window's
//! [`Signals`] — token rates per role from the per-worker counters, queues, TTFT/ITL and per-role wait
//! p90 from the histograms' bucket deltas, decode KV use.

use std::collections::{BTreeMap, HashMap};

use tandem_sim::scale::{RoleSignals, Signals};

/// One series: its labels, sorted.
type Labels = BTreeMap<String, String>;

/// One scrape of the head's `/metrics`, parsed.
#[derive(Clone, Debug, Default)]
pub struct Scrape {
    series: HashMap<String, Vec<(Labels, f64)>>,
}

impl Scrape {
    /// Parses the Prometheus text format (comments skipped; a line that does not parse is ignored).
    pub fn parse(text: &str) -> Scrape {
        let mut series: HashMap<String, Vec<(Labels, f64)>> = HashMap::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((key, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = match key.split_once('{') {
                Some((name, rest)) => (name, parse_labels(rest.trim_end_matches('}'))),
                None => (key, Labels::new()),
            };
            series
                .entry(name.to_owned())
                .or_default()
                .push((labels, value));
        }
        Scrape { series }
    }

    /// The series of `name` whose labels include every `(key, value)` of `with`.
    fn matching<'a>(
        &'a self,
        name: &str,
        with: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a (Labels, f64)> + 'a {
        self.series
            .get(name)
            .into_iter()
            .flatten()
            .filter(move |(l, _)| {
                with.iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
            })
    }

    /// The sum of `name`'s series matching `with`.
    fn sum(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        self.matching(name, with).map(|(_, v)| v).sum()
    }

    /// Per `worker` label: the value of `name` for `role`.
    pub fn per_worker(&self, name: &str, role: &str) -> HashMap<String, f64> {
        self.matching(name, &[("role", role)])
            .filter_map(|(l, v)| Some((l.get("worker")?.clone(), *v)))
            .collect()
    }

    /// `name`'s cumulative buckets matching `with`, as `(le, count)` ascending.
    fn buckets(&self, name: &str, with: &[(&str, &str)]) -> Vec<(f64, f64)> {
        let mut out: Vec<(f64, f64)> = self
            .matching(&format!("{name}_bucket"), with)
            .filter_map(|(l, v)| {
                let le = l.get("le")?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, *v))
            })
            .collect();
        out.sort_by(|a, b| a.0.total_cmp(&b.0));
        out
    }
}

fn parse_labels(s: &str) -> Labels {
    let mut out = Labels::new();
    let mut rest = s;
    while let Some((key, after)) = rest.split_once("=\"") {
        // Values end at the next unescaped quote.
        let mut end = None;
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = Some(i);
                    break;
                }
                _ => escaped = false,
            }
        }
        let Some(end) = end else { break };
        out.insert(
            key.trim_start_matches(',').trim().to_owned(),
            after[..end].replace("\\\"", "\"").replace("\\\\", "\\"),
        );
        rest = &after[end + 1..];
    }
    out
}

/// The `q` quantile (0–1) of the observations between two cumulative bucket lists, in the buckets'
/// unit, interpolated linearly inside the bucket (as Prometheus's `histogram_quantile`); `None` when no
/// observation fell in the window. A quantile in the +Inf bucket is the last finite bound.
pub fn window_quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let prior: HashMap<u64, f64> = before.iter().map(|(le, c)| (le.to_bits(), *c)).collect();
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, c)| {
            let d = c - prior.get(&le.to_bits()).copied().unwrap_or(0.0);
            // A head that restarted has counts below the last scrape: this window is all there is.
            (*le, if d < 0.0 { *c } else { d })
        })
        .collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, count) in &delta {
        if count >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let inside = count - prev.1;
            let frac = if inside > 0.0 {
                (rank - prev.1) / inside
            } else {
                1.0
            };
            return Some(prev.0 + (le - prev.0) * frac);
        }
        prev = (le, count);
    }
    Some(prev.0)
}

/// The sum over workers of how much each one's counter grew (a worker seen for the first time, or
/// whose counter went back after a restart, counts from 0 only in the latter case: its first window
/// is unknown).
fn counter_growth(before: &HashMap<String, f64>, after: &HashMap<String, f64>) -> f64 {
    after
        .iter()
        .filter_map(|(w, now)| {
            let was = before.get(w)?;
            Some(if now >= was { now - was } else { *now })
        })
        .sum()
}

/// One window's signals from the scrapes at its start and end, `secs` apart.
pub fn window(before: &Scrape, after: &Scrape, secs: f64) -> Signals {
    let secs = secs.max(1e-3);
    let rate = |name: &str| {
        counter_growth(
            &before.per_worker(name, "decode"),
            &after.per_worker(name, "decode"),
        ) / secs
    };
    let p90 = |name: &str, with: &[(&str, &str)]| {
        window_quantile(&before.buckets(name, with), &after.buckets(name, with), 0.9)
            .map(|s| s * 1e3)
    };
    let wait = "tandem:role_wait_seconds";
    let kv_used = after.sum("tandem:worker_kv_blocks_used", &[("role", "decode")]);
    let kv_total = after.sum("tandem:worker_kv_blocks_total", &[("role", "decode")]);
    Signals {
        // Every request's prompt passes through a decode worker (pulled or prefilled there), so the
        // decode workers' prompt counters are the whole prompt demand.
        prefill: RoleSignals {
            tokens_per_s: rate("tandem:worker_prompt_tokens_total"),
            queue_depth: after.sum("tandem:role_queue_depth", &[("role", "prefill")]) as usize,
            wait_p90_ms: p90(wait, &[("role", "prefill")]),
        },
        decode: RoleSignals {
            tokens_per_s: rate("tandem:worker_generation_tokens_total"),
            queue_depth: (after.sum("tandem:role_queue_depth", &[("role", "decode")])
                + after.sum("tandem:admission_waiting", &[])) as usize,
            wait_p90_ms: p90(wait, &[("role", "decode")]),
        },
        ttft_p90_ms: p90("tandem:time_to_first_token_seconds", &[]),
        itl_p90_ms: p90("tandem:inter_token_latency_seconds", &[]),
        decode_kv_use: if kv_total > 0.0 {
            kv_used / kv_total
        } else {
            0.0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = r#"# HELP x
tandem:worker_generation_tokens_total{role="decode",worker="decode-a"} 100
tandem:worker_generation_tokens_total{role="decode",worker="decode-b"} 50
tandem:worker_generation_tokens_total{role="prefill",worker="prefill-a"} 7
tandem:worker_prompt_tokens_total{role="decode",worker="decode-a"} 1000
tandem:time_to_first_token_seconds_bucket{le="0.1"} 10
tandem:time_to_first_token_seconds_bucket{le="1"} 10
tandem:time_to_first_token_seconds_bucket{le="+Inf"} 10
tandem:role_wait_seconds_bucket{role="prefill",le="0.5"} 0
tandem:role_wait_seconds_bucket{role="prefill",le="+Inf"} 0
"#;

    const AFTER: &str = r#"tandem:worker_generation_tokens_total{role="decode",worker="decode-a"} 300
tandem:worker_generation_tokens_total{role="decode",worker="decode-b"} 10
tandem:worker_generation_tokens_total{role="decode",worker="decode-new"} 999
tandem:worker_generation_tokens_total{role="prefill",worker="prefill-a"} 70
tandem:worker_prompt_tokens_total{role="decode",worker="decode-a"} 3000
tandem:role_queue_depth{role="prefill"} 2
tandem:role_queue_depth{role="decode"} 1
tandem:admission_waiting 3
tandem:worker_kv_blocks_used{role="decode",worker="decode-a"} 30
tandem:worker_kv_blocks_total{role="decode",worker="decode-a"} 100
tandem:worker_kv_blocks_used{role="decode",worker="decode-b"} 10
tandem:worker_kv_blocks_total{role="decode",worker="decode-b"} 100
tandem:time_to_first_token_seconds_bucket{le="0.1"} 10
tandem:time_to_first_token_seconds_bucket{le="1"} 20
tandem:time_to_first_token_seconds_bucket{le="+Inf"} 20
tandem:role_wait_seconds_bucket{role="prefill",le="0.5"} 4
tandem:role_wait_seconds_bucket{role="prefill",le="+Inf"} 5
"#;

    #[test]
    fn a_window_reads_rates_queues_latencies_and_kv_use() {
        let s = window(&Scrape::parse(BEFORE), &Scrape::parse(AFTER), 10.0);
        // decode-a +200, decode-b restarted (10 counts), decode-new unknown; prefill's own not counted.
        assert!((s.decode.tokens_per_s - 21.0).abs() < 1e-9, "{s:?}");
        assert!((s.prefill.tokens_per_s - 200.0).abs() < 1e-9, "{s:?}");
        assert_eq!((s.prefill.queue_depth, s.decode.queue_depth), (2, 4));
        assert!((s.decode_kv_use - 0.2).abs() < 1e-9);
        // The window's 10 TTFTs all fell in (0.1, 1]: p90 at 0.1 + 0.9 · 0.9 s.
        assert!((s.ttft_p90_ms.unwrap() - 910.0).abs() < 1e-6, "{s:?}");
        // 4 of 5 waits under 0.5 s, the fifth in +Inf: p90 is the last finite bound.
        assert!((s.prefill.wait_p90_ms.unwrap() - 500.0).abs() < 1e-6);
        assert_eq!(s.decode.wait_p90_ms, None);
        assert_eq!(s.itl_p90_ms, None);
    }

    #[test]
    fn labels_with_escapes_parse() {
        let s = Scrape::parse("m{a=\"x\\\"y\",b=\"2\"} 5\nbad line\n");
        let (labels, v) = &s.series["m"][0];
        assert_eq!(labels["a"], "x\"y");
        assert_eq!(labels["b"], "2");
        assert_eq!(*v, 5.0);
    }
}

//! Arrival processes: when each request of a run is sent.

use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp};

/// Send times in seconds after the start for `n` requests arriving as a Poisson process of `rate`
/// requests per second (exponential gaps, the first request at 0); all at 0 when `rate` is infinite.
pub fn poisson_offsets(n: usize, rate: f64, rng: &mut impl Rng) -> Vec<f64> {
    if !rate.is_finite() {
        return vec![0.0; n];
    }
    let gaps = Exp::new(rate).expect("the rate is positive and finite");
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += gaps.sample(rng);
            }
            t
        })
        .collect()
}

/// When each of a run's requests is sent: the workload's own times where it fixes every one (bursty),
/// else a Poisson process of `rate` seeded with `seed`. Shared by the benchmark and the simulator.
pub fn send_times(requests: &[crate::workload::BenchRequest], rate: f64, seed: u64) -> Vec<f64> {
    if requests.iter().all(|r| r.at_s.is_some()) {
        requests.iter().filter_map(|r| r.at_s).collect()
    } else {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        poisson_offsets(requests.len(), rate, &mut rng)
    }
}

/// Parses a request rate: a positive number, or `inf` for all requests at once.
pub fn parse_rate(s: &str) -> Result<f64, String> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("inf") {
        return Ok(f64::INFINITY);
    }
    match s.parse::<f64>() {
        Ok(r) if r > 0.0 => Ok(r),
        _ => Err(format!(
            "request rate `{s}` is neither a positive number nor inf"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn infinite_rate_sends_everything_at_once() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        assert_eq!(poisson_offsets(3, f64::INFINITY, &mut rng), vec![0.0; 3]);
    }

    #[test]
    fn poisson_offsets_increase_with_the_requested_mean_gap() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let t = poisson_offsets(4000, 10.0, &mut rng);
        assert_eq!(t[0], 0.0);
        assert!(t.windows(2).all(|w| w[1] >= w[0]));
        let mean_gap = t[t.len() - 1] / (t.len() - 1) as f64;
        assert!((mean_gap - 0.1).abs() < 0.01, "mean gap {mean_gap}");
        let mut again = ChaCha8Rng::seed_from_u64(7);
        assert_eq!(poisson_offsets(4000, 10.0, &mut again), t);
    }

    #[test]
    fn rates_parse() {
        assert_eq!(parse_rate("inf"), Ok(f64::INFINITY));
        assert_eq!(parse_rate(" 2.5 "), Ok(2.5));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("fast").is_err());
    }
}

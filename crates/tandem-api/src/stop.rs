//! Stop-string detection over streamed text: text that might be the start of a stop string is held
//! back until it is known not to be, so a client never sees any part of a stop string.

/// Result of feeding one text delta through a [`StopMatcher`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopStep {
    /// Text that is now safe to send.
    pub emit: String,
    /// True when a stop string matched; `emit` ends right before it and nothing more may be sent.
    pub stopped: bool,
}

/// Finds the first occurrence of any stop string across arbitrarily split deltas.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet emitted: at most the longest stop string minus one byte, plus a delta.
    pending: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for these stop strings; empty strings are ignored (they would match everywhere).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    /// Feeds newly decoded text; returns what can be sent now and whether generation must stop.
    pub fn push(&mut self, delta: &str) -> StopStep {
        if self.stopped {
            return StopStep {
                emit: String::new(),
                stopped: true,
            };
        }
        if self.stops.is_empty() {
            return StopStep {
                emit: delta.to_owned(),
                stopped: false,
            };
        }
        self.pending.push_str(delta);
        // Emitted text never ends with a proper prefix of a stop string, so any match lies in `pending`.
        let earliest = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(pos) = earliest {
            self.stopped = true;
            let mut emit = std::mem::take(&mut self.pending);
            emit.truncate(pos);
            return StopStep {
                emit,
                stopped: true,
            };
        }
        let keep_from = self.hold_back_start();
        let emit = self.pending[..keep_from].to_owned();
        self.pending.drain(..keep_from);
        StopStep {
            emit,
            stopped: false,
        }
    }

    /// Releases held-back text at the end of generation (it can no longer become a stop string).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Byte index where the longest suffix of `pending` that is a proper prefix of some stop string begins.
    fn hold_back_start(&self) -> usize {
        let p = &self.pending;
        p.char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let suffix = &p[i..];
                self.stops
                    .iter()
                    .any(|s| s.len() > suffix.len() && s.starts_with(suffix))
            })
            .unwrap_or(p.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for d in deltas {
            let step = m.push(d);
            out.push_str(&step.emit);
            if step.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_split_across_deltas_is_never_emitted() {
        let stops = vec!["###".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(
            m.push("Hello #"),
            StopStep {
                emit: "Hello ".into(),
                stopped: false
            }
        );
        assert_eq!(
            m.push("#"),
            StopStep {
                emit: "".into(),
                stopped: false
            }
        );
        assert_eq!(
            m.push("# tail"),
            StopStep {
                emit: "".into(),
                stopped: true
            }
        );
    }

    #[test]
    fn false_start_is_released() {
        assert_eq!(
            run(&["abc"], &["xa", "b", "d"]),
            ("xabd".to_string(), false)
        );
        assert_eq!(run(&["abc"], &["xa", "b"]), ("xab".to_string(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(
            run(&["world", "lo"], &["hello world"]),
            ("hel".to_string(), true)
        );
    }

    #[test]
    fn multibyte_text_is_not_split() {
        assert_eq!(
            run(&["é!"], &["caf", "é", "?"]),
            ("café?".to_string(), false)
        );
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".to_string(), true));
    }

    #[test]
    fn no_stops_passes_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".to_string(), false));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".to_string(), false));
    }

    proptest! {
        /// However the text is split, the output is the text up to a stop occurrence (or all of it
        /// when it holds none), and it never contains a stop string.
        #[test]
        fn output_is_text_cut_at_a_stop(
            text in "[ab#é]{0,40}",
            stops in proptest::collection::vec("[ab#é]{1,4}", 1..4),
            cuts in proptest::collection::vec(0usize..60, 0..10),
        ) {
            let mut bounds: Vec<usize> = cuts.into_iter()
                .map(|c| c.min(text.len()))
                .filter(|&c| text.is_char_boundary(c))
                .collect();
            bounds.push(0);
            bounds.push(text.len());
            bounds.sort_unstable();
            bounds.dedup();
            let deltas: Vec<&str> = bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect();
            let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let (out, stopped) = run(&stop_refs, &deltas);
            let has_stop = stops.iter().any(|s| text.contains(s.as_str()));
            prop_assert_eq!(stopped, has_stop);
            prop_assert!(text.starts_with(out.as_str()));
            prop_assert!(!stops.iter().any(|s| out.contains(s.as_str())));
            if stopped {
                prop_assert!(stops.iter().any(|s| text[out.len()..].starts_with(s.as_str())));
            } else {
                prop_assert_eq!(out, text.clone());
            }
        }
    }
}

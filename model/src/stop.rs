//! Stop strings over streamed text. Text that might be the start of a stop
//! string is held back until it is known not to be, so a stop string is
//! never emitted, even when it arrives split across tokens.

/// What to do with a new piece of text.
#[derive(Debug, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text that is safe to emit now.
    pub emit: String,
    /// A stop string matched: generation must end (the match and anything
    /// after it are dropped).
    pub stopped: bool,
}

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    done: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            done: false,
        }
    }

    /// Feeds the next piece of text.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.done {
            return StopOutcome {
                emit: String::new(),
                stopped: true,
            };
        }
        self.held.push_str(text);
        // Earliest complete match wins.
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let emit = self.held[..at].to_string();
            self.held.clear();
            self.done = true;
            return StopOutcome {
                emit,
                stopped: true,
            };
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            // Every proper prefix of `s` ends at a char boundary after the first char.
            for (end, _) in s.char_indices().skip(1) {
                if end > keep && self.held.ends_with(&s[..end]) {
                    keep = end;
                }
            }
        }
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopOutcome {
            emit,
            stopped: false,
        }
    }

    /// Generation ended without a stop string: release what was held.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let o = m.push(p);
            out.push_str(&o.emit);
            if o.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_split_across_pieces_is_never_emitted() {
        assert_eq!(
            run(&["</end>"], &["hello </", "en", "d> tail"]),
            ("hello ".into(), true)
        );
        assert_eq!(run(&["STOP"], &["aS", "T", "OP"]), ("a".into(), true));
    }

    #[test]
    fn false_starts_are_released() {
        assert_eq!(run(&["abc"], &["xab", "x", "y"]), ("xabxy".into(), false));
        assert_eq!(run(&["abc"], &["ab"]), ("ab".into(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_is_safe() {
        assert_eq!(
            run(&["world", "lo"], &["hello world"]),
            ("hel".into(), true)
        );
        assert_eq!(
            run(&["終わり"], &["これで終", "わり です"]),
            ("これで".into(), true)
        );
        assert_eq!(run(&["é!"], &["caf", "é", "?"]), ("café?".into(), false));
    }
}

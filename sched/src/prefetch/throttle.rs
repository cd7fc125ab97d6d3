//! [`PrefetchThrottle`]: stops reading guesses ahead while they are mostly
//! wrong, and tries again later.
//!
//! With most experts already in RAM, the guesses that still need a read
//! are mostly the wrong ones (docs/benchmarks.md, "capping the CPU
//! prefetcher's reads"): a run under an 8 GiB cap read five bytes that
//! were never used for each one that was. The throttle watches the tier's
//! prefetch reads and how many of them were used, a few forward passes at
//! a time. When fewer than a quarter were used, it passes no guesses for a
//! while (longer each time it happens again in a row), then lets a window
//! through to measure again. Where prefetch pays (a small cache, where most
//! guesses are misses that happen), it never engages. It only decides what
//! is read ahead, never what is computed.

/// Forward passes per measured window.
const WINDOW_STEPS: u64 = 4;
/// Fewer prefetch reads than this in a window say nothing either way.
const MIN_READS: u64 = 16;
/// Used prefetch reads per read below which a window counts as wasteful
/// (1 in 4: three bytes wasted per byte used).
const MIN_USED_OF: u64 = 4;
/// Passes without prefetch after a first wasteful window, doubling after
/// each further one in a row, up to the cap.
const FIRST_PAUSE: u64 = 8;
const MAX_PAUSE: u64 = 128;

#[derive(Clone, Debug)]
pub struct PrefetchThrottle {
    /// The window being measured: its first pass and the tier's counts of
    /// prefetch reads issued and used when it began.
    start: u64,
    reads0: u64,
    used0: u64,
    /// No guesses are passed before this pass.
    paused_until: u64,
    /// The next pause's length.
    pause: u64,
    /// Passes that ran paused.
    paused_steps: u64,
    last_step: Option<u64>,
}

impl Default for PrefetchThrottle {
    fn default() -> Self {
        PrefetchThrottle {
            start: 0,
            reads0: 0,
            used0: 0,
            paused_until: 0,
            pause: FIRST_PAUSE,
            paused_steps: 0,
            last_step: None,
        }
    }
}

impl PrefetchThrottle {
    /// Whether forward pass `step` may read guesses ahead, given the tier's
    /// running totals of prefetch reads issued and used (monotonic). Called
    /// once or more per pass, steps non-decreasing.
    pub fn admit(&mut self, step: u64, reads: u64, used: u64) -> bool {
        let new_step = self.last_step != Some(step);
        self.last_step = Some(step);
        if step < self.paused_until {
            if new_step {
                self.paused_steps += 1;
            }
            return false;
        }
        if step == self.paused_until && self.paused_until != 0 && new_step {
            // A pause just ended: measure a fresh window from here.
            self.begin(step, reads, used);
            return true;
        }
        if step >= self.start + WINDOW_STEPS {
            let (dr, du) = (
                reads.saturating_sub(self.reads0),
                used.saturating_sub(self.used0),
            );
            if dr >= MIN_READS && du * MIN_USED_OF < dr {
                self.paused_until = step + self.pause;
                self.pause = (self.pause * 2).min(MAX_PAUSE);
                self.paused_steps += 1;
                return false;
            }
            if dr >= MIN_READS {
                self.pause = FIRST_PAUSE;
            }
            self.begin(step, reads, used);
        }
        true
    }

    /// Whether pass `step` falls inside a pause: [`admit`](Self::admit)
    /// will pass it no guesses, so they need not be computed.
    pub fn pauses(&self, step: u64) -> bool {
        step < self.paused_until
    }

    fn begin(&mut self, step: u64, reads: u64, used: u64) {
        self.start = step;
        self.reads0 = reads;
        self.used0 = used;
    }

    /// Forward passes that ran without reading guesses ahead.
    pub fn paused_steps(&self) -> u64 {
        self.paused_steps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives the throttle over `steps` passes of `layers` calls each, the
    /// tier reading `reads_per_step` guesses per admitted pass of which
    /// `used_per_step` are used; returns which passes were admitted.
    fn drive(steps: u64, layers: u64, reads_per_step: u64, used_per_step: u64) -> Vec<bool> {
        let mut t = PrefetchThrottle::default();
        let (mut reads, mut used) = (0u64, 0u64);
        let mut admitted = Vec::new();
        for step in 0..steps {
            let mut any = false;
            for _ in 0..layers {
                let paused = t.pauses(step);
                let ok = t.admit(step, reads, used);
                // `pauses` never says so of a pass that is admitted, and
                // says so of every pass once it has been refused.
                assert!(!(paused && ok), "pass {step}: paused, yet admitted");
                assert_eq!(t.pauses(step), !ok, "pass {step}");
                // Every call of a pass gets the same answer.
                if any {
                    assert!(ok, "pass {step} admitted, then refused");
                }
                any |= ok;
            }
            if any {
                reads += reads_per_step;
                used += used_per_step;
            }
            admitted.push(any);
        }
        let paused = admitted.iter().filter(|a| !**a).count() as u64;
        assert_eq!(t.paused_steps(), paused);
        admitted
    }

    #[test]
    fn useful_prefetch_is_never_paused() {
        // Half the reads used: well above a quarter.
        assert!(drive(400, 48, 40, 20).iter().all(|&a| a));
        // Too few reads to judge: never paused either.
        assert!(drive(400, 48, 3, 0).iter().all(|&a| a));
    }

    #[test]
    fn wasteful_prefetch_pauses_longer_each_time_and_probes() {
        // One read in six used, as under the 8 GiB cap.
        let a = drive(600, 48, 36, 6);
        // The first window runs, then a pause of 8, a probe window, 16, …
        assert!(a[..4].iter().all(|&x| x));
        assert!(!a[4] && !a[11]);
        assert!(a[12], "a probe window follows the first pause");
        let paused = a.iter().filter(|x| !**x).count();
        assert!(paused > 500, "mostly paused: {paused} of 600");
        // Never longer than the cap between probes.
        let mut run = 0;
        for &x in &a {
            run = if x { 0 } else { run + 1 };
            assert!(run as u64 <= MAX_PAUSE);
        }
    }

    #[test]
    fn a_pause_resets_once_guesses_pay_again() {
        let mut t = PrefetchThrottle::default();
        let (mut reads, mut used) = (0u64, 0u64);
        let mut step = 0;
        // Wasteful until the pause has doubled twice.
        while t.pause < 4 * FIRST_PAUSE {
            if t.admit(step, reads, used) {
                reads += 40;
                used += 2;
            }
            step += 1;
        }
        // Then useful: after the next probe window the pause is back at
        // its first length and nothing is paused again.
        for _ in 0..300 {
            if t.admit(step, reads, used) {
                reads += 40;
                used += 30;
            }
            step += 1;
        }
        assert_eq!(t.pause, FIRST_PAUSE);
        assert!(t.admit(step, reads, used));
    }
}

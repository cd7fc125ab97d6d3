//! Fault injection: make chosen reads fail or come back short.
//!
//! Higher layers need to prove that a failing read yields a clear error that
//! names the file, never a panic or a hang, and that short reads are
//! completed. Real drives fail rarely and unpredictably, so the reader
//! consults a [`FaultInjector`] (when configured) each time it is about to
//! issue a kernel read:
//!
//! - [`FaultAction::Errno`] replaces the read by a completion carrying that
//!   errno, without touching the kernel, so it exercises exactly the path a
//!   real `EIO` takes (and `EINTR`/`EAGAIN` the retry path).
//! - [`FaultAction::Short`] issues the read for real and then reports only
//!   half of the bytes the kernel returned (rounded down to the file's
//!   alignment), so the reader must resubmit the remainder.
//!
//! Reads are numbered from 1 in the order the reader issues them, counting
//! resubmissions, per reader. The injector is a cheap clonable handle, so a
//! test can add rules while the reader runs.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Which reads a rule applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultTrigger {
    /// The N-th read the reader issues (1-based, resubmissions included).
    NthRead(u64),
    /// Every read of this file (path as given to the `FileSet`).
    File(PathBuf),
    /// Every read.
    EveryRead,
}

/// What happens to a read a rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// Complete the read with this errno (e.g. `libc::EIO`).
    Errno(i32),
    /// Report half of the bytes the kernel read (a short read).
    Short,
}

/// One injection rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultRule {
    /// Which reads.
    pub trigger: FaultTrigger,
    /// What happens to them.
    pub action: FaultAction,
    /// How many times the rule fires before it retires (`None`: forever).
    pub times: Option<u32>,
}

impl FaultRule {
    /// The `n`-th read fails with `errno`.
    pub fn fail_nth_read(n: u64, errno: i32) -> Self {
        Self {
            trigger: FaultTrigger::NthRead(n),
            action: FaultAction::Errno(errno),
            times: Some(1),
        }
    }

    /// Every read of `path` fails with `errno`.
    pub fn fail_file(path: impl Into<PathBuf>, errno: i32) -> Self {
        Self {
            trigger: FaultTrigger::File(path.into()),
            action: FaultAction::Errno(errno),
            times: None,
        }
    }

    /// The `n`-th read comes back short.
    pub fn short_nth_read(n: u64) -> Self {
        Self {
            trigger: FaultTrigger::NthRead(n),
            action: FaultAction::Short,
            times: Some(1),
        }
    }

    /// Every read of `path` comes back short.
    pub fn short_file(path: impl Into<PathBuf>) -> Self {
        Self {
            trigger: FaultTrigger::File(path.into()),
            action: FaultAction::Short,
            times: None,
        }
    }

    /// Limits how many times the rule fires.
    pub fn times(mut self, times: u32) -> Self {
        self.times = Some(times);
        self
    }

    fn matches(&self, read_number: u64, path: &Path) -> bool {
        match &self.trigger {
            FaultTrigger::NthRead(n) => *n == read_number,
            FaultTrigger::File(p) => p == path,
            FaultTrigger::EveryRead => true,
        }
    }
}

#[derive(Debug, Default)]
struct Rules {
    rules: Vec<FaultRule>,
    fired: u64,
}

/// Shared, clonable set of fault rules.
#[derive(Debug, Clone, Default)]
pub struct FaultInjector {
    rules: Arc<Mutex<Rules>>,
}

impl FaultInjector {
    /// An injector with no rules.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a rule (rules are checked in the order added; the first that
    /// matches fires).
    pub fn add(&self, rule: FaultRule) -> &Self {
        self.lock().rules.push(rule);
        self
    }

    /// Removes all rules.
    pub fn clear(&self) {
        self.lock().rules.clear();
    }

    /// How many faults have fired.
    pub fn fired(&self) -> u64 {
        self.lock().fired
    }

    /// Decides the fate of read number `read_number` (1-based) of `path`.
    pub(crate) fn decide(&self, read_number: u64, path: &Path) -> Option<FaultAction> {
        let mut rules = self.lock();
        let index = rules
            .rules
            .iter()
            .position(|rule| rule.times != Some(0) && rule.matches(read_number, path))?;
        let rule = &mut rules.rules[index];
        let action = rule.action;
        if let Some(times) = rule.times.as_mut() {
            *times -= 1;
        }
        rules.fired += 1;
        Some(action)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Rules> {
        // Rules are plain data; a panic elsewhere cannot break them.
        self.rules.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_fire_as_often_as_asked() {
        let f = FaultInjector::new();
        f.add(FaultRule::fail_nth_read(3, libc::EIO));
        f.add(FaultRule::short_file("/a").times(2));
        let a = Path::new("/a");
        let b = Path::new("/b");
        assert_eq!(f.decide(1, b), None);
        assert_eq!(f.decide(3, b), Some(FaultAction::Errno(libc::EIO)));
        assert_eq!(f.decide(3, b), None);
        assert_eq!(f.decide(4, a), Some(FaultAction::Short));
        assert_eq!(f.decide(5, a), Some(FaultAction::Short));
        assert_eq!(f.decide(6, a), None);
        assert_eq!(f.fired(), 3);
    }
}

//! How much memory this process may really use: `MemAvailable` from
//! `/proc/meminfo` and the memory limit of the process's cgroup.
//!
//! A container or a systemd slice often has far less than the machine's free
//! memory; ignoring the cgroup is how an engine gets OOM-killed at load
//! (LESSONS.md: llama.cpp under an 8 GiB cgroup). The limit is the smallest
//! one on the path from the process's cgroup up to the root, because a
//! parent's limit binds its children:
//!
//! - cgroup v2: the `0::/path` line of `/proc/self/cgroup`, files
//!   `memory.max` (`max` = none) under the unified mount;
//! - cgroup v1: the line whose controllers include `memory`, files
//!   `memory.limit_in_bytes` (a huge value = none).
//!
//! Inside a cgroup namespace the path is `/` and the mount *is* the
//! process's cgroup, which the walk handles naturally. Everything here is
//! best effort: a missing file means "no limit known", never an error.

use std::path::{Path, PathBuf};

/// cgroup v1 reports "no limit" as a page-rounded `i64::MAX`; anything at or
/// above this is treated as unlimited.
const V1_UNLIMITED: u64 = 1 << 60;

/// What the machine and the cgroup allow.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryLimits {
    /// `MemAvailable` of `/proc/meminfo`, in bytes.
    pub mem_available: Option<u64>,
    /// The tightest cgroup memory limit on the way to the root, in bytes.
    pub cgroup_limit: Option<u64>,
    /// The file that limit came from.
    pub cgroup_file: Option<PathBuf>,
}

impl MemoryLimits {
    /// Reads the running system's limits.
    pub fn probe() -> MemoryLimits {
        let mem_available = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|text| parse_meminfo_available(&text));
        let (cgroup_limit, cgroup_file) = std::fs::read_to_string("/proc/self/cgroup")
            .ok()
            .and_then(|text| cgroup_limit(&text, Path::new("/sys/fs/cgroup")))
            .map_or((None, None), |(limit, file)| (Some(limit), Some(file)));
        MemoryLimits {
            mem_available,
            cgroup_limit,
            cgroup_file,
        }
    }

    /// The lower of the two, where known.
    pub fn usable(&self) -> Option<u64> {
        match (self.mem_available, self.cgroup_limit) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// `MemAvailable` in bytes from the text of `/proc/meminfo`.
pub fn parse_meminfo_available(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") | None => value.checked_mul(1024),
        Some(_) => None,
    }
}

/// The tightest memory limit for the cgroups named in `proc_self_cgroup`
/// (the text of `/proc/self/cgroup`), with `/sys/fs/cgroup` at `root`.
pub fn cgroup_limit(proc_self_cgroup: &str, root: &Path) -> Option<(u64, PathBuf)> {
    let mut best: Option<(u64, PathBuf)> = None;
    let mut consider = |found: Option<(u64, PathBuf)>| {
        if let Some((limit, file)) = found
            && best.as_ref().is_none_or(|(b, _)| limit < *b)
        {
            best = Some((limit, file));
        }
    };
    for line in proc_self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            // v2: the unified hierarchy is at the root or, on hybrid
            // systems, under `unified`.
            for mount in [root.to_path_buf(), root.join("unified")] {
                if mount.join("cgroup.controllers").exists() {
                    consider(walk_up(&mount, path, "memory.max", parse_v2));
                }
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            consider(walk_up(
                &root.join("memory"),
                path,
                "memory.limit_in_bytes",
                parse_v1,
            ));
        }
    }
    best
}

fn parse_v2(text: &str) -> Option<u64> {
    match text.trim() {
        "max" => None,
        value => value.parse().ok(),
    }
}

fn parse_v1(text: &str) -> Option<u64> {
    text.trim()
        .parse::<u64>()
        .ok()
        .filter(|&v| v < V1_UNLIMITED)
}

/// The smallest limit in `file` of `mount/path` and each of its ancestors up
/// to `mount` itself.
fn walk_up(
    mount: &Path,
    path: &str,
    file: &str,
    parse: fn(&str) -> Option<u64>,
) -> Option<(u64, PathBuf)> {
    let relative = path.trim_start_matches('/');
    let mut dir = mount.join(relative);
    let mut best: Option<(u64, PathBuf)> = None;
    loop {
        let candidate = dir.join(file);
        if let Some(limit) = std::fs::read_to_string(&candidate)
            .ok()
            .and_then(|t| parse(&t))
            && best.as_ref().is_none_or(|(b, _)| limit < *b)
        {
            best = Some((limit, candidate));
        }
        if dir == mount || !dir.starts_with(mount) {
            break;
        }
        match dir.parent() {
            Some(parent) => dir = parent.to_path_buf(),
            None => break,
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    }

    #[test]
    fn meminfo_available_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  1 kB\nMemAvailable:   22000000 kB\n";
        assert_eq!(parse_meminfo_available(text), Some(22_000_000 * 1024));
        assert_eq!(parse_meminfo_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_meminfo_available("MemAvailable: x kB\n"), None);
    }

    #[test]
    fn cgroup_v2_takes_the_tightest_limit_on_the_path() {
        let root = tempfile::tempdir().expect("tempdir");
        let r = root.path();
        write(&r.join("cgroup.controllers"), "memory\n");
        write(&r.join("a/memory.max"), "8589934592\n");
        write(&r.join("a/b/memory.max"), "max\n");
        let (limit, file) = cgroup_limit("0::/a/b\n", r).expect("limit");
        assert_eq!(limit, 8 << 30);
        assert_eq!(file, r.join("a/memory.max"));
        // A child tighter than its parent wins.
        write(&r.join("a/b/memory.max"), "1073741824\n");
        assert_eq!(cgroup_limit("0::/a/b\n", r).expect("limit").0, 1 << 30);
        // Unlimited everywhere: none.
        write(&r.join("a/b/memory.max"), "max\n");
        write(&r.join("a/memory.max"), "max\n");
        assert_eq!(cgroup_limit("0::/a/b\n", r), None);
    }

    #[test]
    fn cgroup_v2_on_a_hybrid_system_and_in_a_namespace() {
        let root = tempfile::tempdir().expect("tempdir");
        let r = root.path();
        write(&r.join("unified/cgroup.controllers"), "memory\n");
        write(&r.join("unified/memory.max"), "2147483648\n");
        // Namespaced: the path is "/", the mount is the cgroup.
        assert_eq!(cgroup_limit("0::/\n", r).expect("limit").0, 2 << 30);
    }

    #[test]
    fn cgroup_v1_memory_controller() {
        let root = tempfile::tempdir().expect("tempdir");
        let r = root.path();
        write(
            &r.join("memory/memory.limit_in_bytes"),
            "9223372036854771712\n",
        );
        write(
            &r.join("memory/job/x/memory.limit_in_bytes"),
            "4294967296\n",
        );
        let text = "9:name=systemd:/\n4:memory:/job/x\n3:cpu,cpuacct:/job/x\n0::/\n";
        assert_eq!(cgroup_limit(text, r).expect("limit").0, 4 << 30);
        // The huge "unlimited" value alone is no limit.
        assert_eq!(cgroup_limit("4:memory:/\n", r), None);
        // Missing files: no limit, no error.
        assert_eq!(cgroup_limit("4:memory:/nowhere\n", &r.join("x")), None);
    }

    #[test]
    fn usable_is_the_lower_known_value() {
        let m = MemoryLimits {
            mem_available: Some(10),
            cgroup_limit: Some(4),
            cgroup_file: None,
        };
        assert_eq!(m.usable(), Some(4));
        let m = MemoryLimits {
            mem_available: Some(10),
            ..MemoryLimits::default()
        };
        assert_eq!(m.usable(), Some(10));
        assert_eq!(MemoryLimits::default().usable(), None);
    }
}

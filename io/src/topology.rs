//! The machine's CPU and memory topology: NUMA nodes, the physical cores
//! of each, and which node a drive hangs off. The engine uses it to place
//! the reader thread near the drive and the compute threads on physical
//! cores near the memory that holds the weights.
//!
//! Built with the `hwloc` feature, the description comes from the hwloc C
//! library (through the `hwlocality` binding), and sysfs is the fallback
//! where hwloc fails; otherwise it is read from sysfs. The sysfs reader
//! goes through a root directory (`/` normally) so tests can run against a
//! simulated tree of any shape; the hwloc reader takes hwloc's synthetic
//! descriptions for the same purpose.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[cfg(feature = "hwloc")]
pub mod hwloc;

/// One logical CPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cpu {
    pub id: usize,
    pub package: usize,
    pub core: usize,
    pub node: usize,
}

/// One NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub id: usize,
    pub cpus: Vec<usize>,
    /// Bytes of memory attached (0 if unknown).
    pub mem_total: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub cpus: Vec<Cpu>,
    pub nodes: Vec<Node>,
    /// Which reader gave this description.
    pub source: TopologySource,
    /// The NUMA node of each storage device hwloc placed under a single
    /// node, by the kernel's name (`nvme0n1`); empty from sysfs, where
    /// [`Topology::block_device_node`] walks the device's directory.
    block_nodes: BTreeMap<String, usize>,
    root: PathBuf,
}

/// Which reader described a [`Topology`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TopologySource {
    #[default]
    Sysfs,
    Hwloc,
}

impl std::fmt::Display for TopologySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TopologySource::Sysfs => "sysfs",
            TopologySource::Hwloc => "hwloc",
        })
    }
}

/// Parses a kernel cpu list such as `0-3,8,10-11`.
pub fn parse_cpu_list(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    out.extend(a..=b.min(a + 65_536));
                }
            }
            None => {
                if let Ok(v) = part.trim().parse() {
                    out.push(v);
                }
            }
        }
    }
    out
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

impl Topology {
    /// This machine's topology: hwloc's where this build has it and hwloc
    /// describes the machine, else sysfs's; restricted to the CPUs this
    /// thread may run on (`taskset`, a container's CPU set), which the
    /// threads it starts inherit.
    pub fn detect() -> Topology {
        let mut t = Self::unrestricted();
        if let Some(allowed) = allowed_cpus() {
            t.keep_cpus(&allowed);
        }
        t
    }

    fn unrestricted() -> Topology {
        #[cfg(feature = "hwloc")]
        match hwloc::this_machine() {
            Ok(t) => return t,
            Err(e) => tracing::warn!("{e}; reading the topology from sysfs"),
        }
        Topology::from_root(Path::new("/"))
    }

    /// Leaves out every CPU not in `allowed` (from the CPUs and from each
    /// node's list; a node keeps its memory). Placing compute threads on
    /// CPUs the process may not use would leave them unpinned, more of them
    /// than CPUs, spinning against each other. An `allowed` that shares no
    /// CPU with the description changes nothing.
    pub fn keep_cpus(&mut self, allowed: &[usize]) {
        if !self.cpus.iter().any(|c| allowed.contains(&c.id)) {
            return;
        }
        self.cpus.retain(|c| allowed.contains(&c.id));
        for n in &mut self.nodes {
            n.cpus.retain(|c| allowed.contains(c));
        }
    }

    /// The topology described by the sysfs tree under `root`. Missing
    /// pieces degrade to one node holding every online CPU, each its own
    /// core.
    pub fn from_root(root: &Path) -> Topology {
        let sys_cpu = root.join("sys/devices/system/cpu");
        let online = read_trim(&sys_cpu.join("online"))
            .map(|s| parse_cpu_list(&s))
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| {
                (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
            });
        let sys_node = root.join("sys/devices/system/node");
        let mut nodes = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&sys_node) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                let Some(id) = name
                    .strip_prefix("node")
                    .and_then(|n| n.parse::<usize>().ok())
                else {
                    continue;
                };
                let cpus: Vec<usize> = read_trim(&e.path().join("cpulist"))
                    .map(|s| parse_cpu_list(&s))
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|c| online.contains(c))
                    .collect();
                let mem_total = read_trim(&e.path().join("meminfo"))
                    .and_then(|m| {
                        m.lines().find(|l| l.contains("MemTotal:")).and_then(|l| {
                            l.split_whitespace()
                                .rev()
                                .nth(1)
                                .and_then(|kb| kb.parse::<u64>().ok())
                        })
                    })
                    .map_or(0, |kb| kb * 1024);
                nodes.push(Node {
                    id,
                    cpus,
                    mem_total,
                });
            }
        }
        nodes.sort_by_key(|n| n.id);
        if nodes.is_empty() || nodes.iter().all(|n| n.cpus.is_empty()) {
            nodes = vec![Node {
                id: 0,
                cpus: online.clone(),
                mem_total: 0,
            }];
        }
        let node_of: BTreeMap<usize, usize> = nodes
            .iter()
            .flat_map(|n| n.cpus.iter().map(move |&c| (c, n.id)))
            .collect();
        let cpus = online
            .iter()
            .map(|&id| {
                let t = sys_cpu.join(format!("cpu{id}/topology"));
                let num = |f: &str| read_trim(&t.join(f)).and_then(|s| s.parse::<usize>().ok());
                Cpu {
                    id,
                    package: num("physical_package_id").unwrap_or(0),
                    // Without topology files every CPU counts as a core.
                    core: num("core_id").unwrap_or(id),
                    node: node_of.get(&id).copied().unwrap_or(0),
                }
            })
            .collect();
        Topology {
            cpus,
            nodes,
            source: TopologySource::Sysfs,
            block_nodes: BTreeMap::new(),
            root: root.to_path_buf(),
        }
    }

    /// One logical CPU per physical core (the lowest-numbered sibling), on
    /// `node` or everywhere.
    pub fn physical_cores(&self, node: Option<usize>) -> Vec<usize> {
        let mut seen = std::collections::BTreeSet::new();
        let mut out = Vec::new();
        for c in &self.cpus {
            if node.is_some_and(|n| n != c.node) {
                continue;
            }
            if seen.insert((c.package, c.core)) {
                out.push(c.id);
            }
        }
        out
    }

    /// The NUMA node the block device holding `path` is attached to, if
    /// the machine says.
    pub fn drive_node(&self, path: &Path) -> Option<usize> {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(path).ok()?.dev();
        // SAFETY: major/minor only split the integer.
        let (maj, min) = (libc::major(dev), libc::minor(dev));
        self.block_device_node(maj, min)
    }

    /// The NUMA node of block device `major:minor`: where hwloc placed the
    /// device (a partition, its disk) under one node, else the nearest
    /// ancestor of its sysfs directory that states a non-negative
    /// `numa_node`.
    pub fn block_device_node(&self, major: u32, minor: u32) -> Option<usize> {
        let link = self.root.join(format!("sys/dev/block/{major}:{minor}"));
        let mut dir = std::fs::canonicalize(&link).ok()?;
        // The device's name, then its disk's (`nvme0n1p1`, `nvme0n1`).
        let named = dir
            .iter()
            .rev()
            .take(2)
            .find_map(|n| self.block_nodes.get(n.to_str()?));
        if let Some(&node) = named {
            return Some(node);
        }
        loop {
            if let Some(v) = read_trim(&dir.join("numa_node")).and_then(|s| s.parse::<i64>().ok())
                && v >= 0
            {
                return Some(v as usize);
            }
            if !dir.pop() || dir == self.root || dir.as_os_str().len() <= 1 {
                return None;
            }
        }
    }

    /// Where to run: the reader near the drive, compute threads on the
    /// physical cores of the node with the most memory (where the weights
    /// and caches will live) — or of the drive's node when memory sizes are
    /// unknown — `threads` of them at most (0: all of that node's cores).
    pub fn placement(&self, drive: Option<usize>, threads: usize) -> Placement {
        let multi = self.nodes.len() > 1;
        let compute_node = if !multi {
            None
        } else if self.nodes.iter().any(|n| n.mem_total > 0) {
            self.nodes
                .iter()
                .filter(|n| !n.cpus.is_empty())
                .max_by_key(|n| (n.mem_total, std::cmp::Reverse(n.id)))
                .map(|n| n.id)
        } else {
            drive.or(Some(self.nodes[0].id))
        };
        let mut cores = self.physical_cores(compute_node);
        if cores.is_empty() {
            cores = self.physical_cores(None);
        }
        if threads > 0 && threads < cores.len() {
            cores.truncate(threads);
        } else if threads > cores.len() {
            // More threads than physical cores asked for: add the rest of
            // the logical CPUs (siblings, then other nodes).
            for c in &self.cpus {
                if cores.len() >= threads {
                    break;
                }
                if !cores.contains(&c.id) {
                    cores.push(c.id);
                }
            }
        }
        let reader_cpus = match drive {
            Some(n) if multi => self
                .nodes
                .iter()
                .find(|x| x.id == n)
                .map(|x| x.cpus.clone())
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        Placement {
            topology: self.source,
            compute_node,
            compute_cpus: cores,
            drive_node: drive,
            reader_cpus,
            multi_node: multi,
        }
    }
}

/// Where the engine's threads (and memory) go. The default places nothing
/// (threads run wherever the OS puts them).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Placement {
    /// Which reader described the machine.
    pub topology: TopologySource,
    /// The node whose memory holds the weights (multi-node hosts only).
    pub compute_node: Option<usize>,
    /// One CPU per compute thread, physical cores first.
    pub compute_cpus: Vec<usize>,
    pub drive_node: Option<usize>,
    /// CPUs the reader thread may run on (empty: anywhere).
    pub reader_cpus: Vec<usize>,
    pub multi_node: bool,
}

impl Placement {
    pub fn render(&self) -> String {
        format!(
            "placement: {} compute thread{} on cpus {:?}{}; reader {}{} (topology from {})",
            self.compute_cpus.len(),
            if self.compute_cpus.len() == 1 {
                ""
            } else {
                "s"
            },
            self.compute_cpus,
            self.compute_node.map_or(String::new(), |n| format!(
                " (node {n}, its memory holds the weights)"
            )),
            if self.reader_cpus.is_empty() {
                "anywhere".to_string()
            } else {
                format!("on cpus {:?}", self.reader_cpus)
            },
            self.drive_node
                .map_or(String::new(), |n| format!(" (the drive is on node {n})")),
            self.topology,
        )
    }
}

/// The CPUs the calling thread may run on (`sched_getaffinity`), if the
/// kernel says.
pub fn allowed_cpus() -> Option<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most
    // size_of::<cpu_set_t>() bytes into it, and CPU_ISSET reads inside it
    // for ids below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect();
        (!cpus.is_empty()).then_some(cpus)
    }
}

/// Pins the calling thread to `cpus` (no-op for an empty list). Failure
/// (a container that forbids it, a CPU that went offline) is reported,
/// never fatal: placement is a speed matter.
pub fn pin_current_thread(cpus: &[usize]) -> std::io::Result<()> {
    if cpus.is_empty() {
        return Ok(());
    }
    // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET write inside it for
    // ids below CPU_SETSIZE (checked), and sched_setaffinity reads
    // size_of::<cpu_set_t>() bytes from a valid pointer.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        for &c in cpus {
            if c < libc::CPU_SETSIZE as usize {
                libc::CPU_SET(c, &mut set);
            }
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Binds the pages of `[ptr, ptr + len)` to NUMA `node` (`mbind`,
/// MPOL_BIND); call before the pages are first touched. Single-node hosts
/// need nothing; errors are reported, never fatal.
pub fn bind_memory(ptr: *mut u8, len: usize, node: usize) -> std::io::Result<()> {
    const MPOL_BIND: libc::c_long = 2;
    if node >= 64 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "node id above 63",
        ));
    }
    let mask: libc::c_ulong = 1 << node;
    // SAFETY: mbind only changes the policy of pages in the given range of
    // this process's own mapping (the caller passes a mapping it owns) and
    // reads `maxnode` bits from the mask word we pass.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            ptr as libc::c_ulong,
            len as libc::c_ulong,
            MPOL_BIND,
            &mask as *const libc::c_ulong,
            64 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    /// Two sockets, two NUMA nodes, 4 cores × 2 threads each; an NVMe
    /// drive on node 1; node 1 has more memory.
    fn simulated() -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let r = t.path();
        write(r, "sys/devices/system/cpu/online", "0-15\n");
        for cpu in 0..16usize {
            let package = cpu / 8;
            let core = cpu % 4; // siblings: cpu and cpu+4 within a package
            write(
                r,
                &format!("sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id"),
                &format!("{package}\n"),
            );
            write(
                r,
                &format!("sys/devices/system/cpu/cpu{cpu}/topology/core_id"),
                &format!("{core}\n"),
            );
        }
        write(r, "sys/devices/system/node/node0/cpulist", "0-7\n");
        write(r, "sys/devices/system/node/node1/cpulist", "8-15\n");
        write(
            r,
            "sys/devices/system/node/node0/meminfo",
            "Node 0 MemTotal:       16000000 kB\n",
        );
        write(
            r,
            "sys/devices/system/node/node1/meminfo",
            "Node 1 MemTotal:       32000000 kB\n",
        );
        write(r, "sys/devices/pci0000:80/0000:80:01.0/numa_node", "1\n");
        write(
            r,
            "sys/devices/pci0000:80/0000:80:01.0/nvme/nvme0/nvme0n1/nvme0n1p1/dev",
            "259:1\n",
        );
        std::fs::create_dir_all(r.join("sys/dev/block")).unwrap();
        std::os::unix::fs::symlink(
            r.join("sys/devices/pci0000:80/0000:80:01.0/nvme/nvme0/nvme0n1/nvme0n1p1"),
            r.join("sys/dev/block/259:1"),
        )
        .unwrap();
        t
    }

    #[test]
    fn cpu_lists_parse() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list(""), Vec::<usize>::new());
        assert_eq!(parse_cpu_list("x,2"), vec![2]);
    }

    #[test]
    fn simulated_two_node_host_places_threads_on_physical_cores_near_memory() {
        let t = simulated();
        let topo = Topology::from_root(t.path());
        assert_eq!(topo.nodes.len(), 2);
        assert_eq!(topo.physical_cores(Some(0)), vec![0, 1, 2, 3]);
        assert_eq!(topo.physical_cores(Some(1)), vec![8, 9, 10, 11]);
        assert_eq!(topo.physical_cores(None).len(), 8);
        assert_eq!(
            topo.block_device_node(259, 1),
            Some(1),
            "partition walks up to the PCI device"
        );
        assert_eq!(topo.block_device_node(8, 0), None);
        let p = topo.placement(Some(1), 0);
        assert_eq!(p.compute_node, Some(1), "the node with most memory");
        assert_eq!(
            p.compute_cpus,
            vec![8, 9, 10, 11],
            "physical cores only by default"
        );
        assert_eq!(p.reader_cpus, (8..16).collect::<Vec<_>>());
        let p = topo.placement(Some(1), 2);
        assert_eq!(p.compute_cpus, vec![8, 9]);
        let p = topo.placement(Some(1), 6);
        assert_eq!(
            p.compute_cpus.len(),
            6,
            "beyond physical cores, siblings are added"
        );
        assert!(p.compute_cpus.starts_with(&[8, 9, 10, 11]));
        assert!(p.render().contains("node 1"));
    }

    /// A process allowed only some CPUs (`taskset -c 1,5,8,12` on the
    /// simulated host: two siblings of one core on each node) places its
    /// threads on those only: one per core, the node with the most memory
    /// first, the reader on that node's allowed CPUs.
    #[test]
    fn allowed_cpus_restrict_the_placement() {
        let t = simulated();
        let mut topo = Topology::from_root(t.path());
        topo.keep_cpus(&[1, 5, 8, 12]);
        assert_eq!(topo.cpus.len(), 4);
        assert_eq!(topo.nodes[0].cpus, vec![1, 5]);
        assert_eq!(topo.nodes[1].mem_total, 32_000_000 * 1024, "memory kept");
        assert_eq!(topo.physical_cores(None), vec![1, 8]);
        let p = topo.placement(Some(1), 0);
        assert_eq!((p.compute_node, p.compute_cpus), (Some(1), vec![8]));
        assert_eq!(p.reader_cpus, vec![8, 12]);
        assert_eq!(topo.placement(None, 3).compute_cpus, vec![8, 1, 5]);
        // A mask that shares nothing with the description is ignored.
        let whole = Topology::from_root(t.path());
        let mut same = whole.clone();
        same.keep_cpus(&[99]);
        assert_eq!(same, whole);
    }

    /// A thread pinned to one CPU sees a machine of that CPU (the threads
    /// it would start inherit its mask).
    #[test]
    fn this_thread_s_affinity_restricts_the_machine() {
        let first = allowed_cpus().unwrap()[0];
        std::thread::spawn(move || {
            pin_current_thread(&[first]).unwrap();
            assert_eq!(allowed_cpus(), Some(vec![first]));
            let topo = Topology::detect();
            assert_eq!(topo.cpus.iter().map(|c| c.id).collect::<Vec<_>>(), [first]);
            let p = topo.placement(None, 0);
            assert_eq!(p.compute_cpus, vec![first]);
            let one = format!("placement: 1 compute thread on cpus [{first}];");
            assert!(p.render().starts_with(&one), "{}", p.render());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn missing_sysfs_degrades_to_one_node() {
        let t = tempfile::tempdir().unwrap();
        write(t.path(), "sys/devices/system/cpu/online", "0-3");
        let topo = Topology::from_root(t.path());
        assert_eq!(topo.nodes.len(), 1);
        assert_eq!(topo.physical_cores(None), vec![0, 1, 2, 3]);
        let p = topo.placement(None, 0);
        assert!(!p.multi_node && p.compute_node.is_none() && p.reader_cpus.is_empty());
    }

    #[test]
    fn this_machine_is_described() {
        let topo = Topology::detect();
        assert!(!topo.cpus.is_empty());
        assert!(!topo.physical_cores(None).is_empty());
        pin_current_thread(&topo.physical_cores(None)).unwrap();
        let expected = if cfg!(feature = "hwloc") {
            TopologySource::Hwloc
        } else {
            TopologySource::Sysfs
        };
        assert_eq!(topo.source, expected);
        assert!(
            topo.placement(None, 0)
                .render()
                .ends_with(&format!("(topology from {expected})"))
        );
    }

    /// hwloc and the sysfs reader, two independent readings of this
    /// machine, agree on every CPU (package, core, node), every node's CPUs
    /// and memory, the placement, and the node of the drive under the
    /// temporary directory where sysfs states one.
    #[cfg(feature = "hwloc")]
    #[test]
    fn hwloc_and_sysfs_describe_this_machine_alike() {
        let h = hwloc::this_machine().unwrap();
        let s = Topology::from_root(Path::new("/"));
        assert_eq!(h.source, TopologySource::Hwloc);
        assert_eq!(h.cpus, s.cpus);
        assert_eq!(h.nodes.len(), s.nodes.len());
        for (a, b) in h.nodes.iter().zip(&s.nodes) {
            assert_eq!((a.id, &a.cpus), (b.id, &b.cpus));
            // hwloc leaves out memory reserved for huge pages; sysfs's
            // MemTotal counts it.
            if b.mem_total > 0 {
                assert!(
                    a.mem_total <= b.mem_total && a.mem_total >= b.mem_total / 2,
                    "node {}: hwloc {} bytes, sysfs {}",
                    a.id,
                    a.mem_total,
                    b.mem_total
                );
            }
        }
        for threads in [0, 1, h.cpus.len() + 1] {
            let (mut a, b) = (h.placement(Some(0), threads), s.placement(Some(0), threads));
            a.topology = b.topology;
            assert_eq!(a, b, "{threads} threads");
        }
        let dir = tempfile::tempdir().unwrap();
        if let Some(n) = s.drive_node(dir.path()) {
            assert_eq!(h.drive_node(dir.path()), Some(n));
        }
    }

    /// The simulated host of the sysfs test, as an hwloc synthetic
    /// description: two packages of four cores with two threads each, a
    /// node per package.
    #[cfg(feature = "hwloc")]
    #[test]
    fn a_synthetic_two_node_host_places_threads_on_physical_cores() {
        let topo = hwloc::synthetic("pack:2 [numa(memory=16GB)] core:4 pu:2").unwrap();
        assert_eq!(topo.source, TopologySource::Hwloc);
        assert_eq!(topo.nodes.len(), 2);
        assert_eq!(topo.nodes[1].cpus, (8..16).collect::<Vec<_>>());
        // hwloc's GB is 10⁹ bytes.
        assert!(topo.nodes.iter().all(|n| n.mem_total == 16_000_000_000));
        assert_eq!(topo.cpus.len(), 16);
        assert_eq!(topo.physical_cores(Some(0)), vec![0, 2, 4, 6]);
        assert_eq!(topo.physical_cores(Some(1)), vec![8, 10, 12, 14]);
        assert_eq!(topo.physical_cores(None).len(), 8);
        // The same memory on both nodes: the weights go to the first.
        let p = topo.placement(Some(1), 0);
        assert_eq!(p.compute_node, Some(0));
        assert_eq!(p.compute_cpus, vec![0, 2, 4, 6], "physical cores only");
        assert_eq!(p.reader_cpus, (8..16).collect::<Vec<_>>(), "near the drive");
        let p = topo.placement(Some(1), 6);
        assert_eq!(p.compute_cpus.len(), 6, "siblings after the cores");
        assert!(p.compute_cpus.starts_with(&[0, 2, 4, 6]));
        assert!(p.multi_node && p.render().contains("node 0"));
        assert!(hwloc::synthetic("pack:two").is_err());
    }
}

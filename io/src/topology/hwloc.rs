//! The topology as the hwloc C library describes it (the `hwloc` feature):
//! the same [`Topology`] the sysfs reader builds, with the storage devices'
//! nodes from hwloc's I/O tree.

use std::collections::BTreeMap;
use std::path::PathBuf;

use hwlocality::object::TopologyObject;
use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::{OSDeviceType, ObjectType};
use hwlocality::topology::builder::TypeFilter;

use super::{Cpu, Node, Topology, TopologySource};

/// hwloc could not describe the machine.
#[derive(Debug, thiserror::Error)]
#[error("hwloc could not describe the machine: {0}")]
pub struct HwlocError(String);

fn failed(e: impl std::fmt::Display) -> HwlocError {
    HwlocError(e.to_string())
}

/// This machine, its storage devices included.
pub fn this_machine() -> Result<Topology, HwlocError> {
    let hw = hwlocality::Topology::builder()
        .with_io_type_filter(TypeFilter::KeepImportant)
        .map_err(failed)?
        .build()
        .map_err(failed)?;
    describe(&hw)
}

/// The machine of hwloc's synthetic `description` (for example
/// `"pack:2 [numa(memory=16GB)] core:4 pu:2"`: two packages, a node of
/// each, four cores of two threads), as tests simulate a host.
pub fn synthetic(description: &str) -> Result<Topology, HwlocError> {
    let hw = hwlocality::Topology::builder()
        .from_synthetic(description)
        .map_err(failed)?
        .build()
        .map_err(failed)?;
    describe(&hw)
}

/// An object's OS index (the kernel's number: a CPU's id, a node's, a
/// core's `core_id`), else its place among its kind.
fn number(o: &TopologyObject) -> usize {
    o.os_index().unwrap_or_else(|| o.logical_index())
}

fn describe(hw: &hwlocality::Topology) -> Result<Topology, HwlocError> {
    let mut nodes: Vec<Node> = hw
        .objects_with_type(ObjectType::NUMANode)
        .map(|n| Node {
            id: number(n),
            cpus: n
                .cpuset()
                .map(|s| s.iter_set().map(usize::from).collect())
                .unwrap_or_default(),
            mem_total: match n.attributes() {
                Some(ObjectAttributes::NUMANode(a)) => a.local_memory().map_or(0, |m| m.get()),
                _ => 0,
            },
        })
        .collect();
    nodes.sort_by_key(|n| n.id);
    let mut cpus: Vec<Cpu> = hw
        .objects_with_type(ObjectType::PU)
        .filter_map(|pu| {
            let id = pu.os_index()?;
            let above = |ty| pu.first_ancestor_with_type(ty).map(number);
            Some(Cpu {
                id,
                package: above(ObjectType::Package).unwrap_or(0),
                // A PU without a core above it counts as a core.
                core: above(ObjectType::Core).unwrap_or(id),
                node: nodes
                    .iter()
                    .find(|n| n.cpus.contains(&id))
                    .map_or(0, |n| n.id),
            })
        })
        .collect();
    cpus.sort_by_key(|c| c.id);
    if cpus.is_empty() {
        return Err(HwlocError("no CPU in its description".into()));
    }
    if nodes.is_empty() {
        nodes.push(Node {
            id: 0,
            cpus: cpus.iter().map(|c| c.id).collect(),
            mem_total: 0,
        });
    }
    // Storage devices under exactly one node (a device whose locality
    // hwloc does not know hangs off the machine, all nodes: no claim).
    let block_nodes = hw
        .os_devices()
        .filter(|d| {
            matches!(d.attributes(), Some(ObjectAttributes::OSDevice(a))
                if a.device_type() == OSDeviceType::Storage)
        })
        .filter_map(|d| {
            let name = d.name()?.to_str().ok()?.to_owned();
            let set = d.first_non_io_ancestor()?.nodeset()?;
            (set.weight() == Some(1)).then_some((name, usize::from(set.first_set()?)))
        })
        .collect::<BTreeMap<_, _>>();
    Ok(Topology {
        cpus,
        nodes,
        source: TopologySource::Hwloc,
        block_nodes,
        root: PathBuf::from("/"),
    })
}

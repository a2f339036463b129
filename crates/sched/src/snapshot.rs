//! The cluster as the placement engine sees it: nodes with a GPU model, the
//! free share of every GPU in milli-GPU, free CPU and memory, a cordoned flag.
//!
//! Nodes are grouped into equivalence classes by [`NodeState`]: two nodes in
//! the same state are interchangeable for every filter and scorer, so the
//! engine scores a class once and picks a member. This is the "index free
//! capacity by bucket" that keeps a decision sub-linear in the node count.

use std::collections::{BTreeSet, HashMap};

use crate::request::{GpuDemand, Request};
pub use crate::request::{ModelId, Runtime};
use crate::{Error, MILLI};

/// Interned GPU model names. At most 64, so allowed-model sets are a `u64`.
#[derive(Debug, Clone, Default)]
pub struct ModelTable {
    names: Vec<String>,
    /// Models that can be partitioned with MIG, as a bitmask over ids (see
    /// [`crate::mig`]). Kept here because MIG support is a property of the
    /// GPU model, not of a node.
    mig: u64,
}

impl ModelTable {
    pub const MAX: usize = 64;

    /// The id of `name`, adding it if new.
    pub fn intern(&mut self, name: &str) -> Result<ModelId, Error> {
        if let Some(id) = self.get(name) {
            return Ok(id);
        }
        if self.names.len() >= Self::MAX {
            return Err(Error::TooManyModels { max: Self::MAX });
        }
        self.names.push(name.to_owned());
        // Cannot truncate: len < 64 was checked above.
        Ok((self.names.len() - 1) as ModelId)
    }

    pub fn get(&self, name: &str) -> Option<ModelId> {
        self.names
            .iter()
            .position(|n| n == name)
            .map(|i| i as ModelId)
    }

    pub fn name(&self, id: ModelId) -> Option<&str> {
        self.names.get(usize::from(id)).map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Marks a model as MIG-capable (or not). An id outside the table is an
    /// error rather than a silent no-op, so a typo in a catalog shows up.
    pub fn set_mig_capable(&mut self, id: ModelId, capable: bool) -> Result<(), Error> {
        if usize::from(id) >= self.names.len() {
            return Err(Error::InvalidRequest(
                "mig flag for a model outside the table",
            ));
        }
        if capable {
            self.mig |= 1u64 << id;
        } else {
            self.mig &= !(1u64 << id);
        }
        Ok(())
    }

    pub fn is_mig_capable(&self, id: ModelId) -> bool {
        usize::from(id) < Self::MAX && self.mig & (1u64 << id) != 0
    }

    /// The MIG-capable models as a bitmask over ids.
    pub fn mig_capable_mask(&self) -> u64 {
        self.mig
    }
}

/// Where a request goes: a node and the device indices of its GPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub node: u32,
    /// Distinct device indices; one per GPU of the request, empty for
    /// CPU-only work.
    pub gpus: Vec<u16>,
}

/// A node's capacity as registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    /// `None` for a node without GPUs.
    pub model: Option<ModelId>,
    pub gpus: u16,
    pub cpu_milli: u32,
    pub mem_mib: u64,
}

/// Everything about a node that a filter or scorer may look at. It is also
/// the key of the node's equivalence class, which is why the GPU shares are
/// kept sorted (largest free first) rather than by device index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeState {
    pub model: Option<ModelId>,
    /// Part of the class key: a process node and a container node are not
    /// interchangeable even with the same free capacity.
    pub runtime: Runtime,
    pub cordoned: bool,
    pub cpu_free: u32,
    pub mem_free: u64,
    /// Free milli-GPU of every GPU, sorted in descending order.
    pub gpu_free: Vec<u16>,
    /// GPU-clustering tags of the work on the node ([`GpuDemand::tag`]).
    pub tags: u32,
}

/// By hand so that the runtime costs the class index no extra hasher
/// call: it rides in the byte that carries the cordoned flag.
impl std::hash::Hash for NodeState {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.model.hash(state);
        state.write_u8(u8::from(self.cordoned) | (self.runtime as u8) << 1);
        state.write_u32(self.cpu_free);
        state.write_u64(self.mem_free);
        self.gpu_free.hash(state);
        state.write_u32(self.tags);
    }
}

impl NodeState {
    pub fn gpu_count(&self) -> usize {
        self.gpu_free.len()
    }

    /// GPUs with nothing allocated.
    pub fn full_gpus(&self) -> usize {
        // Sorted descending: the fully free GPUs lead.
        self.gpu_free.iter().take_while(|&&f| f == MILLI).count()
    }

    pub fn gpu_free_total(&self) -> u32 {
        self.gpu_free.iter().map(|&f| u32::from(f)).sum()
    }

    /// GPUs with at least `milli` free.
    pub fn gpus_with_at_least(&self, milli: u16) -> usize {
        self.gpu_free.iter().take_while(|&&f| f >= milli).count()
    }

    /// The state after placing `req`, taking the GPU whose free share is
    /// `share_from` for a share (whole GPUs always come from fully free
    /// ones). `None` if it does not fit; CPU and memory are not checked
    /// beyond saturating, the filter does that.
    pub fn after(&self, req: &Request, share_from: Option<u16>) -> Option<NodeState> {
        let mut next = self.clone();
        next.cpu_free = next.cpu_free.checked_sub(req.cpu_milli)?;
        next.mem_free = next.mem_free.checked_sub(req.mem_mib)?;
        match req.gpu {
            GpuDemand::None => {}
            GpuDemand::Whole { count } => {
                let count = usize::from(count);
                if next.full_gpus() < count {
                    return None;
                }
                for f in next.gpu_free.iter_mut().take(count) {
                    *f = 0;
                }
            }
            GpuDemand::Share { milli } => {
                let from = share_from?;
                if from < milli {
                    return None;
                }
                let slot = next.gpu_free.iter().position(|&f| f == from)?;
                next.gpu_free[slot] = from - milli;
            }
        }
        next.tags |= req.gpu.tag();
        next.gpu_free.sort_unstable_by(|a, b| b.cmp(a));
        Some(next)
    }
}

/// One node: its spec and its current free capacity by device index.
#[derive(Debug, Clone)]
pub struct Node {
    pub spec: NodeSpec,
    pub cordoned: bool,
    pub cpu_free: u32,
    pub mem_free: u64,
    /// Free milli-GPU per device index, each in 0..=1000.
    pub gpu_free: Vec<u16>,
    pub tags: u32,
    /// Topology domain (NVLink island, PCIe switch, rack: whatever the
    /// operator groups by); 0 means "in no domain". Deliberately not part of
    /// [`NodeState`]: no scorer looks at it, and keeping it out of the class
    /// key keeps classes (and so decisions and their speed) exactly as they
    /// were for clusters that do not use domains.
    pub domain: u32,
    /// Region, with the same convention and for the same reason as `domain`.
    pub region: u32,
    /// The machine this engine node is part of; 0 means "a machine of its
    /// own". A machine with GPUs of several models is several engine nodes
    /// (one per model, since a node has one model) that share the machine's
    /// CPU and memory: [`Cluster::commit`] and [`Cluster::release`] move
    /// CPU and memory on every node of the host, so neither is promised
    /// twice. Also what a gang that spreads its members counts as one node
    /// ([`crate::gang::Gang::spread`]).
    pub host: u32,
    /// How the node runs work ([`Cluster::set_runtime`]).
    pub runtime: Runtime,
    class: u32,
}

impl Node {
    /// The host key: nodes with the same key are one machine.
    pub fn host_key(&self, idx: u32) -> HostKey {
        if self.host == 0 {
            HostKey::Alone(idx)
        } else {
            HostKey::Shared(self.host)
        }
    }
}

/// Which machine an engine node belongs to (see [`Node::host`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HostKey {
    /// A machine of one engine node, named by its index.
    Alone(u32),
    /// A machine shared by the engine nodes with this host id.
    Shared(u32),
}

impl Node {
    pub(crate) fn state(&self) -> NodeState {
        let mut gpu_free = self.gpu_free.clone();
        gpu_free.sort_unstable_by(|a, b| b.cmp(a));
        NodeState {
            model: self.spec.model,
            runtime: self.runtime,
            cordoned: self.cordoned,
            cpu_free: self.cpu_free,
            mem_free: self.mem_free,
            gpu_free,
            tags: self.tags,
        }
    }
}

/// An equivalence class of nodes in the same [`NodeState`].
#[derive(Debug, Clone)]
pub struct Class {
    pub state: NodeState,
    /// Ordered, so the lowest-index member (the simulator's and the
    /// deterministic tie-break) is at hand in O(log n).
    pub members: BTreeSet<u32>,
}

/// The cluster snapshot. Mutated only through [`Cluster::commit`] (and
/// [`Cluster::set_cordoned`]), which keeps the class index consistent.
#[derive(Debug)]
pub struct Cluster {
    models: ModelTable,
    nodes: Vec<Node>,
    classes: Vec<Class>,
    class_of: HashMap<NodeState, u32>,
    /// Ids of classes with at least one member, in no particular order.
    active: Vec<u32>,
    active_pos: Vec<u32>,
    /// Node indices per GPU model: the node type index.
    by_model: Vec<Vec<u32>>,
    /// Engine nodes per host id (only hosts with an id, see [`Node::host`]).
    hosts: HashMap<u32, Vec<u32>>,
    gpu_capacity_milli: u64,
    gpu_free_milli: u64,
    uid: u64,
}

/// Class ids are only meaningful within one cluster; an engine's score cache
/// is keyed by them, so every cluster (and every clone) gets its own uid.
/// Deterministic per process, which is all the engine needs.
fn next_uid() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Clone for Cluster {
    fn clone(&self) -> Self {
        Cluster {
            models: self.models.clone(),
            nodes: self.nodes.clone(),
            classes: self.classes.clone(),
            class_of: self.class_of.clone(),
            active: self.active.clone(),
            active_pos: self.active_pos.clone(),
            by_model: self.by_model.clone(),
            hosts: self.hosts.clone(),
            gpu_capacity_milli: self.gpu_capacity_milli,
            gpu_free_milli: self.gpu_free_milli,
            uid: next_uid(),
        }
    }
}

const NOT_ACTIVE: u32 = u32::MAX;

impl Cluster {
    pub fn new(models: ModelTable) -> Self {
        let by_model = vec![Vec::new(); models.len()];
        Cluster {
            models,
            nodes: Vec::new(),
            classes: Vec::new(),
            class_of: HashMap::new(),
            active: Vec::new(),
            active_pos: Vec::new(),
            by_model,
            hosts: HashMap::new(),
            gpu_capacity_milli: 0,
            gpu_free_milli: 0,
            uid: next_uid(),
        }
    }

    pub fn models(&self) -> &ModelTable {
        &self.models
    }

    pub(crate) fn uid(&self) -> u64 {
        self.uid
    }

    /// Adds an empty node and returns its index.
    pub fn add_node(&mut self, spec: NodeSpec) -> Result<u32, Error> {
        if let Some(m) = spec.model {
            if usize::from(m) >= self.models.len() {
                return Err(Error::InvalidRequest(
                    "node names a model outside the table",
                ));
            }
        }
        let idx =
            u32::try_from(self.nodes.len()).map_err(|_| Error::InvalidRequest("too many nodes"))?;
        let gpus = if spec.model.is_some() { spec.gpus } else { 0 };
        let node = Node {
            cordoned: false,
            cpu_free: spec.cpu_milli,
            mem_free: spec.mem_mib,
            gpu_free: vec![MILLI; usize::from(gpus)],
            tags: 0,
            domain: 0,
            region: 0,
            host: 0,
            runtime: Runtime::Process,
            class: 0,
            spec,
        };
        let cap = u64::from(gpus) * u64::from(MILLI);
        self.gpu_capacity_milli += cap;
        self.gpu_free_milli += cap;
        if let Some(m) = node.spec.model {
            self.by_model[usize::from(m)].push(idx);
        }
        let state = node.state();
        self.nodes.push(node);
        self.join_class(idx, state);
        Ok(idx)
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, idx: u32) -> Option<&Node> {
        self.nodes.get(idx as usize)
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Nodes with GPUs of `model`.
    pub fn nodes_of_model(&self, model: ModelId) -> &[u32] {
        self.by_model
            .get(usize::from(model))
            .map_or(&[], Vec::as_slice)
    }

    pub fn gpu_capacity_milli(&self) -> u64 {
        self.gpu_capacity_milli
    }

    pub fn gpu_allocated_milli(&self) -> u64 {
        self.gpu_capacity_milli - self.gpu_free_milli
    }

    /// The non-empty equivalence classes: `(class id, class)`.
    pub fn active_classes(&self) -> impl Iterator<Item = (u32, &Class)> + '_ {
        self.active
            .iter()
            .map(move |&c| (c, &self.classes[c as usize]))
    }

    pub fn class(&self, id: u32) -> &Class {
        &self.classes[id as usize]
    }

    /// Node `idx` for a setter: an index the cluster never handed out is
    /// the caller's error, reported rather than ignored.
    fn node_mut(&mut self, idx: u32) -> Result<&mut Node, Error> {
        self.nodes
            .get_mut(idx as usize)
            .ok_or(Error::UnknownNode(idx))
    }

    /// The state of one node (its class key).
    pub fn state_of(&self, idx: u32) -> Option<&NodeState> {
        self.node(idx)
            .map(|n| &self.classes[n.class as usize].state)
    }

    pub fn set_cordoned(&mut self, idx: u32, cordoned: bool) -> Result<(), Error> {
        let node = self.node_mut(idx)?;
        node.cordoned = cordoned;
        self.reclassify(idx);
        Ok(())
    }

    /// Sets how a node runs work; nodes start as [`Runtime::Process`].
    /// Unlike the domain it is part of the node's class ([`NodeState`]).
    pub fn set_runtime(&mut self, idx: u32, runtime: Runtime) -> Result<(), Error> {
        let node = self.node_mut(idx)?;
        if node.runtime != runtime {
            node.runtime = runtime;
            self.reclassify(idx);
        }
        Ok(())
    }

    /// Puts a node in a topology domain (0: none). Used by gang placement
    /// ([`crate::gang`]) to keep a gang inside one domain; placement of
    /// single requests ignores it.
    pub fn set_domain(&mut self, idx: u32, domain: u32) -> Result<(), Error> {
        let node = self.node_mut(idx)?;
        node.domain = domain;
        Ok(())
    }

    /// Puts a node in a region (0: none); see [`Cluster::set_domain`].
    pub fn set_region(&mut self, idx: u32, region: u32) -> Result<(), Error> {
        let node = self.node_mut(idx)?;
        node.region = region;
        Ok(())
    }

    /// Makes `idx` part of machine `host` (non-zero), which it shares with
    /// the other nodes of that host ([`Node::host`]). The caller adds every
    /// node of a host with the machine's free CPU and memory, so they start
    /// equal; commits and releases keep them equal.
    pub fn set_host(&mut self, idx: u32, host: u32) -> Result<(), Error> {
        if host == 0 {
            return Err(Error::InvalidRequest("host 0 means no host"));
        }
        let node = self.node_mut(idx)?;
        if node.host != 0 {
            return Err(Error::InvalidRequest("a node's host is set once"));
        }
        node.host = host;
        self.hosts.entry(host).or_default().push(idx);
        Ok(())
    }

    /// The engine nodes of the machine `idx` is part of, `idx` included.
    pub fn host_nodes(&self, idx: u32) -> Vec<u32> {
        match self.node(idx) {
            Some(n) if n.host != 0 => self.hosts.get(&n.host).cloned().unwrap_or_default(),
            Some(_) => vec![idx],
            None => Vec::new(),
        }
    }

    /// Moves CPU and memory on the other nodes of `idx`'s host by the same
    /// amount as on `idx` (`take`: taken, else given back).
    fn share_with_host(&mut self, idx: u32, cpu: u32, mem: u64, take: bool) {
        let host = self.nodes[idx as usize].host;
        if host == 0 {
            return;
        }
        let siblings: Vec<u32> = self
            .hosts
            .get(&host)
            .map(|v| v.iter().copied().filter(|&s| s != idx).collect())
            .unwrap_or_default();
        for s in siblings {
            let n = &mut self.nodes[s as usize];
            if take {
                n.cpu_free = n.cpu_free.saturating_sub(cpu);
                n.mem_free = n.mem_free.saturating_sub(mem);
            } else {
                n.cpu_free = n.cpu_free.saturating_add(cpu).min(n.spec.cpu_milli);
                n.mem_free = n.mem_free.saturating_add(mem).min(n.spec.mem_mib);
            }
            self.reclassify(s);
        }
    }

    /// Undoes [`Cluster::commit`] of `req` at `placement`: the work ended or
    /// was preempted. Refuses (changing nothing) to free more than a node
    /// has, so an inconsistent release cannot push a GPU past 1000 milli.
    ///
    /// GPU-clustering tags are not cleared: a tag records that a kind of work
    /// was on the node, and other work of that kind may still be. They only
    /// steer the GpuClustering scorer; a rebuilt snapshot starts clean.
    pub fn release(&mut self, req: &Request, placement: &Placement) -> Result<(), Error> {
        let node_idx = placement.node;
        let node = self.node_mut(node_idx)?;
        let over = |what| Error::Overcommit {
            node: node_idx,
            what,
        };
        let cpu = node
            .cpu_free
            .checked_add(req.cpu_milli)
            .filter(|&c| c <= node.spec.cpu_milli)
            .ok_or(over("release frees more cpu than the node has"))?;
        let mem = node
            .mem_free
            .checked_add(req.mem_mib)
            .filter(|&m| m <= node.spec.mem_mib)
            .ok_or(over("release frees more memory than the node has"))?;
        if placement.gpus.len() != usize::from(req.gpu.gpu_count()) {
            return Err(over("wrong number of gpus"));
        }
        let per_gpu = req.gpu.per_gpu_milli();
        for (i, &g) in placement.gpus.iter().enumerate() {
            let free = *node
                .gpu_free
                .get(usize::from(g))
                .ok_or(over("no such gpu"))?;
            if u32::from(free) + u32::from(per_gpu) > u32::from(MILLI) {
                return Err(over("release frees more gpu share than allocated"));
            }
            if placement.gpus[..i].contains(&g) {
                return Err(over("gpu named twice"));
            }
        }
        node.cpu_free = cpu;
        node.mem_free = mem;
        for &g in &placement.gpus {
            node.gpu_free[usize::from(g)] += per_gpu;
        }
        self.gpu_free_milli += u64::from(req.gpu.total_milli());
        self.reclassify(node_idx);
        self.share_with_host(node_idx, req.cpu_milli, req.mem_mib, false);
        Ok(())
    }

    /// Applies a placement made for `req`, checking it does not overdraw
    /// anything. On error nothing changes.
    pub fn commit(&mut self, req: &Request, placement: &Placement) -> Result<(), Error> {
        let node_idx = placement.node;
        let node = self.node_mut(node_idx)?;
        let over = |what| Error::Overcommit {
            node: node_idx,
            what,
        };
        if node.cpu_free < req.cpu_milli {
            return Err(over("cpu"));
        }
        if node.mem_free < req.mem_mib {
            return Err(over("memory"));
        }
        if placement.gpus.len() != usize::from(req.gpu.gpu_count()) {
            return Err(over("wrong number of gpus"));
        }
        let per_gpu = req.gpu.per_gpu_milli();
        for (i, &g) in placement.gpus.iter().enumerate() {
            let free = *node
                .gpu_free
                .get(usize::from(g))
                .ok_or(over("no such gpu"))?;
            if free < per_gpu {
                return Err(over("gpu share"));
            }
            if placement.gpus[..i].contains(&g) {
                return Err(over("gpu named twice"));
            }
        }
        node.cpu_free -= req.cpu_milli;
        node.mem_free -= req.mem_mib;
        for &g in &placement.gpus {
            node.gpu_free[usize::from(g)] -= per_gpu;
        }
        node.tags |= req.gpu.tag();
        self.gpu_free_milli -= u64::from(req.gpu.total_milli());
        self.reclassify(node_idx);
        self.share_with_host(node_idx, req.cpu_milli, req.mem_mib, true);
        Ok(())
    }

    fn reclassify(&mut self, idx: u32) {
        self.leave_class(idx);
        let state = self.nodes[idx as usize].state();
        self.join_class(idx, state);
    }

    fn join_class(&mut self, idx: u32, state: NodeState) {
        let next_id = self.classes.len() as u32;
        let id = *self.class_of.entry(state.clone()).or_insert(next_id);
        if id == next_id {
            self.classes.push(Class {
                state,
                members: BTreeSet::new(),
            });
            self.active_pos.push(NOT_ACTIVE);
        }
        self.nodes[idx as usize].class = id;
        self.classes[id as usize].members.insert(idx);
        if self.active_pos[id as usize] == NOT_ACTIVE {
            self.active_pos[id as usize] = self.active.len() as u32;
            self.active.push(id);
        }
    }

    fn leave_class(&mut self, idx: u32) {
        let id = self.nodes[idx as usize].class;
        let class = &mut self.classes[id as usize];
        class.members.remove(&idx);
        if class.members.is_empty() {
            let apos = self.active_pos[id as usize];
            self.active.swap_remove(apos as usize);
            if let Some(&moved) = self.active.get(apos as usize) {
                self.active_pos[moved as usize] = apos;
            }
            self.active_pos[id as usize] = NOT_ACTIVE;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster() -> Cluster {
        let mut models = ModelTable::default();
        let a = models.intern("A").unwrap();
        let mut c = Cluster::new(models);
        for _ in 0..3 {
            c.add_node(NodeSpec {
                model: Some(a),
                gpus: 2,
                cpu_milli: 8000,
                mem_mib: 1024,
            })
            .unwrap();
        }
        c
    }

    #[test]
    fn identical_nodes_share_a_class_until_one_changes() {
        let mut c = cluster();
        assert_eq!(c.active_classes().count(), 1);
        let req = Request::new(GpuDemand::Share { milli: 300 }, 1000, 0);
        c.commit(
            &req,
            &Placement {
                node: 1,
                gpus: vec![1],
            },
        )
        .unwrap();
        assert_eq!(c.active_classes().count(), 2);
        assert_eq!(c.state_of(1).unwrap().gpu_free, vec![1000, 700]);
        assert_eq!(c.gpu_allocated_milli(), 300);
        let sizes: usize = c.active_classes().map(|(_, k)| k.members.len()).sum();
        assert_eq!(sizes, 3);
    }

    #[test]
    fn runtime_separates_classes_and_decides_placement() {
        let mut c = cluster();
        assert_eq!(c.active_classes().count(), 1);
        c.set_runtime(2, Runtime::Container).unwrap();
        assert_eq!(c.active_classes().count(), 2);
        assert_eq!(c.state_of(2).unwrap().runtime, Runtime::Container);
        assert_eq!(c.state_of(0).unwrap().runtime, Runtime::Process);
        assert!(c.set_runtime(9, Runtime::Container).is_err());

        let mut engine = crate::Engine::new(crate::Policy::Flotilla.scorer(
            &crate::TargetWorkload::from_gpu_requests(
                std::iter::empty(),
                crate::TargetWorkload::DEFAULT_COVERAGE,
            ),
        ));
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let image = Request::new(GpuDemand::whole(1), 0, 0).with_runtime(Runtime::Container);
        match engine.decide(&c, &image, &mut rng) {
            crate::Decision::Placed(p) => assert_eq!(p.node, 2),
            other => panic!("expected a placement, got {other:?}"),
        }
        let command = Request::new(GpuDemand::whole(1), 0, 0);
        match engine.decide(&c, &command, &mut rng) {
            crate::Decision::Placed(p) => assert_ne!(p.node, 2),
            other => panic!("expected a placement, got {other:?}"),
        }
        c.set_runtime(2, Runtime::Process).unwrap();
        assert_eq!(c.active_classes().count(), 1);
        match engine.decide(&c, &image, &mut rng) {
            crate::Decision::Unschedulable(why) => {
                assert_eq!(
                    why.to_string(),
                    "0/3 nodes fit: 3 runs processes, not images"
                )
            }
            other => panic!("expected no fit, got {other:?}"),
        }
    }

    #[test]
    fn release_undoes_commit_and_refuses_to_free_too_much() {
        let mut c = cluster();
        let before: Vec<NodeState> = (0..3).map(|i| c.state_of(i).unwrap().clone()).collect();
        let req = Request::new(GpuDemand::Share { milli: 300 }, 1000, 10);
        let p = Placement {
            node: 0,
            gpus: vec![1],
        };
        c.commit(&req, &p).unwrap();
        c.release(&req, &p).unwrap();
        assert_eq!(c.gpu_allocated_milli(), 0);
        assert_eq!(c.state_of(0).unwrap().gpu_free, before[0].gpu_free);
        assert_eq!(c.active_classes().count(), 2); // node 0 keeps its tag
        assert!(c.release(&req, &p).is_err());
        assert_eq!(c.state_of(0).unwrap().cpu_free, 8000);
    }

    #[test]
    fn commit_refuses_overdraw() {
        let mut c = cluster();
        let req = Request::new(GpuDemand::Share { milli: 700 }, 0, 0);
        c.commit(
            &req,
            &Placement {
                node: 0,
                gpus: vec![0],
            },
        )
        .unwrap();
        assert!(c
            .commit(
                &req,
                &Placement {
                    node: 0,
                    gpus: vec![0]
                }
            )
            .is_err());
        let two = Request::new(GpuDemand::Whole { count: 2 }, 0, 0);
        assert!(c
            .commit(
                &two,
                &Placement {
                    node: 1,
                    gpus: vec![0, 0]
                }
            )
            .is_err());
        assert!(c
            .commit(
                &two,
                &Placement {
                    node: 9,
                    gpus: vec![0, 1]
                }
            )
            .is_err());
    }
}

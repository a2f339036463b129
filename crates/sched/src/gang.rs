//! Gang placement: k members, all placed or none, optionally inside one
//! topology domain or one region.
//!
//! Members are placed one by one, in the order given, with the engine's
//! configured scorer on a scratch clone of the cluster, each seeing the
//! capacity the earlier members took. The caller's cluster is never touched:
//! a [`GangDecision::Placed`] is a plan to apply with [`commit_gang`], and an
//! unschedulable gang comes back with the member that failed and why.
//!
//! Greedy member-by-member placement is not a bin-packing search: a gang
//! that would fit in a different arrangement can be refused. Ordering the
//! members largest first (the caller's job; jobs usually have identical
//! members anyway) makes that rare.
//!
//! For a domain (or region) constraint every candidate domain is tried,
//! most free GPU share first, and the first one that takes every member
//! wins; domains that cannot hold the gang's total GPU share, CPU or memory
//! are skipped without a placement attempt. Nodes in domain 0 are in no
//! domain and never host a constrained gang. Each attempt clones the cluster
//! and cordons the nodes outside the domain on the clone, so one attempt
//! costs O(nodes); the capacity pre-check keeps the attempts few.
//!
//! Note that the engine drops its score cache whenever it sees a different
//! cluster, and a scratch clone is one: placing a gang costs the next single
//! decision on the real cluster a cold cache.

use std::collections::BTreeMap;
use std::fmt;

use rand::Rng;

use crate::alloc::Resources;
use crate::filter::{check, Explanation};
use crate::request::Request;
use crate::select::{Decision, Engine, Placement};
use crate::snapshot::{Cluster, Node};
use crate::Error;

/// Where a gang's members may go relative to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Locality {
    /// Anywhere.
    #[default]
    Any,
    /// All on nodes of one topology domain ([`Cluster::set_domain`]).
    SameDomain,
    /// All on nodes of one region ([`Cluster::set_region`]).
    SameRegion,
}

impl Locality {
    /// The node's domain or region under this constraint (0: none).
    pub(crate) fn scope_of(self, node: &Node) -> u32 {
        match self {
            Locality::Any => 0,
            Locality::SameDomain => node.domain,
            Locality::SameRegion => node.region,
        }
    }

    fn noun(self) -> &'static str {
        match self {
            Locality::Any => "cluster",
            Locality::SameDomain => "domain",
            Locality::SameRegion => "region",
        }
    }
}

/// A gang: members placed all together or not at all.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Gang {
    pub members: Vec<Request>,
    pub locality: Locality,
    /// Every member on a machine of its own, as Slurm's `-N` asks: a job of
    /// N members on N distinct hosts ([`crate::snapshot::Node::host`]).
    pub spread: bool,
}

impl Gang {
    /// `k` identical members, as a distributed training job asks.
    pub fn uniform(member: Request, k: usize, locality: Locality) -> Self {
        Gang {
            members: vec![member; k],
            locality,
            spread: false,
        }
    }

    /// The same gang with every member on its own machine.
    pub fn spread(mut self) -> Self {
        self.spread = true;
        self
    }
}

/// After a member of a spread gang landed on `node`, no other member may
/// use that machine: cordons its host on the scratch cluster.
pub(crate) fn close_host(scratch: &mut Cluster, node: u32) {
    for n in scratch.host_nodes(node) {
        // In range: host_nodes only names nodes of the cluster.
        let _ = scratch.set_cordoned(n, true);
    }
}

/// Where every member goes, in member order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangPlacement {
    pub members: Vec<Placement>,
    /// The domain or region the gang landed in; `None` when unconstrained.
    pub scope: Option<u32>,
}

/// Why a gang fits nowhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangExplanation {
    pub locality: Locality,
    /// Members in the gang.
    pub members: usize,
    /// Domains (or regions) attempted, and those skipped because their total
    /// free capacity was below the gang's. Both 0 when unconstrained.
    pub scopes_tried: usize,
    pub scopes_too_small: usize,
    /// The attempt that got furthest (ties: the first tried, which had the
    /// most free GPU share): its scope, the member that failed there, how
    /// many members were placed before it, and why it fit on none of the
    /// scope's nodes. `None` when no attempt was made.
    pub best: Option<GangFailure>,
}

/// One failed attempt at placing a gang.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangFailure {
    pub scope: Option<u32>,
    pub member: usize,
    pub placed: usize,
    pub why: Explanation,
}

impl fmt::Display for GangExplanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gang of {}", self.members)?;
        if self.locality != Locality::Any {
            let noun = self.locality.noun();
            write!(
                f,
                " fits in no single {noun} ({} tried, {} too small)",
                self.scopes_tried, self.scopes_too_small
            )?;
        }
        match &self.best {
            None if self.locality != Locality::Any && self.scopes_too_small == 0 => {
                write!(f, ": no node is in a {}", self.locality.noun())
            }
            None => Ok(()),
            Some(b) => {
                if let Some(s) = b.scope {
                    write!(f, "; closest: {} {s},", self.locality.noun())?;
                } else {
                    f.write_str(":")?;
                }
                write!(
                    f,
                    " member {} fits nowhere after placing {}: {}",
                    b.member + 1,
                    b.placed,
                    b.why
                )
            }
        }
    }
}

/// The engine's answer for a gang.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GangDecision {
    Placed(GangPlacement),
    Unschedulable(GangExplanation),
}

/// Decides where every member of `gang` goes, or explains why it cannot be
/// placed whole. Does not change `cluster`.
pub fn place_gang<R: Rng + ?Sized>(
    engine: &mut Engine,
    cluster: &Cluster,
    gang: &Gang,
    rng: &mut R,
) -> GangDecision {
    let mut expl = GangExplanation {
        locality: gang.locality,
        members: gang.members.len(),
        scopes_tried: 0,
        scopes_too_small: 0,
        best: None,
    };
    if gang.locality == Locality::Any {
        let mut scratch = cluster.clone();
        return match place_members(engine, &mut scratch, gang, None, rng) {
            Ok(members) => GangDecision::Placed(GangPlacement {
                members,
                scope: None,
            }),
            Err(fail) => {
                expl.best = Some(fail);
                GangDecision::Unschedulable(expl)
            }
        };
    }
    let need = Resources::sum(&gang.members);
    for (scope, free) in scopes_by_free(cluster, gang.locality) {
        if free.gpu_milli < need.gpu_milli
            || free.cpu_milli < need.cpu_milli
            || free.mem_mib < need.mem_mib
        {
            expl.scopes_too_small += 1;
            continue;
        }
        expl.scopes_tried += 1;
        let mut scratch = restricted(cluster, gang.locality, scope);
        let nodes: Vec<u32> = scope_nodes(cluster, gang.locality, scope);
        match place_members(engine, &mut scratch, gang, Some(&nodes), rng) {
            Ok(members) => {
                return GangDecision::Placed(GangPlacement {
                    members,
                    scope: Some(scope),
                })
            }
            Err(mut fail) => {
                fail.scope = Some(scope);
                if expl.best.as_ref().is_none_or(|b| fail.placed > b.placed) {
                    expl.best = Some(fail);
                }
            }
        }
    }
    GangDecision::Unschedulable(expl)
}

/// Places `members` one by one on `scratch`, committing each. `scope`: the
/// nodes the members may use (the others are cordoned on `scratch`), for
/// an explanation that counts only them.
pub(crate) fn place_members<R: Rng + ?Sized>(
    engine: &mut Engine,
    scratch: &mut Cluster,
    gang: &Gang,
    scope: Option<&[u32]>,
    rng: &mut R,
) -> Result<Vec<Placement>, GangFailure> {
    let mut placed = Vec::with_capacity(gang.members.len());
    // Machines closed to the rest of a spread gang: counted as holding a
    // member in an explanation, never as cordoned.
    let mut taken: Vec<u32> = Vec::new();
    for (i, req) in gang.members.iter().enumerate() {
        let fail = |why| GangFailure {
            scope: None,
            member: i,
            placed: i,
            why,
        };
        match engine.decide(scratch, req, rng) {
            Decision::Placed(p) => {
                // The engine only proposes what fits, so this cannot fail;
                // if it did, report it rather than hand out a bad plan.
                if scratch.commit(req, &p).is_err() {
                    return Err(fail(explain_in(scratch, req, scope, &taken)));
                }
                if gang.spread {
                    taken.extend(scratch.host_nodes(p.node));
                    close_host(scratch, p.node);
                }
                placed.push(p);
            }
            Decision::Unschedulable(why) => {
                let why = if scope.is_some() || !taken.is_empty() {
                    explain_in(scratch, req, scope, &taken)
                } else {
                    why
                };
                return Err(fail(why));
            }
        }
    }
    Ok(placed)
}

/// Why `req` fits on none of `scope`'s nodes (all nodes when `None`);
/// `taken`: nodes closed because another member of the gang is there.
pub(crate) fn explain_in(
    cluster: &Cluster,
    req: &Request,
    scope: Option<&[u32]>,
    taken: &[u32],
) -> Explanation {
    let mut why = Explanation::default();
    let mut add = |idx: u32| {
        if taken.contains(&idx) {
            why.add(crate::filter::Reason::OtherMember, 1);
        } else if let Some(state) = cluster.state_of(idx) {
            if let Err(r) = check(state, req) {
                why.add(r, 1);
            }
        }
    };
    match scope {
        Some(nodes) => nodes.iter().copied().for_each(&mut add),
        None => (0..cluster.len() as u32).for_each(&mut add),
    }
    why
}

/// The domains (or regions) with their free capacity on uncordoned nodes,
/// most free GPU share first, then lowest id. Scope 0 (none) is left out.
pub(crate) fn scopes_by_free(cluster: &Cluster, locality: Locality) -> Vec<(u32, Resources)> {
    let mut free: BTreeMap<u32, Resources> = BTreeMap::new();
    for n in cluster.nodes() {
        let scope = locality.scope_of(n);
        if scope == 0 {
            continue;
        }
        let e = free.entry(scope).or_default();
        if !n.cordoned {
            *e = e.saturating_add(Resources {
                gpu_milli: n.gpu_free.iter().map(|&g| u64::from(g)).sum(),
                cpu_milli: u64::from(n.cpu_free),
                mem_mib: n.mem_free,
            });
        }
    }
    let mut v: Vec<_> = free.into_iter().collect();
    v.sort_by(|a, b| b.1.gpu_milli.cmp(&a.1.gpu_milli).then(a.0.cmp(&b.0)));
    v
}

pub(crate) fn scope_nodes(cluster: &Cluster, locality: Locality, scope: u32) -> Vec<u32> {
    cluster
        .nodes()
        .iter()
        .enumerate()
        .filter(|(_, n)| locality.scope_of(n) == scope)
        .map(|(i, _)| i as u32)
        .collect()
}

/// A clone of `cluster` with every node outside `scope` cordoned.
pub(crate) fn restricted(cluster: &Cluster, locality: Locality, scope: u32) -> Cluster {
    let mut c = cluster.clone();
    let outside: Vec<u32> = c
        .nodes()
        .iter()
        .enumerate()
        .filter(|(_, n)| !n.cordoned && locality.scope_of(n) != scope)
        .map(|(i, _)| i as u32)
        .collect();
    for idx in outside {
        // In range by construction.
        let _ = c.set_cordoned(idx, true);
    }
    c
}

/// Applies a gang plan: every member or, on any error, none. The plan is
/// checked against the cluster first, so a stale plan changes nothing.
pub fn commit_gang(
    cluster: &mut Cluster,
    gang: &Gang,
    placement: &GangPlacement,
) -> Result<(), Error> {
    if gang.members.len() != placement.members.len() {
        return Err(Error::InvalidRequest(
            "gang plan has a different number of members",
        ));
    }
    // Dry run over copies of the touched nodes' free capacity.
    let mut free: BTreeMap<u32, (u32, u64, Vec<u16>)> = BTreeMap::new();
    for (req, p) in gang.members.iter().zip(&placement.members) {
        let node = cluster.node(p.node).ok_or(Error::UnknownNode(p.node))?;
        let over = |what| Error::Overcommit { node: p.node, what };
        let (cpu, mem, gpus) = free
            .entry(p.node)
            .or_insert_with(|| (node.cpu_free, node.mem_free, node.gpu_free.clone()));
        *cpu = cpu.checked_sub(req.cpu_milli).ok_or(over("cpu"))?;
        *mem = mem.checked_sub(req.mem_mib).ok_or(over("memory"))?;
        if p.gpus.len() != usize::from(req.gpu.gpu_count()) {
            return Err(over("wrong number of gpus"));
        }
        let per = req.gpu.per_gpu_milli();
        for (i, &g) in p.gpus.iter().enumerate() {
            if p.gpus[..i].contains(&g) {
                return Err(over("gpu named twice"));
            }
            let f = gpus.get_mut(usize::from(g)).ok_or(over("no such gpu"))?;
            *f = f.checked_sub(per).ok_or(over("gpu share"))?;
        }
    }
    for (req, p) in gang.members.iter().zip(&placement.members) {
        cluster.commit(req, p)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::GpuDemand;
    use crate::snapshot::{ModelTable, NodeSpec};
    use crate::{Policy, TargetWorkload};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// `domains[i]` is node i's domain; every node has 4 GPUs.
    fn cluster(domains: &[u32]) -> Cluster {
        let mut m = ModelTable::default();
        let a = m.intern("A").unwrap();
        let mut c = Cluster::new(m);
        for &d in domains {
            let i = c
                .add_node(NodeSpec {
                    model: Some(a),
                    gpus: 4,
                    cpu_milli: 32_000,
                    mem_mib: 1 << 20,
                })
                .unwrap();
            c.set_domain(i, d).unwrap();
        }
        c
    }

    fn engine() -> Engine {
        Engine::new(Policy::Flotilla.scorer(&TargetWorkload::default()))
    }

    fn whole(n: u16) -> Request {
        Request::new(GpuDemand::Whole { count: n }, 1000, 0)
    }

    #[test]
    fn a_gang_that_fits_is_placed_whole_without_touching_the_cluster() {
        let c = cluster(&[0, 0]);
        let gang = Gang::uniform(whole(4), 2, Locality::Any);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let GangDecision::Placed(p) = place_gang(&mut engine(), &c, &gang, &mut rng) else {
            panic!("should fit");
        };
        let mut nodes: Vec<u32> = p.members.iter().map(|m| m.node).collect();
        nodes.sort_unstable();
        assert_eq!(nodes, vec![0, 1]);
        assert_eq!(c.gpu_allocated_milli(), 0);
        let mut c2 = c.clone();
        commit_gang(&mut c2, &gang, &p).unwrap();
        assert_eq!(c2.gpu_allocated_milli(), 8000);
    }

    #[test]
    fn one_member_too_many_places_nothing_and_says_which() {
        let c = cluster(&[0, 0]);
        let gang = Gang::uniform(whole(4), 3, Locality::Any);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let GangDecision::Unschedulable(e) = place_gang(&mut engine(), &c, &gang, &mut rng) else {
            panic!("should not fit");
        };
        assert_eq!(
            e.to_string(),
            "gang of 3: member 3 fits nowhere after placing 2: 0/2 nodes fit: 2 too little free GPU share"
        );
        assert_eq!(c.gpu_allocated_milli(), 0);
    }

    #[test]
    fn a_spread_gang_says_members_hold_the_machines_not_cordons() {
        // Room for all three on two machines, but one member per machine.
        let mut c = cluster(&[0, 0, 0]);
        c.set_cordoned(2, true).unwrap();
        let gang = Gang::uniform(whole(1), 3, Locality::Any).spread();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let GangDecision::Unschedulable(e) = place_gang(&mut engine(), &c, &gang, &mut rng) else {
            panic!("should not fit");
        };
        assert_eq!(
            e.to_string(),
            "gang of 3: member 3 fits nowhere after placing 2: 0/3 nodes fit: 2 holds another member, 1 cordoned"
        );
    }

    #[test]
    fn a_domain_gang_goes_to_the_first_domain_that_holds_it() {
        // Domain 1: nodes 0, 1; domain 2: nodes 2, 3, 4; node 5 in none.
        let mut c = cluster(&[1, 1, 2, 2, 2, 0]);
        // Take 3 GPUs on node 2 so domain 2 has 9 free, domain 1 has 8.
        c.commit(
            &whole(3),
            &Placement {
                node: 2,
                gpus: vec![0, 1, 2],
            },
        )
        .unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        // 2 x 4 GPUs: domain 2 (most free) has only nodes 3 and 4 whole.
        let gang = Gang::uniform(whole(4), 2, Locality::SameDomain);
        let GangDecision::Placed(p) = place_gang(&mut engine(), &c, &gang, &mut rng) else {
            panic!("should fit");
        };
        assert_eq!(p.scope, Some(2));
        assert!(p.members.iter().all(|m| m.node == 3 || m.node == 4));
        // 3 x 3 GPUs: domain 2 has 9 free GPUs but one node has only 1, so
        // it fails there; domain 1 has 8 < 9 and is skipped: nothing fits,
        // even though the cluster as a whole (node 5) could take it.
        let gang = Gang::uniform(whole(3), 3, Locality::SameDomain);
        let GangDecision::Unschedulable(e) = place_gang(&mut engine(), &c, &gang, &mut rng) else {
            panic!("should not fit");
        };
        assert_eq!((e.scopes_tried, e.scopes_too_small), (1, 1));
        assert_eq!(
            e.to_string(),
            "gang of 3 fits in no single domain (1 tried, 1 too small); closest: domain 2, \
             member 3 fits nowhere after placing 2: 0/3 nodes fit: 3 too little free GPU share"
        );
        let any = Gang::uniform(whole(3), 3, Locality::Any);
        assert!(matches!(
            place_gang(&mut engine(), &c, &any, &mut rng),
            GangDecision::Placed(_)
        ));
    }

    #[test]
    fn regions_work_like_domains_and_no_scope_is_explained() {
        let mut c = cluster(&[0, 0, 0]);
        let gang = Gang::uniform(whole(1), 2, Locality::SameRegion);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let GangDecision::Unschedulable(e) = place_gang(&mut engine(), &c, &gang, &mut rng) else {
            panic!("no regions yet");
        };
        assert_eq!(
            e.to_string(),
            "gang of 2 fits in no single region (0 tried, 0 too small): no node is in a region"
        );
        c.set_region(2, 5).unwrap();
        let GangDecision::Placed(p) = place_gang(&mut engine(), &c, &gang, &mut rng) else {
            panic!("region 5 fits");
        };
        assert_eq!(p.scope, Some(5));
        assert!(p.members.iter().all(|m| m.node == 2));
    }

    #[test]
    fn a_stale_plan_commits_nothing() {
        let mut c = cluster(&[0]);
        let gang = Gang::uniform(whole(2), 2, Locality::Any);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let GangDecision::Placed(p) = place_gang(&mut engine(), &c, &gang, &mut rng) else {
            panic!("fits");
        };
        c.commit(
            &whole(1),
            &Placement {
                node: 0,
                gpus: vec![3],
            },
        )
        .unwrap();
        assert!(commit_gang(&mut c, &gang, &p).is_err());
        assert_eq!(c.gpu_allocated_milli(), 1000);
    }
}

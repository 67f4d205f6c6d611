//! Kernel state + desired plan -> the netlink operations that make them
//! equal: a pure function, so restarts and drift are handled by the same
//! code as changes.
//!
//! The agent owns the rules at its priority carrying its protocol number
//! and the routes in its table range carrying the same number
//! ([`super::kernel`]). Tables are keyed by content: a desired route set
//! reuses a kernel table holding exactly those routes, so after a restart a
//! pod whose steering did not change keeps its rule and its table untouched
//! (no gap). A changed set gets a fresh table, filled before any rule points
//! to it; a pod moving between tables gets its new rule before its old one
//! is deleted (a rule added at an existing priority goes after the rules
//! already there, so the old one keeps matching until it is removed, and a
//! `throw` in it falls through to the new one); tables nobody needs any more
//! are emptied last. Partially written tables (a crash mid-way) never match
//! a desired set exactly, so they are replaced, not trusted.
//!
//! A rule is the agent's current kind when it has the agent's
//! [`RuleShape`]: its priority and the packet mark it matches
//! (`fwmark M/M`, set only on packets of connections the pod originated:
//! [`super::nft`]). Rules of another shape (an older agent's unmarked
//! rules, another priority) are replaced like rules pointing to the wrong
//! table: the new one first.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use super::plan::{Plan, Route, RouteSet};

/// One of the agent's policy-routing rules as the kernel holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct KernelRule {
    /// `from` (a /32 or /128).
    pub pod: IpAddr,
    /// `lookup`.
    pub table: u32,
    /// `priority`.
    pub priority: u32,
    /// `fwmark` (0: the rule matches every packet).
    pub fwmark: u32,
    /// `fwmark`'s mask (0 with no fwmark).
    pub fwmask: u32,
}

impl KernelRule {
    /// Whether the rule has the agent's current shape.
    pub fn has_shape(&self, shape: RuleShape) -> bool {
        self.priority == shape.priority && self.fwmark == shape.mark && self.fwmask == shape.mark
    }
}

/// What every rule the agent writes has besides its pod and table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleShape {
    /// `priority`.
    pub priority: u32,
    /// `fwmark mark/mark`: the rule matches only packets carrying the
    /// agent's steering bit (0: every packet, which steers replies too).
    pub mark: u32,
}

impl RuleShape {
    /// The rule for `pod` into `table`.
    pub fn rule(self, pod: IpAddr, table: u32) -> KernelRule {
        KernelRule { pod, table, priority: self.priority, fwmark: self.mark, fwmask: self.mark }
    }
}

/// What the kernel holds in the agent's range.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelView {
    /// The agent's rules.
    pub rules: Vec<KernelRule>,
    /// The agent's tables with their routes.
    pub tables: BTreeMap<u32, RouteSet>,
    /// Table numbers in the range that hold someone else's routes: never
    /// used (adding a route there may meet `EEXIST` for a foreign route).
    pub foreign: BTreeSet<u32>,
}

/// The table numbers the agent may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableRange {
    /// The first.
    pub first: u32,
    /// How many.
    pub count: u32,
}

impl TableRange {
    /// Whether `t` is in the range.
    pub fn contains(&self, t: u32) -> bool {
        t >= self.first && t - self.first < self.count
    }
}

/// One change to the kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Add a route to a table.
    AddRoute {
        /// Table.
        table: u32,
        /// Route.
        route: Route,
    },
    /// Add `from pod lookup table priority P`.
    AddRule {
        /// Pod address.
        pod: IpAddr,
        /// Table.
        table: u32,
    },
    /// Delete a rule.
    DelRule(KernelRule),
    /// Delete a route.
    DelRoute {
        /// Table.
        table: u32,
        /// Route.
        route: Route,
    },
}

/// The operations, in the order they must be applied, and the table each
/// steered pod ends up in.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Operations in order.
    pub ops: Vec<Op>,
    /// Each steered pod's table.
    pub tables: BTreeMap<IpAddr, u32>,
}

/// Why a plan cannot be installed.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReconcileError {
    /// More distinct route sets than table numbers.
    #[error("the table range {first}..{end} is full: {needed} distinct route sets need a table each (raise --table-count)", end = u64::from(*first) + u64::from(*count))]
    TablesExhausted {
        /// First table.
        first: u32,
        /// Size of the range.
        count: u32,
        /// Tables needed.
        needed: usize,
    },
}

/// The operations that turn `kernel` into `plan` (rules of `shape`, tables
/// from `range`).
pub fn reconcile(
    kernel: &KernelView,
    plan: &Plan,
    range: TableRange,
    shape: RuleShape,
) -> Result<Changes, ReconcileError> {
    let wanted: BTreeSet<&RouteSet> = plan.pods.values().collect();
    // Reuse tables whose content matches exactly.
    let mut assigned: BTreeMap<&RouteSet, u32> = BTreeMap::new();
    let mut used: BTreeSet<u32> = BTreeSet::new();
    for (t, routes) in &kernel.tables {
        if wanted.contains(routes) && !assigned.contains_key(routes) && range.contains(*t) {
            assigned.insert(routes, *t);
            used.insert(*t);
        }
    }
    // Fresh tables for the rest: never one the kernel still has content in,
    // one a rule still points to (its routes may have been flushed by the
    // kernel, the rule not), or one with someone else's routes.
    let referenced: BTreeSet<u32> = kernel.rules.iter().map(|r| r.table).collect();
    let mut ops = Vec::new();
    let mut next = range.first;
    let end = u64::from(range.first) + u64::from(range.count);
    for set in &wanted {
        if assigned.contains_key(set) {
            continue;
        }
        while u64::from(next) < end
            && (kernel.tables.contains_key(&next)
                || used.contains(&next)
                || referenced.contains(&next)
                || kernel.foreign.contains(&next))
        {
            next += 1;
        }
        if u64::from(next) >= end {
            return Err(ReconcileError::TablesExhausted {
                first: range.first,
                count: range.count,
                needed: wanted.len(),
            });
        }
        assigned.insert(set, next);
        used.insert(next);
        // Throws first: a table is never, even for a moment, steering a
        // destination it should leave alone.
        let mut routes: Vec<&Route> = set.iter().collect();
        routes.sort_by_key(|r| r.via.is_some());
        ops.extend(routes.into_iter().map(|r| Op::AddRoute { table: next, route: *r }));
    }
    let tables: BTreeMap<IpAddr, u32> = plan.pods.iter().map(|(pod, set)| (*pod, assigned[set])).collect();
    // New rules before old ones go.
    let have: BTreeSet<(IpAddr, u32)> =
        kernel.rules.iter().filter(|r| r.has_shape(shape)).map(|r| (r.pod, r.table)).collect();
    for (pod, table) in &tables {
        if !have.contains(&(*pod, *table)) {
            ops.push(Op::AddRule { pod: *pod, table: *table });
        }
    }
    for r in &kernel.rules {
        if !r.has_shape(shape) || tables.get(&r.pod) != Some(&r.table) {
            ops.push(Op::DelRule(*r));
        }
    }
    let kept: BTreeSet<u32> = assigned.values().copied().collect();
    for (t, routes) in &kernel.tables {
        if !kept.contains(t) {
            ops.extend(routes.iter().map(|r| Op::DelRoute { table: *t, route: *r }));
        }
    }
    Ok(Changes { ops, tables })
}

/// Applies `ops` to a [`KernelView`] as the kernel would (for tests and for
/// checking a run of operations).
pub fn apply(view: &mut KernelView, ops: &[Op], shape: RuleShape) {
    for op in ops {
        match op {
            Op::AddRoute { table, route } => {
                view.tables.entry(*table).or_default().insert(*route);
            }
            Op::DelRoute { table, route } => {
                if let Some(t) = view.tables.get_mut(table) {
                    t.remove(route);
                    if t.is_empty() {
                        view.tables.remove(table);
                    }
                }
            }
            Op::AddRule { pod, table } => view.rules.push(shape.rule(*pod, *table)),
            Op::DelRule(r) => view.rules.retain(|x| x != r),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const P: RuleShape = RuleShape { priority: 100, mark: 0x1000 };
    const RANGE: TableRange = TableRange { first: 1000, count: 4 };

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }
    fn set(hop: &str) -> RouteSet {
        RouteSet::from([
            Route { dst: "0.0.0.0/0".parse().unwrap(), via: Some(ip(hop)), encap: None },
            Route { dst: "198.18.0.0/16".parse().unwrap(), via: None, encap: None },
        ])
    }
    fn plan(pods: &[(&str, &str)]) -> Plan {
        Plan { pods: pods.iter().map(|(p, h)| (ip(p), set(h))).collect(), ..Default::default() }
    }
    /// Resolves each pod's first matching rule's table, as the kernel would.
    fn lookup(view: &KernelView, pod: &str) -> Option<RouteSet> {
        let r = view.rules.iter().find(|r| r.pod == ip(pod))?;
        view.tables.get(&r.table).cloned()
    }

    #[test]
    fn from_empty_tables_are_filled_before_rules_point_to_them() {
        let p =
            plan(&[("198.18.0.10", "203.0.113.10"), ("198.18.0.11", "203.0.113.10"), ("198.18.0.12", "203.0.113.11")]);
        let c = reconcile(&KernelView::default(), &p, RANGE, P).unwrap();
        let first_rule = c.ops.iter().position(|o| matches!(o, Op::AddRule { .. })).unwrap();
        assert!(c.ops[..first_rule].iter().all(|o| matches!(o, Op::AddRoute { .. })));
        assert_eq!(c.ops.iter().filter(|o| matches!(o, Op::AddRule { .. })).count(), 3);
        assert_eq!(c.tables.values().collect::<BTreeSet<_>>().len(), 2, "two distinct route sets, two tables");
        let mut k = KernelView::default();
        apply(&mut k, &c.ops, P);
        assert_eq!(lookup(&k, "198.18.0.10"), Some(set("203.0.113.10")));
        assert_eq!(lookup(&k, "198.18.0.12"), Some(set("203.0.113.11")));
        // Applied again: nothing to do.
        assert_eq!(reconcile(&k, &p, RANGE, P).unwrap().ops, vec![]);
    }

    #[test]
    fn a_restart_keeps_unchanged_pods_untouched_and_repairs_the_rest() {
        let before = plan(&[("198.18.0.10", "203.0.113.10"), ("198.18.0.11", "203.0.113.11")]);
        let mut k = KernelView::default();
        let ops = reconcile(&k, &before, RANGE, P).unwrap().ops;
        apply(&mut k, &ops, P);
        // Drift while the agent was down: a stray rule, a half-written table.
        k.rules.push(P.rule(ip("198.18.0.99"), 1003));
        k.tables.insert(1003, RouteSet::from([Route { dst: "0.0.0.0/0".parse().unwrap(), via: None, encap: None }]));
        // Now: .11 moves to .12's egress IP, .13 is new, .99 is gone.
        let after =
            plan(&[("198.18.0.10", "203.0.113.10"), ("198.18.0.11", "203.0.113.12"), ("198.18.0.13", "203.0.113.10")]);
        let c = reconcile(&k, &after, RANGE, P).unwrap();
        let touches = |pod: &str| {
            c.ops.iter().any(|o| match o {
                Op::AddRule { pod: p, .. } => *p == ip(pod),
                Op::DelRule(r) => r.pod == ip(pod),
                _ => false,
            })
        };
        assert!(!touches("198.18.0.10"), "unchanged pod keeps its rule: {:?}", c.ops);
        let t10 = c.tables[&ip("198.18.0.10")];
        assert!(
            !c.ops
                .iter()
                .any(|o| matches!(o, Op::AddRoute { table, .. } | Op::DelRoute { table, .. } if *table == t10)),
            "unchanged pod's table is not rewritten"
        );
        // Pod .11: the new rule comes before the old one's deletion.
        let add = c.ops.iter().position(|o| matches!(o, Op::AddRule { pod, .. } if *pod == ip("198.18.0.11"))).unwrap();
        let del = c.ops.iter().position(|o| matches!(o, Op::DelRule(r) if r.pod == ip("198.18.0.11"))).unwrap();
        assert!(add < del);
        let mut k2 = k.clone();
        apply(&mut k2, &c.ops, P);
        for (pod, hop) in
            [("198.18.0.10", "203.0.113.10"), ("198.18.0.11", "203.0.113.12"), ("198.18.0.13", "203.0.113.10")]
        {
            assert_eq!(lookup(&k2, pod), Some(set(hop)), "{pod}");
            assert_eq!(k2.rules.iter().filter(|r| r.pod == ip(pod)).count(), 1, "{pod}: one rule");
        }
        assert_eq!(lookup(&k2, "198.18.0.99"), None);
        assert_eq!(k2.tables.len(), 2, "stale tables emptied: {:?}", k2.tables);
        // Every moment in between, each kept pod resolves to its old or new set.
        let mut k3 = k.clone();
        for op in &c.ops {
            apply(&mut k3, std::slice::from_ref(op), P);
            assert_eq!(lookup(&k3, "198.18.0.10"), Some(set("203.0.113.10")), "after {op:?}");
            let s11 = lookup(&k3, "198.18.0.11");
            assert!(s11 == Some(set("203.0.113.11")) || s11 == Some(set("203.0.113.12")), "after {op:?}: {s11:?}");
        }
    }

    #[test]
    fn a_fresh_table_is_never_one_a_rule_or_someone_else_still_uses() {
        // Table 1000 lost its routes (the kernel flushed them) but a stale
        // rule still points to it; 1001 holds a foreign route.
        let k = KernelView {
            rules: vec![P.rule(ip("198.18.0.99"), 1000)],
            tables: BTreeMap::new(),
            foreign: BTreeSet::from([1001]),
        };
        let c = reconcile(&k, &plan(&[("198.18.0.10", "203.0.113.10")]), RANGE, P).unwrap();
        assert_eq!(c.tables[&ip("198.18.0.10")], 1002, "{:?}", c.ops);
    }

    #[test]
    fn rules_of_another_shape_are_replaced_and_a_full_range_is_an_error() {
        let p = plan(&[("198.18.0.10", "203.0.113.10")]);
        // Another priority, and an older agent's rules that match every
        // packet (no fwmark): both give way to the current shape.
        for old in [RuleShape { priority: 50, ..P }, RuleShape { mark: 0, ..P }] {
            let mut k = KernelView::default();
            let ops = reconcile(&k, &p, RANGE, old).unwrap().ops;
            apply(&mut k, &ops, old);
            let c = reconcile(&k, &p, RANGE, P).unwrap();
            let add = c.ops.iter().position(|o| matches!(o, Op::AddRule { .. })).unwrap();
            let del = c.ops.iter().position(|o| matches!(o, Op::DelRule(_))).unwrap();
            assert!(add < del, "the new rule first: {:?}", c.ops);
            apply(&mut k, &c.ops, P);
            assert_eq!(k.rules, vec![P.rule(ip("198.18.0.10"), c.tables[&ip("198.18.0.10")])], "{old:?}");
            assert_eq!(reconcile(&k, &p, RANGE, P).unwrap().ops, vec![]);
        }
        let many = plan(&[
            ("198.18.0.10", "203.0.113.10"),
            ("198.18.0.11", "203.0.113.11"),
            ("198.18.0.12", "203.0.113.12"),
            ("198.18.0.13", "203.0.113.13"),
            ("198.18.0.14", "203.0.113.14"),
        ]);
        let e = reconcile(&KernelView::default(), &many, RANGE, P).unwrap_err();
        assert_eq!(e, ReconcileError::TablesExhausted { first: 1000, count: 4, needed: 5 });
        assert!(e.to_string().contains("1000..1004"), "{e}");
    }
}

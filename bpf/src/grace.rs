//! Waiting out the XDP program's runs in flight.
//!
//! A run of the steering program reads a map, then acts on what it read: the
//! policy's source class, then that class's destination rule; a fast-path
//! entry, then the rewrite it holds. Userspace that replaces such values in
//! steps (a new generation made reachable, then the old one deleted) must not
//! delete what a run that started earlier may still be about to read. That
//! is the RCU rule: publish, wait for a grace period, free.
//!
//! The bpf(2) system call has no "wait for a grace period" command. It does
//! wait for one, documented in the kernel's own comment, after it updates or
//! deletes an element of a map of maps (`maybe_wait_bpf_programs` in
//! kernel/bpf/syscall.c, since Linux 5.0): "wait for any running BPF
//! programs to complete so that userspace, when we return to it, knows that
//! all programs that could be running use the new map value". XDP runs,
//! from a driver's poll or from `BPF_PROG_TEST_RUN`, are RCU read-side
//! critical sections, so they are among the programs waited for.
//! [`GracePeriod::wait`] therefore rewrites the one element of a private
//! one-slot array of maps with the same inner map: nothing changes, and the
//! call returns only after every run that started before it has finished.
//!
//! It costs a grace period (milliseconds, more on a loaded machine), so it
//! belongs on the rare paths: policy replacement and the fast path's fence,
//! never per session.

use std::os::fd::{AsFd, AsRawFd};

use libbpf_rs::{MapCore, MapFlags, MapHandle, MapType};

use crate::BpfError;

/// The name the map of maps shows in `bpftool map`.
pub const GRACE_MAP: &str = "egret_grace";

/// A one-slot array of maps whose update waits for a grace period.
#[derive(Debug)]
pub struct GracePeriod {
    outer: MapHandle,
    inner: MapHandle,
}

impl GracePeriod {
    /// Creates the two maps (a one-slot array as the inner map, and the
    /// one-slot array of maps holding it).
    pub fn new() -> Result<Self, BpfError> {
        let create = |source| BpfError::GraceMap { op: "create", source };
        let plain = libbpf_sys::bpf_map_create_opts {
            sz: std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as libbpf_sys::size_t,
            ..Default::default()
        };
        let inner = MapHandle::create(MapType::Array, Some("egret_grace_in"), 4, 4, 1, &plain).map_err(create)?;
        let of_maps = libbpf_sys::bpf_map_create_opts { inner_map_fd: inner.as_fd().as_raw_fd() as u32, ..plain };
        let outer = MapHandle::create(MapType::ArrayOfMaps, Some(GRACE_MAP), 4, 4, 1, &of_maps).map_err(create)?;
        Ok(Self { outer, inner })
    }

    /// Returns once every BPF program run that started before the call has
    /// finished. The first call fills the empty slot, later ones replace its
    /// map with itself; the kernel waits after either.
    pub fn wait(&self) -> Result<(), BpfError> {
        let fd = self.inner.as_fd().as_raw_fd() as u32;
        self.outer
            .update(&0u32.to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY)
            .map_err(|source| BpfError::GraceMap { op: "update", source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// The update really waits: a grace period (even an expedited one) is
    /// longer than a plain map update, and the call repeats without error.
    /// Needs root, like every test that creates BPF maps. What the wait is
    /// for is shown by bpf/tests/steering.rs `replace_policy_has_no_window`,
    /// which without it fails on Linux 6.1 (tests/guest-kernel).
    #[test]
    fn wait_takes_a_grace_period_and_repeats() {
        let g = GracePeriod::new().expect("map of maps");
        let plain = MapHandle::create(
            MapType::Array,
            Some("egret_grace_cmp"),
            4,
            4,
            1,
            &libbpf_sys::bpf_map_create_opts {
                sz: std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as libbpf_sys::size_t,
                ..Default::default()
            },
        )
        .unwrap();
        let time = |f: &dyn Fn()| {
            let t = Instant::now();
            for _ in 0..5 {
                f();
            }
            t.elapsed() / 5
        };
        let waited = time(&|| g.wait().unwrap());
        let updated = time(&|| plain.update(&0u32.to_ne_bytes(), &1u32.to_ne_bytes(), MapFlags::ANY).unwrap());
        eprintln!("grace period {waited:?}, plain update {updated:?}");
        assert!(waited > updated * 2, "a grace period of {waited:?} against a plain update of {updated:?}");
    }
}

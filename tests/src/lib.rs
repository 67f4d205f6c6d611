//! The network-namespace lab and helpers for end-to-end tests.

pub mod apiserver;

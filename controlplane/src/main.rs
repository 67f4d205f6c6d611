//! The `egret` binary.
fn main() {}

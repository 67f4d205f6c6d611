//! The lab CLI (placeholder, filled in below).
fn main() {}

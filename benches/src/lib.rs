//! Benchmark support for Egret.

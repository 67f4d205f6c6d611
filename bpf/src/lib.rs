//! The XDP program that steers the frames Egret handles to AF_XDP sockets, its map layouts shared with Rust, and its loader.

pub mod auth;
pub mod channel;

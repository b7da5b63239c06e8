//! One module per lab. Each exposes `routes() -> Router<AppState>`; labs with state of their own
//! keep it in a struct on [`crate::app::AppState`], built at start-up from a
//! [`crate::app::StartupContext`].

pub mod cache;
pub mod contracts;
pub mod http;
pub mod messaging;
pub mod ordered;
pub mod pipeline;
pub mod privacy;
pub mod security;
pub mod sql;
pub mod worker;

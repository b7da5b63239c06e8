//! The SQLite store every lab writes through: the ordered-inbox library's single-writer store
//! with group commit ([`ordered_inbox::sqlite::store`]), opened once by the server with the labs'
//! migrations ([`schema`]) and the inbox's, and shared by the labs for their own tables.

pub use ordered_inbox::sqlite::store::{
    BUSY_TIMEOUT, MAX_BATCH, Store, StoreError, StoreStats, is_busy, is_constraint,
};

pub mod schema;
